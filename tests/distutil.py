"""Run a function on N real gloo ranks (spawned processes) and collect each rank's result.

The function must be importable (module level). Ranks rendezvous through a FileStore in a
temp directory, so parallel test runs never race for a port.
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


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Spawn `world_size` gloo ranks running fn(rank, world_size, *args); return their results."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _entry, args=(fn, world_size, tmp, args), nprocs=world_size, start_method="spawn"
        )
        return [
            torch.load(os.path.join(tmp, f"result{r}.pt"), weights_only=False)
            for r in range(world_size)
        ]
