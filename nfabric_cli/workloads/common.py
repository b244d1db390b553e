"""`BaseWorkload`: the sharding, batching, seeding and evaluation plumbing every built-in shares.

A subclass supplies its data (`_train_size`, `_gather`), its model (`_make_model`), its loss
and metric (`loss`, `_metric`) and its optimizer; this class makes them follow the
`Workload` contract: deterministic given a seed, each rank sampling only its own disjoint
shard, reshuffled per epoch, with random access by step (a resumed or re-run trial sees the
same batches without replaying the ones before).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from nfabric_cli.errors import InputError
from nfabric_cli.workloads.base import eval_mode

#: The largest seed: torch seeds its generators from a signed 64-bit integer.
MAX_SEED = 2**63 - 1


def check_seed(seed: int, what: str) -> None:
    """InputError (one line) unless `seed` is a usable seed in [0, MAX_SEED]."""
    if not 0 <= seed <= MAX_SEED:
        raise InputError(f"{what} must be in [0, 2**63 - 1], got {seed}")


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP (or any `.module`) wrapper, so evaluation runs no collective."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


def model_device(model: nn.Module) -> torch.device:
    """Where the model's parameters live, so data can follow it (CPU tensors by default)."""
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def warmup_cosine(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_frac: float = 0.05
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over `warmup_frac` of the run, then cosine decay to 0 at `total_steps`."""
    total = max(1, int(total_steps))
    warmup = max(1, int(round(warmup_frac * total)))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunk: int = 500) -> float:
    """Fraction of `x` classified as `y`, in chunks to bound memory."""
    correct, device = 0, model_device(model)
    for start in range(0, len(y), chunk):
        logits = model(x[start : start + chunk].to(device))
        correct += int((logits.argmax(dim=-1).cpu() == y[start : start + chunk]).sum())
    return correct / max(1, len(y))


class BaseWorkload:
    """Shared implementation of the `Workload` protocol (see `workloads/base.py`).

    Sharding: rank r of W owns training indices r, r+W, r+2W, ... (disjoint and covering).
    Batches: per epoch, rank r walks a permutation of its shard drawn from (seed, r, epoch);
    the last incomplete batch of an epoch is dropped, so every step has `batch_size` samples.
    """

    name: str = ""
    description: str = ""
    metric_name: str = ""
    higher_is_better: bool = True
    default_steps: int = 0
    batch_size: int = 0
    head_selector: str = "head.*"
    find_unused_parameters: bool = False  # see `Workload`

    # ---- what a subclass provides -------------------------------------------------------
    def _train_size(self) -> int:
        raise NotImplementedError

    def _gather(self, indices: np.ndarray, epoch: int) -> tuple[torch.Tensor, ...]:
        """The training samples at `indices` (epoch given for per-epoch views such as offsets)."""
        raise NotImplementedError

    def _make_model(self) -> nn.Module:
        raise NotImplementedError

    def _metric(self, model: nn.Module) -> float:
        raise NotImplementedError

    # ---- the protocol --------------------------------------------------------------------
    def build_model(self, seed: int) -> nn.Module:
        """A fresh model whose weights depend only on `seed` (global RNG state left untouched)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            model = self._make_model()
        return model

    def shard_indices(self, rank: int, world_size: int) -> np.ndarray:
        _check_rank(rank, world_size)
        return np.arange(rank, self._train_size(), world_size, dtype=np.int64)

    def steps_per_epoch(self, world_size: int) -> int:
        """Full batches in the smallest rank shard (every rank advances epochs together)."""
        smallest = self._train_size() // world_size
        steps = smallest // self.batch_size
        if steps < 1:
            raise InputError(
                f"world size {world_size} is too large for workload {self.name!r}: a rank's "
                f"shard has {smallest} samples, fewer than the batch size {self.batch_size}"
            )
        return steps

    def batch_indices(self, step: int, rank: int, world_size: int, seed: int) -> np.ndarray:
        """The training-set indices of rank `rank`'s batch at `step`."""
        if step < 0:
            raise InputError(f"step must be >= 0, got {step}")
        shard = self.shard_indices(rank, world_size)
        per_epoch = self.steps_per_epoch(world_size)
        epoch, within = divmod(int(step), per_epoch)
        rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, rank, epoch])
        order = rng.permutation(len(shard))
        start = within * self.batch_size
        return shard[order[start : start + self.batch_size]]

    def train_batch(
        self, step: int, rank: int, world_size: int, seed: int
    ) -> tuple[torch.Tensor, ...]:
        indices = self.batch_indices(step, rank, world_size, seed)
        return self._gather(indices, int(step) // self.steps_per_epoch(world_size))

    def evaluate(self, model: nn.Module) -> float:
        """The held-out metric, computed without gradients and in eval mode (modes restored)."""
        inner = unwrap(model)
        with eval_mode(inner):
            return float(self._metric(inner))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not (0 <= rank < world_size):
        raise InputError(f"rank {rank} is not in a world of size {world_size}")
