"""Lightning with nfabric, 2 CPU ranks: one import, one line (the strategy).

    python examples/integrations/lightning_train.py --out /tmp/lt --steps 6 --accumulate 2
    python examples/integrations/lightning_train.py --out /tmp/lt --steps 10 --resume /tmp/lt/ckpt/last.ckpt
    python examples/integrations/lightning_train.py --out /tmp/lt --steps 6 --then 8  # fit, fit on

Lightning starts the second process itself (it re-runs this script). Each rank writes
OUT/rank<r>.json: optimizer steps, the fabric's step and phase, bytes per route, events (with
`--then`, the first fit's as OUT/rank<r>.fit0.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from examples.integrations.task import Net, dataset, loss_of, make_profile, residual_digest  # noqa: E402
from nfabric_cli.integrations.lightning import FabricDDPStrategy  # noqa: E402


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = Net()  # parameter names gain "net." here, and "module." under DDP

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        return loss_of(self.net, x, y)

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Record(L.Callback):
    """Counts micro-batches and writes what each rank saw at the end of training."""

    def __init__(self, out: Path) -> None:
        self.out, self.batches, self.fits, self.loaded = out, 0, 0, ""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.batches += 1

    def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        self.loaded = residual_digest(trainer.strategy.fabric)  # after a checkpoint's restore

    def on_train_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        fabric = trainer.strategy.fabric
        doc = {"rank": trainer.global_rank, "global_step": trainer.global_step,
               "micro_batches": self.batches, "fabric_step": fabric.step,
               "total_steps": fabric.total_steps, "phase": fabric.phase.name,
               "bytes": fabric.bytes_per_route(), "events": fabric.events,
               "reference": fabric.meter.reference(),
               "nonfinite": fabric.controller.nonfinite,  # "pass" under a loss scaler
               "loaded": self.loaded, "saved": residual_digest(fabric)}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(doc))
        (self.out / f"rank{trainer.global_rank}.fit{self.fits}.json").write_text(json.dumps(doc))
        self.fits += 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--accumulate", type=int, default=2)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--precision", default="32-true",
                    help="Lightning's; 'fp16-scaler': fp16 autocast with a GradScaler, as "
                         "16-mixed runs on a GPU (on the CPU Lightning makes 16-mixed bf16)")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--then", type=int, default=None,
                    help="fit on to this many steps from the last checkpoint, same Trainer")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    loader = torch.utils.data.DataLoader(dataset(), batch_size=16, shuffle=False)
    precision = {"precision": args.precision}
    if args.precision == "fp16-scaler":
        from lightning.pytorch.plugins.precision import MixedPrecision

        precision = {"plugins": [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]}
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, max_steps=args.steps,
        accumulate_grad_batches=args.accumulate, **precision,
        strategy=FabricDDPStrategy(make_profile()),      # <- the one line
        logger=CSVLogger(args.out, name="logs"), log_every_n_steps=1,
        callbacks=[Record(args.out), ModelCheckpoint(dirpath=args.out / "ckpt", save_last=True)],
        enable_progress_bar=False, enable_model_summary=False,
    )
    model = Classifier()
    trainer.fit(model, loader, ckpt_path=args.resume)
    after_fit(trainer, args.out, 0)
    if args.then is not None:  # Lightning's way to train on: a longer fit from "last"
        trainer.fit_loop.epoch_loop.max_steps = args.then
        trainer.fit(model, loader, ckpt_path="last")
        after_fit(trainer, args.out, 1)


def after_fit(trainer: L.Trainer, out: Path, fit: int) -> None:
    """After `fit` the state is closed and still reads: what the run sent, per route (its
    residuals are freed with the model's memory)."""
    fabric = trainer.strategy.fabric
    (out / f"rank{trainer.global_rank}.after{fit}.json").write_text(json.dumps(
        {"closed": fabric.closed, "fabric_step": fabric.step, "bytes": fabric.bytes_per_route(),
         "residuals": len(fabric.ef.state_dict()["residual"])}))


if __name__ == "__main__":
    main()
