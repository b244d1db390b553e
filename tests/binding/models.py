"""Small models with the structures compile-profile must handle, importable as plugins
(`--model tests.binding.models:tied`)."""

from __future__ import annotations

import torch
from torch import nn


def mlp() -> nn.Module:
    """0: Linear(30, 40), 1: LayerNorm(40), 3: Linear(40, 10): 6 parameters, 1,730 elements."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(30, 40), nn.LayerNorm(40), nn.ReLU(), nn.Linear(40, 10))


class Tied(nn.Module):
    """Embedding and output head share one tensor (first name: embed.weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(self.embed(x))))


def tied() -> nn.Module:
    torch.manual_seed(0)
    return Tied()


class Frozen(nn.Module):
    """A frozen backbone (no routes) under a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)
        for p in self.backbone.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def frozen() -> nn.Module:
    return Frozen()


class Unused(nn.Module):
    """`spare` never takes part in forward (DDP needs find_unused_parameters=True)."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(8, 8)
        self.spare = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.used(x)))


def unused() -> nn.Module:
    torch.manual_seed(0)
    return Unused()


class MyNorm(nn.LayerNorm):
    """A LayerNorm subclass: `type:LayerNorm` must still match it."""


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.norm = MyNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x + self.attn(x)))


class Nested(nn.Module):
    def __init__(self, d: int = 8, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(d) for _ in range(depth)])
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def nested() -> nn.Module:
    torch.manual_seed(0)
    return Nested()


class Split(nn.Module):
    """With bucket_cap_mb=0.25 (65,536 fp32 elements) DDP's first bucket closes right after
    mid.bias: head (60,010) + mid.bias (6,000) >= 65,536, so mid.weight opens bucket 1 and
    the two parameters of `mid` land in different buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 100)
        self.mid = nn.Linear(100, 6000)
        self.head = nn.Linear(6000, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(torch.relu(self.first(x)))))


def split() -> nn.Module:
    torch.manual_seed(0)
    return Split()


def not_a_module() -> int:
    return 42
