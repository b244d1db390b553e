"""Tiny models for multi-process runtime tests."""

from __future__ import annotations

import torch
from torch import nn


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


def train_steps(ddp, opt, state, rank: int, start: int, stop: int) -> None:  # noqa: ANN001
    """Steps `start` .. `stop - 1` of the tests' training loop on `batch(step, rank)`, the
    loss observed by the fabric `state` (None: plain DDP)."""
    import torch.nn.functional as F

    for step in range(start, stop):
        x, y = batch(step, rank)
        loss = F.cross_entropy(ddp(x), y)
        if state is not None:
            state.observe(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
