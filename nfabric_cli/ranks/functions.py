"""Run a Python function on N real gloo ranks spawned from this process; gather the results.

For tests and benchmarks: `fn(rank, world_size, *args)` must be importable (module level, as
`spawn` requires). Ranks rendezvous through a FileStore in a temporary directory (no port to
race for), run one intra-op thread each, and return what `fn` returns (saved with
`torch.save`, so tensors come back as they were).

Ranks start from a fork server that imported torch and nfabric once (where the platform has
one, `PRELOAD`; why and what: `preload.py`): the test suite starts ranks some hundred times.
Each rank takes the caller's environment and working directory as they are at the call, as a
spawned one would; only what the preloaded modules read at import time is the fork server's.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: What the fork server imports once for every rank it forks (`preload.py`).
PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "nfabric_cli.ranks.preload"]


def _entry(rank: int, fn: Callable[..., Any], world_size: int, tmp: str, args: tuple,
           env: dict[str, str]) -> None:
    os.environ.clear()  # (multiprocessing itself gives each rank the caller's cwd and sys.path)
    os.environ.update(env)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tmp, "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(tmp, f"result{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_function_ranks(fn: Callable[..., Any], world_size: int, *args: Any,
                       timeout: float | None = None) -> list[Any]:
    """Spawn `world_size` gloo ranks running ``fn(rank, world_size, *args)``; their results in
    rank order. A rank that raises fails the call (torch.multiprocessing's ProcessRaisedException);
    ranks still running after `timeout` seconds are killed and the call raises TimeoutError
    (for a test of something that once hung: it fails instead of stalling the suite)."""
    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    if method == "forkserver":
        mp.get_context(method).set_forkserver_preload(PRELOAD)  # once the server runs: no-op
    with tempfile.TemporaryDirectory(prefix="nfabric-ranks-") as tmp:
        ctx = mp.start_processes(_entry, args=(fn, world_size, tmp, args, dict(os.environ)),
                                 nprocs=world_size, start_method=method, join=False)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not ctx.join(None if deadline is None else max(0.0, deadline - time.monotonic())):
            if deadline is not None and time.monotonic() >= deadline:
                for p in ctx.processes:
                    p.kill()
                    p.join()
                raise TimeoutError(f"{world_size} ranks of {fn.__name__} still running after "
                                   f"{timeout:g} s: killed")
        return [torch.load(os.path.join(tmp, f"result{r}.pt"), weights_only=False)
                for r in range(world_size)]
