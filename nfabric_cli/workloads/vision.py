"""`vision`: a small residual CNN on scikit-learn's digits (or CIFAR-10/100 from `--data-dir`).

Digits: 1797 real 8x8 grey images of 10 classes, shipped inside scikit-learn (no download),
split once into 1437 train / 360 test, stratified with a fixed seed. The network is a
CIFAR-style residual CNN (stem, residual stages, global pooling, linear `head`) with GroupNorm
instead of BatchNorm, so it has no running-statistics buffers for DDP to broadcast and a
rank's batch statistics never leak into another rank's forward pass.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from nfabric_cli.workloads.common import BaseWorkload, accuracy, model_device, warmup_cosine
from nfabric_cli.workloads.images import ImageData, load_cifar, load_digits_data


class ResBlock(nn.Module):
    """Two 3x3 convs with GroupNorm and a residual; a strided 1x1 shortcut when shapes change."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(8, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(8, c_out)
        # Zero-init the last norm's scale: each block starts as the identity (Goyal et al.).
        nn.init.zeros_(self.norm2.weight)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.GroupNorm(8, c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(y)) + self.shortcut(x))


class ResNet(nn.Module):
    """Stem conv, one residual block per width (stride 2 after the first), pool, `head`."""

    def __init__(self, in_channels: int, num_classes: int, widths: tuple[int, ...]) -> None:
        super().__init__()
        self.stem = nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False)
        self.stem_norm = nn.GroupNorm(8, widths[0])
        blocks, c_in = [], widths[0]
        for i, width in enumerate(widths):
            blocks.append(ResBlock(c_in, width, stride=1 if i == 0 else 2))
            c_in = width
        self.layers = nn.Sequential(*blocks)
        self.head = nn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem_norm(self.stem(x)))
        x = self.layers(x)
        return self.head(x.mean(dim=(2, 3)))


class ImageWorkload(BaseWorkload):
    """A residual CNN classifier on `ImageData`; metric: test accuracy (higher is better).

    SGD with Nesterov momentum 0.9, weight decay 5e-4, linear warm-up then cosine decay.
    """

    metric_name = "accuracy"
    higher_is_better = True
    head_selector = "head.*"

    def __init__(self, data: ImageData, widths: tuple[int, ...], default_steps: int,
                 batch_size: int, lr: float, description: str,
                 eval_limit: int | None = None) -> None:
        self.data, self.widths = data, widths
        self.default_steps, self.batch_size, self.lr = default_steps, batch_size, lr
        self.description = description
        self.eval_limit = eval_limit  # a fixed test subset, to keep evaluation near a second

    def _train_size(self) -> int:
        return len(self.data.y_train)

    def _gather(self, indices: np.ndarray, epoch: int) -> tuple[torch.Tensor, ...]:
        index = torch.from_numpy(indices)
        return self.data.x_train[index], self.data.y_train[index]

    def _make_model(self) -> nn.Module:
        in_channels = self.data.x_train.shape[1]
        return ResNet(in_channels, self.data.num_classes, self.widths)

    def make_optimizer(self, params: Any, total_steps: int) -> tuple[torch.optim.Optimizer, Any]:
        opt = torch.optim.SGD(params, lr=self.lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
        return opt, warmup_cosine(opt, total_steps)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = batch
        device = model_device(model)
        return F.cross_entropy(model(x.to(device)), y.to(device))

    def _metric(self, model: nn.Module) -> float:
        x, y = self.data.x_test, self.data.y_test
        if self.eval_limit is not None:
            x, y = x[: self.eval_limit], y[: self.eval_limit]
        return accuracy(model, x, y)

    def data_fingerprint(self) -> str:
        return self.data.fingerprint


class VisionWorkload(ImageWorkload):
    """`vision`: digits 8x8 (10 classes), or CIFAR-10/100 binaries from `data_dir`."""

    name = "vision"

    def __init__(self, data_dir: str | None = None) -> None:
        if data_dir is None:
            super().__init__(load_digits_data(), (32, 64), default_steps=200, batch_size=32,
                             lr=0.1, description="residual CNN, scikit-learn digits 8x8")
        else:
            data = load_cifar(data_dir)
            super().__init__(data, (32, 64, 128), default_steps=2000, batch_size=64, lr=0.05,
                             description=f"residual CNN, {data.source} from {data_dir}",
                             eval_limit=1000)
