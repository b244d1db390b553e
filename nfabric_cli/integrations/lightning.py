"""PyTorch Lightning: `FabricDDPStrategy`, Lightning's DDP strategy with the nfabric hook.

    from nfabric_cli.integrations.lightning import FabricDDPStrategy
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FabricDDPStrategy("profiles/vision"))

Why a strategy and not `DDPStrategy(ddp_comm_hook=...)`: Lightning registers comm hooks only on
CUDA devices (`DDPStrategy._register_ddp_hooks`), and a hook state cannot exist before Lightning
creates the process group. This strategy attaches right after Lightning wraps the model
(`configure_ddp`), with `total_steps` from `trainer.estimated_stepping_batches` (optimizer
steps: with `accumulate_grad_batches` Lightning skips DDP's sync on the other micro-batches, so
the hook fires once per optimizer step). A profile made from the bare network fits the
LightningModule (its `net.` prefix is stripped, `binding/matching.py`), `bf16-true` included.
The loss reaches the health monitor in `backward`; the fabric state rides in every checkpoint
(`checkpoint["nfabric"]`, every rank's part gathered onto rank 0, which alone writes the file)
and is restored by `fit(ckpt_path=...)`; `nfabric/*` metrics go to the Trainer's loggers; the
state closes in `teardown`, before the process group goes, and stays readable as
`strategy.fabric` after `fit` (in each rank's own process: not in a `ddp_spawn` parent).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import DDPStrategy

from nfabric_cli.integrations.common import (
    CHECKPOINT_KEY,
    AttachOptions,
    close_run,
    fabric_metrics,
    is_open,
    resume_state,
)
from nfabric_cli.runtime.state import FabricState


class FabricDDPStrategy(DDPStrategy):
    """`DDPStrategy` whose DDP model reduces gradients through an nfabric profile.

    `profile`: a profile file or folder, a bindings file, an `OperatingProfile` or `Bindings`.
    `total_steps`: default `trainer.estimated_stepping_batches`. `attach_options` go to
    `nfabric_cli.attach` (`substrate`, `monitor`, `gate`, `seed`); the other keyword arguments
    to `DDPStrategy` (`start_method`, `find_unused_parameters`, ...). The state is `.fabric`.
    """

    strategy_name = "nfabric_ddp"

    def __init__(self, profile: str | os.PathLike[str] | Any, *, total_steps: int | None = None,
                 log_metrics: bool = True, attach_options: dict[str, Any] | None = None,
                 **ddp_kwargs: Any) -> None:
        super().__init__(**ddp_kwargs)
        source = str(profile) if isinstance(profile, (str, Path)) else profile
        self._nfabric = AttachOptions(source, total_steps, dict(attach_options or {}))
        self._log_metrics = log_metrics
        self._resume: dict[str, Any] | None = None
        self.fabric: FabricState | None = None

    def configure_ddp(self) -> None:
        super().configure_ddp()  # wraps the LightningModule in DDP (no hook on CPU)
        trainer = self.lightning_module.trainer
        self.fabric = self._nfabric.attach(self.model, trainer.estimated_stepping_batches,
                                           "Lightning",
                                           scaler=getattr(self.precision_plugin, "scaler", None))
        if self._resume is not None:
            resume_state(self.fabric, self._resume)
            self._resume = None

    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if self._live():
            self.fabric.observe(closure_loss)  # before backward: the step's buckets judge it
        out = super().backward(closure_loss, optimizer, *args, **kwargs)
        if self._live() and self._log_metrics:
            for key, value in fabric_metrics(self.fabric).items():
                self.lightning_module.log(key, value, on_step=True, on_epoch=False,
                                          logger=True, prog_bar=False, rank_zero_only=True)
        return out

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any = None) -> None:
        # Called on every rank (Trainer.save_checkpoint), so the gather in state_dict() is safe;
        # only rank 0 writes, so only its copy holds every rank's residuals (the others'
        # hold their own: W copies of them on every rank would not fit a large model).
        if self._live():
            checkpoint[CHECKPOINT_KEY] = self.fabric.state_dict(dst=0)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        # Called on every rank before the model is wrapped: keep the state for configure_ddp.
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        state = checkpoint.get(CHECKPOINT_KEY)
        if state is not None:
            # every rank read every rank's residuals: keep this rank's (the others go now;
            # all of them where the run resumes on another number of ranks: `resume_state`)
            mine = state.get("ranks", {}).get(self.global_rank)
            if state.get("world_size") != self.world_size:
                state["ranks"] = {}
            elif mine is not None:
                state["ranks"] = {self.global_rank: mine}
            if self._live():
                resume_state(self.fabric, state)
            else:
                self._resume = state
        return checkpoint

    def teardown(self) -> None:
        # Close this run's state. It stays readable as `.fabric` after `fit` (bytes, events,
        # routes; not its residuals) until a later fit of the same Trainer attaches its own;
        # a checkpoint loaded meanwhile is kept for that one (`_live`), and a state kept by
        # `validate(ckpt_path=...)` must not reach it.
        close_run(self.fabric)  # no checkpoint of a closed state carries residuals (`_live`)
        self._resume = None
        super().teardown()

    def _live(self) -> bool:
        """Whether this fit's state is attached and open (not the last fit's, closed)."""
        return is_open(self.fabric)
