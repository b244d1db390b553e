"""Shared test helper: simulated data-parallel FP32 training of a workload in one process."""

from __future__ import annotations

import torch

from nfabric_cli.workloads.base import Workload


def train(w: Workload, steps: int, world_size: int, seed: int) -> torch.nn.Module:
    """Mean of the per-rank gradients, one optimizer step, `steps` times (what DDP computes)."""
    model = w.build_model(seed)
    opt, sched = w.make_optimizer(model.parameters(), steps)
    for step in range(steps):
        opt.zero_grad()
        for rank in range(world_size):
            (w.loss(model, w.train_batch(step, rank, world_size, seed)) / world_size).backward()
        opt.step()
        if sched is not None:
            sched.step()
    return model
