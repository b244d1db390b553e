"""A rank process's own end: whether a launcher started it as a rank, and how it leaves
(without the interpreter's teardown, as multiprocessing's children do).

A gloo worker thread may still be releasing the last collective's tensors when a rank's main
thread returns: that needs the GIL, which a finalising interpreter never gives back, so the
thread is unwound and the rank dies of `std::terminate` (SIGABRT, "terminate called without an
active exception") after its work was done. `destroy_process_group` does not prevent it: a
gloo group joins its threads only when its last reference goes, and a DDP model built on the
group keeps one alive past `del` and `gc.collect()` (measured on torch 2.13: DDP's group's
threads survive both). Measured under load, `torchrun ... nfabric validate`: 3 of 40 runs
aborted a rank at exit; the core showed a `pt_gloo_runloop` thread in `~AsyncBroadcastWork`,
taking the GIL inside `Py_FinalizeEx`.

So a process that is only a rank (a spawned validate or replay rank, `nfabric` run as a
torchrun rank) flushes what it wrote and ends with `os._exit`: nothing of the teardown it
skips is needed (fabric states are closed, reports written atomically before this).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def env_rank() -> tuple[int, int] | None:
    """(rank, world size) when torchrun (or any env:// launcher) started this process as one
    rank (``RANK``, ``WORLD_SIZE``), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def exit_rank(code: int | str | None) -> NoReturn:
    """Flush stdout, stderr and logging, then leave with `code` (SystemExit's convention:
    None is 0, a message is printed and exits 1) without the interpreter's teardown."""
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code or 0)
