"""The HF Trainer with nfabric, 2 CPU ranks: one import, one line (`attach_trainer`).

    torchrun --nproc_per_node 2 examples/integrations/hf_trainer_train.py --out /tmp/hf --steps 6
    torchrun --nproc_per_node 2 examples/integrations/hf_trainer_train.py --out /tmp/hf --steps 10 --resume
    torchrun --nproc_per_node 2 examples/integrations/hf_trainer_train.py --out /tmp/hf2 --twice

Each rank writes OUT/rank<r>.json: optimizer steps, the fabric's step, bytes per route, events.
`--twice` calls `trainer.train()` a second time on the same Trainer (a run of its own, on the
DDP wrapper the Trainer kept; the report is the second run's, with the first run's state's
step beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere

import torch  # noqa: E402
from torch import nn  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import nfabric_cli  # noqa: E402
from examples.integrations.task import (  # noqa: E402
    Net,
    dataset,
    loss_of,
    make_profile,
    residual_digest,
)
from nfabric_cli.integrations.hf_trainer import attach_trainer  # noqa: E402


class Model(nn.Module):
    """The Trainer's contract: forward(**batch) returns a dict with the loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = Net()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": loss_of(self.net, x, labels), "logits": self.net(x)}


class Rows(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.data = dataset()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, y = self.data[i]
        return {"x": x, "labels": y}


class Digests(TrainerCallback):
    """Reads the residuals after nfabric's callback (first in line) acted: when training
    begins (attached, a checkpoint loaded) and at a checkpoint (saved). After training they
    are gone: the state closed and freed them."""

    def __init__(self, nfabric) -> None:  # noqa: ANN001 - the FabricCallback
        self.nfabric, self.loaded, self.saved = nfabric, None, None

    def on_train_begin(self, args, state, control, **kwargs) -> None:  # noqa: ANN001
        self.loaded = residual_digest(self.nfabric.fabric)

    def on_save(self, args, state, control, **kwargs) -> None:  # noqa: ANN001
        self.saved = residual_digest(self.nfabric.fabric)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--accumulate", type=int, default=2)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--twice", action="store_true")
    a = ap.parse_args()
    args = TrainingArguments(
        output_dir=str(a.out), use_cpu=True, max_steps=a.steps,
        ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,  # torchrun sets it
        per_device_train_batch_size=16, gradient_accumulation_steps=a.accumulate,
        learning_rate=0.1, logging_steps=1, save_steps=a.steps, report_to="none",
        dataloader_num_workers=0, ddp_find_unused_parameters=False, disable_tqdm=True,
    )
    trainer = Trainer(model=Model(), args=args, train_dataset=Rows())
    nfabric = attach_trainer(trainer, make_profile())      # <- the one line
    digests = Digests(nfabric)
    trainer.add_callback(digests)
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    first = nfabric.fabric
    if a.twice:
        trainer.train()
    fabric, rank = nfabric.fabric, int(os.environ.get("RANK", 0))
    doc = {"rank": rank, "global_step": trainer.state.global_step, "fabric_step": fabric.step,
           "total_steps": fabric.total_steps, "bytes": fabric.bytes_per_route(),
           "events": fabric.events, "logged": [k for k in trainer.state.log_history[-2]
                                               if k.startswith("nfabric/")],
           "loaded": digests.loaded, "saved": digests.saved, "closed": fabric.closed,
           "residuals": len(fabric.ef.state_dict()["residual"]),
           "first_fabric_step": first.step, "new_state": fabric is not first}
    (a.out / f"rank{rank}.json").write_text(json.dumps(doc))


if __name__ == "__main__":
    main()
    nfabric_cli.exit_rank(0)  # skip the interpreter's teardown: it can abort a gloo rank
