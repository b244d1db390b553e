"""A tiny workload for fast calibration tests: a 2-layer MLP on a fixed synthetic task.

400 points in 12 dimensions, labels from a fixed random linear map (4 classes), split
320 train / 80 test. A step costs well under a millisecond, so a study of several trials runs
in about a second. Use it as `tests.calibration.tiny:workload`.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from nfabric_cli.workloads.common import BaseWorkload, accuracy, warmup_cosine


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(12, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.norm(self.body(x))))


class TinyWorkload(BaseWorkload):
    name = "tiny"
    metric_name = "accuracy"
    higher_is_better = True
    default_steps = 6
    batch_size = 16
    head_selector = "head.*"

    def __init__(self) -> None:
        rng = np.random.default_rng(1234)
        x = rng.standard_normal((400, 12)).astype(np.float32)
        y = (x @ rng.standard_normal((12, 4))).argmax(1)
        self.x, self.y = torch.from_numpy(x), torch.from_numpy(y).long()
        self.fingerprint = hashlib.sha256(x.tobytes() + y.tobytes()).hexdigest()

    def _train_size(self) -> int:
        return 320

    def _gather(self, indices: np.ndarray, epoch: int) -> tuple[torch.Tensor, ...]:
        index = torch.from_numpy(indices)
        return self.x[index], self.y[index]

    def _make_model(self) -> nn.Module:
        return TinyNet()

    def make_optimizer(self, params, total_steps: int):  # noqa: ANN001
        opt = torch.optim.SGD(params, lr=0.2, momentum=0.9)
        return opt, warmup_cosine(opt, total_steps)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    def _metric(self, model: nn.Module) -> float:
        return accuracy(model, self.x[320:], self.y[320:])

    def data_fingerprint(self) -> str:
        return self.fingerprint


def workload() -> TinyWorkload:
    return TinyWorkload()


class _BrokenLoss(TinyWorkload):
    """A plugin with a bug of its own: its loss raises (the CLI says so, exit 2)."""

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y[:3])  # a slicing slip: torch refuses the sizes


def broken() -> TinyWorkload:
    return _BrokenLoss()


class _LateBatch(TinyWorkload):
    """A plugin whose data breaks at step 3: in a simulated rank's process by then."""

    def train_batch(self, step: int, rank: int, world_size: int, seed: int):  # noqa: ANN201
        if step >= 3:
            raise ValueError(f"the loader broke at step {step}")
        return super().train_batch(step, rank, world_size, seed)


def late() -> TinyWorkload:
    return _LateBatch()


class TinyBNWorkload(TinyWorkload):
    """`TinyWorkload` with BatchNorm: running statistics, which DDP broadcasts from rank 0."""

    name = "tiny-bn"

    def _make_model(self) -> nn.Module:
        net = TinyNet()
        net.norm = nn.BatchNorm1d(32)
        return net


class TinySyncBNWorkload(TinyWorkload):
    """`TinyWorkload` with SyncBatchNorm (which GPU ranks normalise over every rank's batch)."""

    def _make_model(self) -> nn.Module:
        net = TinyNet()
        net.norm = nn.SyncBatchNorm(32)
        return net


def syncbn_workload() -> TinySyncBNWorkload:
    return TinySyncBNWorkload()


class QuirkNet(nn.Module):
    """Convolutions (channels_last when asked), dropout when asked."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.body = nn.Linear(48, 32)
        self.head = nn.Linear(32, 4)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv2(F.relu(self.conv(x.view(-1, 1, 3, 4))))).flatten(1)
        return self.head(F.dropout(F.relu(self.body(h)), self.dropout, self.training))


class TinyQuirksWorkload(TinyWorkload):
    """`TinyWorkload` on a model as users have them: `quirk` "dropout" (masks from the global
    random generator) or "channels_last" (convolution weights laid out NHWC)."""

    name = "tiny-quirks"

    def __init__(self, quirk: str) -> None:
        super().__init__()
        self.quirk = quirk

    def _make_model(self) -> nn.Module:
        net = QuirkNet(0.3 if self.quirk == "dropout" else 0.0)
        return net.to(memory_format=torch.channels_last) if self.quirk == "channels_last" else net


class TinyBF16Workload(TinyWorkload):
    """`TinyWorkload` trained in bfloat16, as DDP runs it in its own dtype."""

    def _make_model(self) -> nn.Module:
        return TinyNet().to(torch.bfloat16)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x.to(torch.bfloat16)).float(), y)


def bf16_workload() -> TinyBF16Workload:
    return TinyBF16Workload()


class TinyStuckWorkload(TinyWorkload):
    """`TinyWorkload` whose optimizer never moves the weights: a reference that learns nothing."""

    def make_optimizer(self, params, total_steps: int):  # noqa: ANN001
        return torch.optim.SGD(params, lr=0.0), None


def stuck_workload() -> TinyStuckWorkload:
    return TinyStuckWorkload()
