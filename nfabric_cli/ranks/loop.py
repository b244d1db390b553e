"""The loop a fabric rank runs on a workload: the one validation, tests and benchmarks share."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


class RankRng:
    """One rank's random stream for its batches, forward and backward passes (dropout masks,
    random augmentation): it starts from ``manual_seed(seed)`` on every rank, and `active`
    swaps it into torch's global CPU generator for one step. Nothing else drawn in the process
    (another arm trained beside it, the code between steps) moves it, and the calibration
    simulator gives each simulated rank the same stream, so dropout masks match the run (on
    the CPU, where both run: a GPU draws its masks from its own generator)."""

    def __init__(self, seed: int) -> None:
        self.state = torch.Generator().manual_seed(int(seed)).get_state()

    @contextmanager
    def active(self) -> Iterator[None]:
        saved = torch.get_rng_state()
        torch.set_rng_state(self.state)
        try:
            yield
            self.state = torch.get_rng_state()
        finally:
            torch.set_rng_state(saved)


def workload_ddp(workload: Any, seed: int, bucket_cap_mb: float | None = None) -> nn.Module:
    """`workload`'s model from `seed` under DDP as every real rank here trains it: the
    bucket cap given (None: DDP's default), find_unused_parameters as the workload says."""
    from torch.nn.parallel import DistributedDataParallel

    from nfabric_cli.workloads.base import find_unused

    return DistributedDataParallel(workload.build_model(seed), bucket_cap_mb=bucket_cap_mb,
                                   find_unused_parameters=find_unused(workload))


def workload_steps(ddp: nn.Module, state: Any, workload: Any, optimizer: Any, scheduler: Any,
                   steps: range | int, rank: int, world_size: int, seed: int,
                   before_step: Callable[[int], None] | None = None,
                   rng: RankRng | None = None,
                   ) -> Iterator[tuple[int, float, float]]:
    """Train the DDP model on `workload`'s batches for `steps` (a count, or a range of step
    indices): forward, the loss to the fabric's health monitor (`state.observe`, or an arm's;
    None for plain DDP), backward, optimizer and scheduler step. Yields (step, loss, seconds
    of the step, batch building excluded) after each; `before_step(step)` runs first.
    Batches, forward and backward draw from `rng` (default: a fresh stream from `seed`; pass
    one to carry a rank's stream across several calls, as a run trained in blocks does)."""
    rng = rng or RankRng(seed)
    for step in range(steps) if isinstance(steps, int) else steps:
        if before_step is not None:
            before_step(step)
        with rng.active():
            batch = workload.train_batch(step, rank, world_size, seed)
            t0 = time.perf_counter()
            loss = workload.loss(ddp, batch)
            if state is not None:
                state.observe(loss)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        seconds = time.perf_counter() - t0
        yield step, float(loss.detach()), seconds


def train_workload(ddp: nn.Module, state: Any, workload: Any, optimizer: Any, scheduler: Any,
                   steps: range | int, rank: int, world_size: int, seed: int) -> list[float]:
    """`workload_steps` run to the end; the losses."""
    return [loss for _, loss, _ in workload_steps(ddp, state, workload, optimizer, scheduler,
                                                  steps, rank, world_size, seed)]
