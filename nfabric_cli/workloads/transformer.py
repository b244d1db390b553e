"""`transformer`: a pre-LN Transformer encoder classifier on the digits, one token per image row.

Each 8x8 digit becomes a sequence of 8 tokens of 8 pixel features; a learned `cls_token` is
prepended and its final state goes through `ln_f` and the linear `head`, as in BERT-style
sequence classifiers. Attention across rows is what lets the model see the digit's shape, so
the task exercises every part of an encoder (token and position embeddings, attention, MLP,
LayerNorm) on real data that ships with scikit-learn.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from nfabric_cli.workloads.common import BaseWorkload, accuracy, model_device, warmup_cosine
from nfabric_cli.workloads.images import load_digits_data
from nfabric_cli.workloads.layers import Block, gpt_init


class EncoderClassifier(nn.Module):
    """Linear token `embed`, learned `pos_embed` and `cls_token`, pre-LN `blocks`, `ln_f`, `head`."""

    def __init__(
        self, features: int, tokens: int, classes: int, dim: int, depth: int, heads: int
    ) -> None:
        super().__init__()
        self.embed = nn.Linear(features, dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, tokens + 1, dim))
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.blocks = nn.ModuleList(Block(dim, heads, causal=False) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)
        gpt_init(self, depth)
        nn.init.normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x)
        cls = self.cls_token.expand(len(x), -1, -1)
        h = torch.cat([cls, tokens], dim=1) + self.pos_embed
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h[:, 0]))


class TransformerWorkload(BaseWorkload):
    """Encoder classifier over digit rows; metric: test accuracy (higher is better)."""

    name = "transformer"
    description = "pre-LN encoder, digit rows as tokens"
    metric_name = "accuracy"
    higher_is_better = True
    default_steps = 300
    batch_size = 32
    head_selector = "head.*"
    dim, depth, heads, lr = 64, 2, 4, 3e-3

    def __init__(self) -> None:
        self.data = load_digits_data()
        # (N, 1, 8, 8) images -> (N, 8 rows, 8 features) token sequences
        self.x_train = self.data.x_train.squeeze(1).contiguous()
        self.x_test = self.data.x_test.squeeze(1).contiguous()

    def _train_size(self) -> int:
        return len(self.data.y_train)

    def _gather(self, indices: np.ndarray, epoch: int) -> tuple[torch.Tensor, ...]:
        index = torch.from_numpy(indices)
        return self.x_train[index], self.data.y_train[index]

    def _make_model(self) -> nn.Module:
        _, tokens, features = self.x_train.shape
        return EncoderClassifier(
            features, tokens, self.data.num_classes, self.dim, self.depth, self.heads
        )

    def make_optimizer(self, params: Any, total_steps: int) -> tuple[torch.optim.Optimizer, Any]:
        opt = torch.optim.AdamW(params, lr=self.lr, weight_decay=0.01)
        return opt, warmup_cosine(opt, total_steps, warmup_frac=0.1)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = batch
        device = model_device(model)
        return F.cross_entropy(model(x.to(device)), y.to(device))

    def _metric(self, model: nn.Module) -> float:
        return accuracy(model, self.x_test, self.data.y_test)

    def data_fingerprint(self) -> str:
        return self.data.fingerprint
