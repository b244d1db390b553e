"""Tiny models for multi-process runtime tests."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from nfabric_cli import attach
from nfabric_cli.binding import compile_profile, static_profile
from nfabric_cli.runtime.state import FabricState
from tests.calibration.tiny import TinyWorkload


class TinyNet(nn.Module):
    """body (two linear layers, a LayerNorm) + head; an optional unused branch."""

    def __init__(self, unused_branch: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.LayerNorm(32))
        self.head = nn.Linear(32, 4)
        self.unused = nn.Linear(32, 32) if unused_branch else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def make_model(seed: int = 0, unused_branch: bool = False) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet(unused_branch)


def batch(step: int, rank: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 16, generator=gen)
    y = torch.randint(0, 4, (n,), generator=gen)
    return x, y


def train_steps(ddp, opt, state, rank: int, start: int, stop: int,  # noqa: ANN001
                device: str | torch.device = "cpu") -> None:
    """Steps `start` .. `stop - 1` of the tests' training loop on `batch(step, rank)` (moved
    to `device`), the loss observed by the fabric `state` (None: plain DDP)."""
    import torch.nn.functional as F

    for step in range(start, stop):
        x, y = (t.to(device) for t in batch(step, rank))
        loss = F.cross_entropy(ddp(x), y)
        if state is not None:
            state.observe(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()


def tiny_ddp(world: int, steps: int, route: str | None = "sign", **options: Any
             ) -> tuple[TinyWorkload, nn.Module, DDP, FabricState | None]:
    """The tiny calibration workload's model (seed 0) under DDP, with the fabric attached on
    `route` for every parameter (`options`: `attach`'s) or, with None, plain DDP."""
    wl = TinyWorkload()
    model = wl.build_model(0)
    ddp = DDP(model)
    state = None
    if route is not None:
        bindings = compile_profile(static_profile(model, route), model, world_size=world,
                                   total_steps=steps)
        state = attach(ddp, bindings, total_steps=steps, **options)
    return wl, model, ddp, state
