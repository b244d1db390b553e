"""The HuggingFace Trainer: `attach_trainer(trainer, profile)` before `trainer.train()`.

    from nfabric_cli.integrations.hf_trainer import attach_trainer
    trainer = Trainer(model=model, args=args, train_dataset=data)
    attach_trainer(trainer, "profiles/lm")
    trainer.train()                           # or train(resume_from_checkpoint=...)

A `TrainerCallback` alone cannot do it: callbacks see neither the DDP model
(`trainer.model_wrapped`) nor the loss. So `attach_trainer` adds `FabricCallback`, which holds
the trainer, and wraps two methods of this one trainer instance: `compute_loss` (the loss reaches
the health monitor before backward) and `train` (to learn which checkpoint a run resumes from).
The callback attaches at `on_train_begin`, when the Trainer has wrapped the model, with
`total_steps = state.max_steps` (optimizer steps: with `gradient_accumulation_steps` the Trainer
skips DDP's sync on the other micro-batches, so the hook fires once per optimizer step). At
every checkpoint (`on_save`, on every rank) each rank writes its own state as
`checkpoint-N/nfabric_state_<rank>.pt`, beside the Trainer's own `rng_state_<rank>.pth` (in the
trial's `run-<id>` folder under a hyperparameter search); a resumed run's ranks each load theirs
(on another number of ranks, a rank without one takes the shared part from another's:
`common.load_rank_state`).
`nfabric/*` values join every log line (and `state.log_history`); when `train()` returns (or
raises), after every callback's `on_train_end`, the state closes and frees its error-feedback
residuals (it still reads: bytes, events, routes).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from nfabric_cli.integrations.common import (
    AttachOptions,
    close_run,
    fabric_metrics,
    is_open,
    load_rank_state,
    require_one_sync_per_step,
    save_rank_state,
)
from nfabric_cli.runtime.state import FabricState

_HINT = ("run under torchrun --nproc_per_node N (on CPU with TrainingArguments(use_cpu=True, "
         "ddp_backend='gloo'))")


class FabricCallback(TrainerCallback):
    """Attaches, checkpoints and logs the fabric for one `Trainer`; `attach_trainer`'s `train`
    wrapper closes it (see the module)."""

    def __init__(self, trainer: Trainer, options: AttachOptions) -> None:
        self.trainer = trainer
        self.options = options
        self.fabric: FabricState | None = None
        self.resume_from: str | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        accelerator = getattr(self.trainer, "accelerator", None)
        require_one_sync_per_step(accelerator, args.gradient_accumulation_steps, "the HF Trainer")
        self.fabric = self.options.attach(
            self.trainer.model_wrapped, state.max_steps, "the HF Trainer", _HINT,
            scaler=getattr(accelerator, "scaler", None))
        if self.resume_from is not None:
            load_rank_state(self.fabric, self.resume_from, "the HF Trainer")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if is_open(self.fabric):  # every rank, into the folder the Trainer just wrote
            save_rank_state(self.fabric, Path(self._run_dir(args)) /
                            f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")

    def _run_dir(self, args: Any) -> str:
        """Where the Trainer puts this run's checkpoints: `output_dir`, or under a
        hyperparameter search the trial's own folder in it (`Trainer._get_output_dir`)."""
        trial = getattr(self.trainer, "_trial", None)
        run_dir = getattr(self.trainer, "_get_output_dir", None)
        return run_dir(trial=trial) if run_dir is not None else args.output_dir

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None,
               **kwargs: Any) -> None:
        if self.fabric is None or logs is None:
            return
        values = fabric_metrics(self.fabric)
        logs.update(values)  # callbacks after this one (reporters, the printer) see them
        if state.log_history:
            state.log_history[-1].update(values)


def attach_trainer(trainer: Trainer, profile: str | os.PathLike[str] | Any, *,
                   total_steps: int | None = None, **attach_options: Any) -> FabricCallback:
    """Make `trainer` reduce gradients through `profile` (see the module docstring).

    `total_steps`: default the Trainer's `max_steps`. `attach_options` go to `nfabric_cli.attach`
    (`substrate`, `monitor`, `gate`, `seed`). Returns the callback; its `.fabric` is the state
    once training has begun."""
    source = str(profile) if isinstance(profile, (str, Path)) else profile
    callback = FabricCallback(trainer, AttachOptions(source, total_steps, attach_options))
    trainer.add_callback(callback)
    handler = trainer.callback_handler.callbacks
    handler.insert(0, handler.pop(handler.index(callback)))  # first: its log values reach all

    compute_loss = trainer.compute_loss

    @functools.wraps(compute_loss)
    def observed(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        out = compute_loss(model, inputs, *args, **kwargs)
        if is_open(callback.fabric):  # (not evaluate() or predict() after train())
            loss = out[0] if isinstance(out, tuple) else out
            callback.fabric.observe(loss)
        return out

    train = trainer.train

    @functools.wraps(train)
    def train_resumable(resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint is True:
            # (none found: True goes on, and the Trainer raises its own "No valid checkpoint
            # found"; passing None on started the run from scratch)
            resume_from_checkpoint = get_last_checkpoint(trainer.args.output_dir) or True
        callback.resume_from = resume_from_checkpoint if isinstance(
            resume_from_checkpoint, (str, os.PathLike)) else None
        try:
            return train(resume_from_checkpoint, *args, **kwargs)
        finally:  # after every callback's on_train_end, which may still read the state
            close_run(callback.fabric)

    trainer.compute_loss = observed  # type: ignore[method-assign]
    trainer.train = train_resumable  # type: ignore[method-assign]
    return callback
