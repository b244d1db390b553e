"""A complete nfabric workload plugin: an MLP on scikit-learn's breast-cancer data (569 samples).

Use it from the repository root (the current directory is on the import path):

    nfabric workloads --workload examples.plugin_workload:workload
    nfabric calibrate ... --workload examples.plugin_workload:workload
    nfabric compile-profile ... --model examples.plugin_workload:model

A workload is any object with the attributes and methods below (the protocol is
`nfabric_cli/workloads/base.py`); it need not import nfabric at all. The rules that matter:
- deterministic: the same seed gives the same initial weights and the same batches;
- sharded: rank r of W trains only on its own shard (disjoint across ranks, covering the set);
- random access: `train_batch(step, ...)` needs no earlier call (resumed runs, simulations);
- DDP-friendly model: every parameter gets a gradient each step (or the workload says
  `find_unused_parameters = True`), no rank-specific buffers;
- `evaluate` is called in eval mode, without gradients: it need not set either itself.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """Two hidden layers (`body`) and a separate output layer (`head`, the sensitive part)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(30, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class BreastCancerMLP:
    """Benign/malignant tumour classification from 30 measured features."""

    name = "breast-cancer-mlp"
    description = "MLP, scikit-learn breast cancer"  # optional: shown by `nfabric workloads`
    metric_name = "accuracy"  # what evaluate() returns
    higher_is_better = True  # False for a loss
    default_steps = 150  # steps at which FP32 training reaches a good metric
    batch_size = 16  # per rank
    head_selector = "head.*"  # parameters of the sensitive output layer (a glob over names)

    def __init__(self) -> None:
        from sklearn.datasets import load_breast_cancer

        data = load_breast_cancer()
        x = data.data.astype(np.float32)
        y = data.target.astype(np.int64)
        order = np.random.default_rng(0).permutation(len(y))  # fixed split, same on every rank
        train, test = order[:455], order[455:]
        mean, std = x[train].mean(0), x[train].std(0) + 1e-6
        self.x_train = torch.from_numpy((x[train] - mean) / std)
        self.y_train = torch.from_numpy(y[train])
        self.x_test = torch.from_numpy((x[test] - mean) / std)
        self.y_test = torch.from_numpy(y[test])
        self._fingerprint = hashlib.sha256(x.tobytes() + y.tobytes()).hexdigest()

    def build_model(self, seed: int) -> nn.Module:
        """Weights depend only on `seed`; the global RNG is left as it was."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return MLP()

    def make_optimizer(self, params, total_steps: int):
        """(optimizer, scheduler or None); the scheduler is stepped once per training step."""
        opt = torch.optim.AdamW(params, lr=3e-3)
        return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(1, total_steps))

    def shard_indices(self, rank: int, world_size: int) -> np.ndarray:
        """Rank r owns samples r, r+W, r+2W, ...: disjoint across ranks, covering the set."""
        return np.arange(rank, len(self.y_train), world_size)

    def train_batch(self, step: int, rank: int, world_size: int, seed: int):
        """Rank `rank`'s batch at `step`: a per-epoch permutation of its shard from the seed."""
        shard = self.shard_indices(rank, world_size)
        per_epoch = len(shard) // self.batch_size
        epoch, within = divmod(step, per_epoch)
        order = np.random.default_rng([seed, rank, epoch]).permutation(len(shard))
        index = torch.from_numpy(shard[order[within * self.batch_size :][: self.batch_size]])
        return self.x_train[index], self.y_train[index]

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    def evaluate(self, model: nn.Module) -> float:
        """Held-out accuracy; fast (well under a second)."""
        with torch.no_grad():
            return float((model(self.x_test).argmax(-1) == self.y_test).float().mean())

    def data_fingerprint(self) -> str:
        return self._fingerprint


def workload() -> BreastCancerMLP:
    """`--workload examples.plugin_workload:workload`"""
    return BreastCancerMLP()


def model() -> nn.Module:
    """`--model examples.plugin_workload:model`: commands that need only a model."""
    return BreastCancerMLP().build_model(0)
