"""Step time at a real model size: plain DDP, the fabric hook on fp32 / sign / int8, and
PyTorch's fp16 and PowerSGD hooks, interleaved on the same ranks in one run.

The model is issue 16's: 5 x Linear(3072, 3072) (47.2M parameters), batch 8, 2 gloo ranks on
loopback with one intra-op thread each. Every arm is its own DDP model on the same batches;
rounds alternate the arms so drift in machine load hits them alike, and each arm's figure is
the median over rounds of its median step. `compute` is the same step without DDP (forward,
backward, optimizer): the floor no communication scheme goes under. Fabric arms use a profile
with one route for every parameter (`profile init --route R`); no substrate, so the capacity
gate admits what the profile says; `fabric-sign-measured` has the measured gate
(`gate="measure"`: per bucket, sign or fp32, whichever its first steps timed faster; its
probing steps are in its first round). Goals: fabric sign <= 1.0x plain DDP, fabric fp32 <=
1.05x, the measured arm <= 1.05x min(plain, fabric sign).

    python -m bench.model_step [--steps 8] [--rounds 3] [--width 3072] [--layers 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from nfabric_cli.benchmarks.runtime import step_time
from nfabric_cli.ranks.functions import run_function_ranks

ARMS = ("compute", "plain", "fabric-fp32", "fabric-sign", "fabric-int8", "fabric-sign-measured",
        "fp16", "powersgd")


def _model(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _arms(rank: int, world: int, width: int, layers: int, total: int) -> dict:
    from nfabric_cli import attach
    from nfabric_cli.binding import compile_profile, static_profile
    from nfabric_cli.validation.baselines import (
        HookByteMeter,
        fp16_state,
        metered_hook,
        powersgd_state,
    )

    meter = HookByteMeter(world, rank)
    # PowerSGD in one bucket: its hook issues its P and Q all-reduces from the previous
    # collective's completion callback, and with several buckets on gloo those callbacks
    # issued them in different orders on the two ranks here (gloo: "received 4096 vs 1024
    # bytes", after the fabric-fp32 arm had run), so the arm gets a single bucket.
    arms: dict = {}
    psgd = DDP(_model(width, layers), bucket_cap_mb=1 << 16)
    psgd.register_comm_hook(powersgd_state(None, meter, 1, 2, 0), metered_hook)
    arms["powersgd"] = (psgd, None)
    arms["compute"] = (_model(width, layers), None)
    arms["plain"] = (DDP(_model(width, layers)), None)
    for route in ("fp32", "sign", "int8"):
        inner = _model(width, layers)
        ddp = DDP(inner)
        bindings = compile_profile(static_profile(inner, route), inner, world_size=world)
        arms[f"fabric-{route}"] = (ddp, attach(ddp, bindings, total_steps=total))
    # sign with the measured gate: each bucket keeps whichever of sign and fp32 it timed faster
    inner = _model(width, layers)
    ddp = DDP(inner)
    bindings = compile_profile(static_profile(inner, "sign"), inner, world_size=world)
    arms["fabric-sign-measured"] = (ddp, attach(ddp, bindings, total_steps=total, gate="measure"))
    fp16 = DDP(_model(width, layers))
    fp16.register_comm_hook(fp16_state(None, meter), metered_hook)
    arms["fp16"] = (fp16, None)
    return arms


def _worker(rank: int, world: int, width: int, layers: int, steps: int, rounds: int) -> dict:
    arms = _arms(rank, world, width, layers, steps * rounds)
    gen = torch.Generator().manual_seed(rank)
    batch = (torch.randn(8, width, generator=gen), torch.randn(8, width, generator=gen))
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, (model, state) in arms.items():
            times[name].append(step_time(model, batch, steps, state, loss="mse"))
    for _, state in arms.values():
        if state is not None:
            state.close()
    return {name: statistics.median(ts) for name, ts in times.items()}


def run(width: int = 3072, layers: int = 5, steps: int = 8, rounds: int = 3) -> dict:
    per_rank = run_function_ranks(_worker, 2, width, layers, steps, rounds)
    seconds = {name: max(r[name] for r in per_rank) for name in per_rank[0]}
    plain = seconds["plain"]
    return {"params": layers * (width * width + width), "world_size": 2,
            "arms": {name: {"ms": 1e3 * s, "vs_plain": s / plain} for name, s in seconds.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=3072)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    res = run(args.width, args.layers, args.steps, args.rounds)
    if args.json:
        print(json.dumps(res, indent=2))
        return
    print(f"{res['params'] / 1e6:.1f}M parameters, 2 gloo ranks, median step:")
    for name, v in res["arms"].items():
        print(f"  {name:12s} {v['ms']:7.1f} ms  {v['vs_plain']:.2f}x plain DDP")


if __name__ == "__main__":
    main()
