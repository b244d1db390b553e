"""Run a Python function on N real gloo ranks spawned from this process; gather the results.

For tests and benchmarks: `fn(rank, world_size, *args)` must be importable (module level, as
`spawn` requires). Ranks rendezvous through a FileStore in a temporary directory (no port to
race for), run one intra-op thread each, and return what `fn` returns (saved with
`torch.save`, so tensors come back as they were).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn: Callable[..., Any], world_size: int, tmp: str, args: tuple) -> None:
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


def run_function_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Spawn `world_size` gloo ranks running ``fn(rank, world_size, *args)``; their results in
    rank order. A rank that raises fails the call (torch.multiprocessing's ProcessRaisedException)."""
    with tempfile.TemporaryDirectory(prefix="nfabric-ranks-") as tmp:
        mp.start_processes(_entry, args=(fn, world_size, tmp, args), nprocs=world_size,
                           start_method="spawn")
        return [torch.load(os.path.join(tmp, f"result{r}.pt"), weights_only=False)
                for r in range(world_size)]
