"""What the fork server of `run_function_ranks` imports once for every rank it forks.

A rank of the tests and benchmarks imports nfabric's hook, simulator and workloads and
scikit-learn's digits after torch: ~1.7-2.1 s of CPU per rank at every call when each rank did
it (0.04 s preloaded; torch itself, preloaded before, costs ~2 s more). Each import is tried
on its own and any failure is left to the rank that needs the module: the fork server stops at
the first exception other than ImportError, and with it every call's ranks. None of these
modules reads a setting at import (nfabric's `NFABRIC_*` are read at call time, from the
caller's environment set in each rank: `tests/test_function_ranks.py`). scipy's and
scikit-learn's thread pools (BLAS, OpenMP) are loaded here, before a rank sets one thread:
they are held to one thread here, which the ranks inherit.

`torch._dynamo` is imported by torch's optimizers the first time one is built (their
constructors are wrapped to keep dynamo out): ~1.5 s of CPU in every rank that builds one, left
to each rank; preloaded, 0.02 s (a two-rank call that builds an SGD: 1.76 s, then 0.09 s). Its
import starts no thread, so the fork server still forks a single-threaded process.
"""

from __future__ import annotations

import contextlib
import importlib

MODULES = ("torch._dynamo", "sklearn.datasets", "sklearn.model_selection",
           "nfabric_cli.runtime.attach", "nfabric_cli.calibration.simulate",
           "nfabric_cli.ranks.loop", "nfabric_cli.workloads.vision",
           "nfabric_cli.workloads.transformer", "nfabric_cli.workloads.glyphs",
           "nfabric_cli.workloads.lm")

for _name in MODULES:
    with contextlib.suppress(Exception):
        importlib.import_module(_name)

with contextlib.suppress(Exception):
    from threadpoolctl import threadpool_limits

    threadpool_limits(1)
