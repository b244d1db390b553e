"""The workload interface: what every built-in or plugin workload provides.

A workload is a model factory, per-rank training batches, a loss and an evaluation. Every
stage uses the same object: calibration (N simulated workers in one process), validation
(one process per rank under DDP) and the CLI.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class Workload(Protocol):
    """Protocol for workloads; built-ins subclass `BaseWorkload` (`workloads/common.py`).

    Contract for a plug-in workload (`MODULE:FN` returning one; see docs/workloads.md):

    - **Implement** the attributes and methods below. `BaseWorkload` supplies
      `shard_indices`, `data_fingerprint` and the batch plumbing from a tensor dataset.
    - **Determinism.** The same seed gives the same initial weights (`build_model`), and
      `train_batch(step, rank, W, seed)` gives the same batch every time it is called, in any
      order (random access). The simulator calls it for all W ranks in one process, the real
      ranks each for their own, and both must train on the same data.
    - **Sharding.** Rank r of W sees only its own shard of the training set (disjoint,
      covering).
    - **Offline and cheap.** Building the data must not download anything. Build it once per
      object (cache it) and keep `evaluate` side-effect free. It is called on the trained
      model in eval mode, at every calibration checkpoint.
    - **Thread safety.** One object serves one process's runs, one call at a time; forked
      simulator children get their own copy.
    - **Raises.** Bad construction arguments (a missing data directory, say) raise
      `InputError` with one line: the CLI prints it and exits 2.
    """

    name: str
    metric_name: str  # e.g. "accuracy" or "val_loss"
    higher_is_better: bool
    default_steps: int  # steps at which FP32 training reaches a meaningful metric
    batch_size: int  # per rank
    head_selector: str  # region selector of the sensitive head, e.g. "head.*"

    # Optional (read with `find_unused`): True for a model that leaves parameters out of some
    # steps' graphs (a branch, a mixture of experts); DDP is then built with
    # find_unused_parameters=True, and every stage plans and simulates its buckets so.
    # find_unused_parameters: bool

    def build_model(self, seed: int) -> nn.Module: ...

    def make_optimizer(
        self, params: Any, total_steps: int
    ) -> tuple[torch.optim.Optimizer, Any]:
        """Return (optimizer, lr_scheduler or None); the scheduler is stepped once per step."""
        ...

    def train_batch(
        self, step: int, rank: int, world_size: int, seed: int
    ) -> tuple[torch.Tensor, ...]:
        """The batch rank `rank` trains on at `step` (random access, deterministic)."""
        ...

    def shard_indices(self, rank: int, world_size: int) -> Any:
        """Training-set indices owned by `rank` (for tests of disjointness)."""
        ...

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor: ...

    def evaluate(self, model: nn.Module) -> float:
        """The held-out metric (accuracy, validation loss, ...)."""
        ...

    def data_fingerprint(self) -> str:
        """Hash of the data, recorded in profile provenance."""
        ...


def find_unused(workload: Any) -> bool:
    """Whether `workload` trains under DDP(find_unused_parameters=True) (its optional
    `find_unused_parameters` attribute; default False, DDP's default)."""
    return bool(getattr(workload, "find_unused_parameters", False))


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """`model` in eval mode without gradients; each submodule's own mode is restored after
    (a layer the workload keeps in eval, a frozen BatchNorm, stays so)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, training in modes:
            m.training = training


def held_out_metric(workload: Any, model: nn.Module) -> float:
    """`workload.evaluate(model)` as the protocol promises it: in eval mode (`eval_mode`),
    without gradients, and with the global CPU random state left as it was. A plugin's
    `evaluate` that does none of this itself (the breast-cancer example) ran with dropout on:
    a metric of random masks, which neither `validate` nor the simulator could reproduce."""
    with eval_mode(model), torch.random.fork_rng(devices=[]):
        return float(workload.evaluate(model))
