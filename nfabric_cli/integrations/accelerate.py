"""HuggingFace Accelerate: `attach_accelerate(accelerator, model, profile, total_steps)`.

    model, opt, loader = accelerator.prepare(model, opt, loader)
    state = attach_accelerate(accelerator, model, "profiles/lm",
                              optimizer_steps(accelerator, loader, epochs))
    for batch in loader:
        with accelerator.accumulate(model):
            loss = ...
            state.observe(loss)               # the health monitor sees the loss
            accelerator.backward(loss); opt.step(); opt.zero_grad()
    accelerator.save_state(path)              # the fabric state is saved with everything else

The prepared model is a DistributedDataParallel when 2 or more processes run (on CPU:
`torchrun --nproc_per_node N` with `Accelerator(cpu=True)`; `accelerate launch --cpu` starts one
process). `save_state` (which every process calls) has each rank write its own state as
`nfabric_state_<rank>.pt`, beside Accelerate's own `random_states_<rank>.pkl`, and `load_state`
has each rank read its own (save and load pre-hooks: `register_for_checkpointing` would save the
main process's object only, so every rank's residuals would have to be gathered onto it).
Attach before `load_state` (its pre-hook reads the fabric's files; attached after it, the
state starts afresh, with a warning where `accelerator.step` shows it).
`accelerator.accumulate` skips DDP's sync on the other micro-batches, so the hook fires once
per optimizer step: `optimizer_steps` counts those, not batches.
"""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist

from nfabric_cli.errors import InputError
from nfabric_cli.integrations.common import (
    AttachOptions,
    load_rank_state,
    require_one_sync_per_step,
    save_rank_state,
)
from nfabric_cli.runtime.state import FabricState


def optimizer_steps(accelerator: Any, dataloader: Any, epochs: int = 1) -> int:
    """Optimizer steps of `epochs` passes over a prepared `dataloader`: `accumulate` steps
    every `gradient_accumulation_steps` batches and at the end of each pass."""
    if epochs < 1:
        raise InputError(f"nfabric: epochs must be >= 1, got {epochs}")
    return math.ceil(len(dataloader) / accelerator.gradient_accumulation_steps) * epochs


def attach_accelerate(accelerator: Any, model: Any, profile: str | os.PathLike[str] | Any,
                      total_steps: int, **attach_options: Any) -> FabricState:
    """Attach to the model `accelerator.prepare` returned and register the state for
    checkpointing (see the module docstring). `attach_options` go to `nfabric_cli.attach`."""
    if accelerator.num_processes < 2:
        if dist.is_initialized() and dist.get_world_size() > 1:
            raise InputError(
                f"nfabric: {dist.get_world_size()} processes run but Accelerate sees one "
                "(no GPU and not told to use the CPU): create Accelerator(cpu=True) or set "
                "ACCELERATE_USE_CPU=1")
        raise InputError(
            "nfabric: Accelerate started a single process, so nothing would be compressed; on "
            "CPU `accelerate launch --cpu` starts one: use torchrun --nproc_per_node N with "
            "Accelerator(cpu=True)")
    require_one_sync_per_step(accelerator, accelerator.gradient_accumulation_steps, "Accelerate")
    attached = accelerator.__dict__.setdefault("_nfabric_states", [])
    # attached again to a model whose state closed: that model's files, its hooks, are its
    again = next((entry for entry in attached if entry[0] is model and entry[1].closed), None)
    if getattr(accelerator, "step", 0) and again is None:  # `load_state` restores it, when
        # the run was inside `accumulate` (at an epoch's end it is 0 again): hooks come late
        warnings.warn(
            f"nfabric: accelerator.step is {accelerator.step} at attach: load_state (or "
            "training) ran before it, so no fabric state was restored and the fabric counts "
            "its steps from 0; attach before accelerator.load_state to resume it", stacklevel=2)
    source = str(profile) if isinstance(profile, (str, Path)) else profile
    state = AttachOptions(source, total_steps, attach_options).attach(
        model, None, "Accelerate", "pass the model that accelerator.prepare returned",
        scaler=getattr(accelerator, "scaler", None))
    if again is not None:  # its hooks read the entry: they now save and load the new state
        again[1] = state
        return state
    # each attached model has its own files, in the order they were attached (attach them in
    # the same order when resuming)
    index = len(attached)
    entry = [model, state]
    attached.append(entry)
    accelerator.register_save_state_pre_hook(
        lambda models, weights, output_dir: save_rank_state(entry[1], output_dir, index))
    accelerator.register_load_state_pre_hook(
        lambda models, input_dir: load_rank_state(entry[1], input_dir, "Accelerate", index))
    return state
