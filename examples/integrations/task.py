"""The small task the integration examples train: a classifier on a fixed synthetic set.

Offline and deterministic (512 points in 16 dimensions, 4 classes from a fixed linear map), so
the examples run anywhere in seconds. `make_profile()` is what `nfabric profile init --model
examples.integrations.task:Net --route sign --set 'head.*=fp32'` writes: head on full
precision, the rest 1-bit sign with error feedback, made from the bare network (the frameworks'
wrappers add prefixes such as `net.` or `module.`; nfabric strips them).
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
from torch import nn

from nfabric_cli.binding import static_profile
from nfabric_cli.profile.operating import OperatingProfile


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def dataset(n: int = 512) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(n, 16, generator=gen)
    y = (x @ torch.randn(16, 4, generator=gen)).argmax(1)
    return torch.utils.data.TensorDataset(x, y)


def loss_of(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(net(x).float(), y)


def make_profile() -> OperatingProfile:
    torch.manual_seed(0)
    return static_profile(Net(), "sign", [("head.*", "fp32")], error_feedback=True)


def residual_digest(fabric) -> str:  # noqa: ANN001 - a FabricState
    """A hash of this rank's error-feedback residuals (names and bits): a resumed run's,
    read right after it loaded the checkpoint, must equal the run's that saved it."""
    h = hashlib.sha256()
    for name, r in sorted(fabric.ef.state_dict()["residual"].items()):
        h.update(name.encode())
        h.update(r.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
