"""Accelerate with nfabric, 2 CPU ranks: one import, one call after `prepare`.

    torchrun --nproc_per_node 2 examples/integrations/accelerate_train.py --out /tmp/acc --steps 6
    torchrun --nproc_per_node 2 examples/integrations/accelerate_train.py --out /tmp/acc --steps 6 --resume

A run saves `accelerator.save_state(OUT/state)` after its optimizer steps; `--resume` loads it
and trains that many more. Each rank writes OUT/rank<r>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402

import nfabric_cli  # noqa: E402
from examples.integrations.task import Net, dataset, loss_of, make_profile, residual_digest  # noqa: E402
from nfabric_cli.integrations.accelerate import attach_accelerate, optimizer_steps  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps in this run")
    ap.add_argument("--accumulate", type=int, default=2)
    ap.add_argument("--resume", action="store_true")
    a = ap.parse_args()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=a.accumulate)
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    samples = 2 * a.steps * a.accumulate * 2 * 16  # two runs of `steps` steps, 2 ranks, 16 each
    data = dataset(samples)
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=False)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    state = attach_accelerate(accelerator, model, make_profile(),
                              optimizer_steps(accelerator, loader))   # <- the one call
    loaded = None
    if a.resume:
        accelerator.load_state(str(a.out / "state"))
        loaded = residual_digest(state)
    start = state.step * a.accumulate  # skip the batches the first run consumed
    done = 0
    for i, (x, y) in enumerate(loader):
        if i < start:
            continue
        with accelerator.accumulate(model):
            loss = loss_of(model, x, y)
            state.observe(loss)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
        done += accelerator.sync_gradients
        if done == a.steps:
            break
    accelerator.save_state(str(a.out / "state"))
    accelerator.wait_for_everyone()
    doc = {"rank": accelerator.process_index, "optimizer_steps": done, "fabric_step": state.step,
           "total_steps": state.total_steps, "bytes": state.bytes_per_route(),
           "events": state.events, "loaded": loaded, "saved": residual_digest(state)}
    (a.out / f"rank{accelerator.process_index}.json").write_text(json.dumps(doc))
    state.close()
    accelerator.load_state(str(a.out / "state"))  # to evaluate it: the closed fabric takes none


if __name__ == "__main__":
    main()
    nfabric_cli.exit_rank(0)  # skip the interpreter's teardown: it can abort a gloo rank
