"""What the framework adapters share: the attach options, the one-line errors, the metrics."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from nfabric_cli.errors import InputError
from nfabric_cli.runtime.controller import fallbacks as count_fallbacks
from nfabric_cli.runtime.state import FabricState

#: Where a checkpoint keeps the fabric state (a key in a checkpoint dict, a file in a folder).
CHECKPOINT_KEY = "nfabric"
STATE_FILE = "nfabric_state.pt"


@dataclass
class AttachOptions:
    """`attach`'s options as an adapter forwards them (see `nfabric_cli.attach`)."""

    source: Any  # profile file or folder, bindings file, OperatingProfile or Bindings
    total_steps: int | None = None  # default: the framework's count of optimizer steps
    extra: dict[str, Any] = field(default_factory=dict)  # substrate, monitor, gate, seed

    def attach(self, ddp: Any, total_steps: int | None, framework: str,
               hint: str = "", scaler: Any = None) -> FabricState:
        """`attach` as the framework set the run up; `scaler`: its loss scaler, if any."""
        from nfabric_cli import attach

        require_ddp(ddp, framework, hint)
        steps = self.total_steps or total_steps
        if not steps or steps < 1 or steps == float("inf"):
            raise InputError(f"nfabric: {framework} does not know how many optimizer steps the "
                             f"run takes (got {steps!r}): pass total_steps=")
        return attach(ddp, self.source, int(steps), **self.options(scaler))

    def options(self, scaler: Any = None) -> dict[str, Any]:
        """The keyword arguments for `attach`: the user's, and where the framework scales the
        loss (fp16 mixed precision: a `GradScaler`) and the user did not say otherwise,
        ``nonfinite="pass"``, so that the scaler sees an overflowing step and lowers its
        scale (a zeroed one looks finite to it)."""
        if scaler is None or "nonfinite" in self.extra:
            return dict(self.extra)
        return {**self.extra, "nonfinite": "pass"}


def require_ddp(model: Any, framework: str, hint: str = "") -> None:
    """One line when there is no multi-rank DDP model to attach to (training would silently
    run uncompressed)."""
    if not isinstance(model, DistributedDataParallel):
        world = os.environ.get("WORLD_SIZE", "1")
        raise InputError(
            f"nfabric: {framework} did not wrap the model in DistributedDataParallel (got "
            f"{type(model).__name__}, WORLD_SIZE={world}): start 2 or more processes"
            + (f"; {hint}" if hint else ""))
    if dist.get_world_size(model.process_group) < 2:
        raise InputError(f"nfabric: {framework} started a single process: nothing crosses the "
                         "network, so nothing would be compressed; start 2 or more")


def require_one_sync_per_step(accelerator: Any, accumulation: int, framework: str) -> None:
    """One line for Accelerate's `sync_each_batch` with gradient accumulation (the HF
    Trainer's too, through its accelerator): DDP then reduces on every micro-batch, so the
    hook would count micro-batches as steps (the phases squeezed into the run's first part)
    and compress again the part of `.grad` already reduced."""
    state = getattr(accelerator, "gradient_state", None)
    kwargs = getattr(state, "plugin_kwargs", None) or {}
    if accumulation > 1 and kwargs.get("sync_each_batch", False):
        raise InputError(
            f"nfabric: {framework} accumulates {accumulation} micro-batches with "
            "sync_each_batch=True, so DDP reduces on every one of them: nfabric counts and "
            "compresses one reduction per optimizer step; drop sync_each_batch")


def fabric_metrics(state: FabricState) -> dict[str, float]:
    """Scalars for a framework's logger: bytes so far, traffic vs full precision, fallbacks."""
    summary = state.meter.summary()
    fallbacks = count_fallbacks(state.events)
    return {"nfabric/traffic_fraction": float(summary["traffic_fraction"]),
            "nfabric/bytes": float(summary["bytes"]),
            "nfabric/fallbacks": float(fallbacks),
            "nfabric/skipped_steps": float(len(state.skipped_steps))}
