"""Pre-LN Transformer blocks shared by the `transformer` and `lm` workloads.

Parameter names follow a Pythia-like layout at tiny size (`blocks.N.ln1`, `blocks.N.attn.qkv`,
`blocks.N.attn.proj`, `blocks.N.ln2`, `blocks.N.mlp.fc_in`, `blocks.N.mlp.fc_out`), so region
selectors written for real models (`blocks.*.attn.*`, `type:LayerNorm`) select something here.
No buffers: nothing for DDP to broadcast, nothing that differs between ranks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class SelfAttention(nn.Module):
    """Multi-head self-attention with one fused `qkv` projection and an output `proj`."""

    def __init__(self, dim: int, heads: int, causal: bool) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        self.heads = heads
        self.causal = causal
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc_in = nn.Linear(dim, hidden)
        self.fc_out = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))


class Block(nn.Module):
    """Pre-LN residual block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, dim: int, heads: int, causal: bool, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads, causal)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, mlp_ratio * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def gpt_init(model: nn.Module, n_blocks: int, std: float = 0.02) -> None:
    """GPT-2 initialisation: N(0, std) weights, zero biases, residual projections scaled by
    1/sqrt(2 * n_blocks) so the residual stream's variance does not grow with depth."""
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            scale = std
            if name.endswith(("attn.proj", "mlp.fc_out")):
                scale = std / math.sqrt(2 * n_blocks)
            nn.init.normal_(module.weight, mean=0.0, std=scale)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
