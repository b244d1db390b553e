"""Adapters for the stacks people train with; each imports its framework only when used.

- `nfabric_cli.integrations.lightning.FabricDDPStrategy`: PyTorch Lightning
  (``Trainer(strategy=FabricDDPStrategy("profiles/vision"))``);
- `nfabric_cli.integrations.hf_trainer.attach_trainer`: the HuggingFace Trainer
  (``attach_trainer(trainer, "profiles/lm")``);
- `nfabric_cli.integrations.accelerate.attach_accelerate`: HuggingFace Accelerate
  (``state = attach_accelerate(accelerator, model, "profiles/lm", total_steps)``).

Each one attaches after the framework has wrapped the model in DDP, counts optimizer steps
(gradient accumulation included: DDP's hook fires once per optimizer step), feeds the loss to
the health monitor, checkpoints the fabric state with the framework's checkpoints, exposes the
fabric's bytes and events to the framework's logging, and closes before the process group goes.
See docs/integrations.md.
"""
