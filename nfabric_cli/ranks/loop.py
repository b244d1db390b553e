"""The loop a fabric rank runs on a workload: the one validation, tests and benchmarks share."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn


def workload_steps(ddp: nn.Module, state: Any, workload: Any, optimizer: Any, scheduler: Any,
                   steps: range | int, rank: int, world_size: int, seed: int,
                   before_step: Callable[[int], None] | None = None,
                   ) -> Iterator[tuple[int, float, float]]:
    """Train the DDP model on `workload`'s batches for `steps` (a count, or a range of step
    indices): forward, the loss to the fabric's health monitor (`state.observe`, or an arm's;
    None for plain DDP), backward, optimizer and scheduler step. Yields (step, loss, seconds
    of the step, batch building excluded) after each; `before_step(step)` runs first."""
    for step in range(steps) if isinstance(steps, int) else steps:
        if before_step is not None:
            before_step(step)
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
