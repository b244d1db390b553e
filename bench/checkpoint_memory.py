"""Host memory of a checkpoint's fabric state on each rank, per way of saving it.

Every parameter of a `--layers` x Linear(`--width`, `--width`) model on `sign` with error
feedback, one step taken, so each rank holds one residual per parameter (float32, the model's
size). Then `FabricState.state_dict` as each adapter calls it, in fresh gloo ranks per way:
- `all`: every rank's part gathered onto every rank (the default; every adapter until session 52);
- `dst0`: onto rank 0 only (the Lightning adapter: rank 0 writes the `.ckpt`);
- `own`: each rank its own part (the HF Trainer and Accelerate adapters: a file per rank).
Per rank: how far the call raised the process's peak resident memory (ru_maxrss; 0 where it
stayed under the peak the step had already reached), and the residual bytes the returned state
holds, against the rank's own residuals (1.0x).

    python -m bench.checkpoint_memory [--world-sizes 2,4] [--width 2048] [--layers 4]
"""

from __future__ import annotations

import argparse
import gc
import resource

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from nfabric_cli import attach
from nfabric_cli.binding import static_profile
from nfabric_cli.ranks.functions import run_function_ranks

WAYS = ("all", "dst0", "own")


def _rank(rank: int, world_size: int, way: str, width: int, layers: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    ddp = DDP(model)
    state = attach(ddp, static_profile(model, "sign", error_feedback=True), total_steps=10)
    ddp(torch.randn(4, width)).sum().backward()  # one step: a residual for every parameter
    own = sum(r.numel() * 4 for r in state.ef.state_dict()["residual"].values())
    gc.collect()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    sd = state.state_dict(all_ranks=way != "own", dst=0 if way == "dst0" else None)
    rise = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    held = sum(r.numel() * 4 for part in sd["ranks"].values()
               for r in part["ef"]["residual"].values())
    state.close()
    return {"rise_mb": rise / 1024, "held": held / own, "own_mb": own / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    for w in (int(v) for v in args.world_sizes.split(",")):
        for way in WAYS:
            ranks = run_function_ranks(_rank, w, way, args.width, args.layers)
            print(f"W={w} {way:4s}: residuals {ranks[0]['own_mb']:.0f} MB a rank; peak rise "
                  + ", ".join(f"{r['rise_mb']:.0f}" for r in ranks) + " MB; held "
                  + ", ".join(f"{r['held']:.1f}x" for r in ranks) + " (ranks 0..W-1)",
                  flush=True)


if __name__ == "__main__":
    main()
