"""Tiny plugin workloads for validation tests: an MLP classifier on a fixed synthetic task.

`build()` is small (fast multi-process tests); `build_wide()` has ~140k parameters so a shaped
link carries enough bytes for its counters to be compared with the claimed traffic;
`build_branch()` routes each batch through one of two experts, so a step may leave parameters
out of a rank's graph, or out of every rank's (DDP's find_unused_parameters=True).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from nfabric_cli.workloads.common import BaseWorkload, accuracy


class TinyWorkload(BaseWorkload):
    name = "tiny"
    metric_name = "accuracy"
    higher_is_better = True
    default_steps = 8
    batch_size = 16
    head_selector = "head.*"

    def __init__(self, hidden: int = 32, features: int = 16, classes: int = 4) -> None:
        gen = torch.Generator().manual_seed(1234)
        centers = torch.randn(classes, features, generator=gen) * 2.0
        y = torch.randint(0, classes, (768,), generator=gen)
        x = centers[y] + torch.randn(768, features, generator=gen)
        self.x_train, self.y_train = x[:512], y[:512]
        self.x_test, self.y_test = x[512:], y[512:]
        self.hidden, self.features, self.classes = hidden, features, classes

    def _train_size(self) -> int:
        return len(self.y_train)

    def _gather(self, indices: np.ndarray, epoch: int) -> tuple[torch.Tensor, ...]:
        index = torch.from_numpy(indices)
        return self.x_train[index], self.y_train[index]

    def _make_model(self) -> nn.Module:
        return MLP(self.features, self.hidden, self.classes)

    def make_optimizer(self, params, total_steps: int):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9), None

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    def _metric(self, model: nn.Module) -> float:
        return accuracy(model, self.x_test, self.y_test)

    def data_fingerprint(self) -> str:
        return "tiny-synthetic-1234"


class MLP(nn.Module):
    """`body` (two tanh layers) and a linear `head`."""

    def __init__(self, features: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh()
        )
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def build() -> TinyWorkload:
    return TinyWorkload()


def build_wide() -> TinyWorkload:
    return TinyWorkload(hidden=256, features=256)


def through_a(x: torch.Tensor) -> bool:
    """Whether `BranchMLP` sends batch `x` through expert `a`: its first feature's mean above
    the training set's (0.37)."""
    return float(x[:, 0].mean()) > 0.37


class BranchMLP(MLP):
    """`MLP` whose batch goes through expert `a` or `b` (`through_a`): some steps leave an
    expert out of a rank's graph, some out of every rank's."""

    def __init__(self, features: int, hidden: int, classes: int) -> None:
        super().__init__(features, hidden, classes)
        self.a, self.b = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        expert = self.a if through_a(x) else self.b
        return self.head(torch.tanh(expert(self.body(x))))


class BranchWorkload(TinyWorkload):
    name = "tiny-branch"
    find_unused_parameters = True

    def _make_model(self) -> nn.Module:
        return BranchMLP(self.features, self.hidden, self.classes)


def build_branch() -> BranchWorkload:
    return BranchWorkload()


class BareEvalWorkload(TinyWorkload):
    """`TinyWorkload` with dropout, whose `evaluate` sets no mode and takes no care (as a
    plugin may write it): the stages must call it in eval mode."""

    name = "tiny-bare-eval"

    def _make_model(self) -> nn.Module:
        net = MLP(self.features, self.hidden, self.classes)
        net.body.insert(2, nn.Dropout(0.5))
        return net

    def evaluate(self, model: nn.Module) -> float:
        return float((model(self.x_test).argmax(-1) == self.y_test).float().mean())


def build_bare_eval() -> BareEvalWorkload:
    return BareEvalWorkload()
