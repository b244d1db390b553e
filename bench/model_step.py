"""Step time at a real model size: plain DDP, the fabric hook on fp32 / sign / int8, and
PyTorch's allreduce, fp16 and PowerSGD hooks, side by side on the same ranks in one run.

The model is issue 16's: 5 x Linear(3072, 3072) (47.2M parameters), batch 8, 2 gloo ranks on
loopback with one intra-op thread each. Every arm is its own DDP model on the same batches.
Each round runs every arm for `--steps` steps, in an order rotated from round to round so
drift in machine load and cache state hits every arm alike; an arm's round figure is its
median step (the slower rank's), and its ratio is the median over rounds of its round figure
over plain DDP's in the same round, printed with the rounds' [min, max]. `compute` is the same
step without DDP (forward, backward, optimizer): the floor no communication scheme goes
under. `torch-hook` is PyTorch's own `allreduce_hook`: what any Python communication hook
costs over DDP's built-in C++ all-reduce, the fair floor for `fabric-fp32`: with a hook, DDP
copies each gradient into its bucket and the hook scales it by 1/W in a scan of its own,
where DDP's own path scales during that copy (reducer.cpp, `copy_grad_to_bucket`). The
`-views` arms run DDP with `gradient_as_bucket_view=True`, where there is no such copy.

Fabric arms use a profile with one route for every parameter (`profile init --route R`); no
substrate, so the capacity gate admits what the profile says. `fabric-sign-measured` has the
measured gate (`gate="measure"`: whole steps on sign or on plain DDP's path, whichever its
probe timed faster, `runtime/probe.py`). Its probe runs before the timed rounds, untimed, as
it would in a run's first steps (a close call probes ~34 steps: most of the arm's 40 timed
steps otherwise); the decision and the steps it took are printed. Goals: fabric sign <= 1.0x
plain DDP, fabric fp32 <= 1.05x, the measured arm <= 1.05x min(plain, fabric sign).

    python -m bench.model_step [--steps 8] [--rounds 5] [--width 3072] [--layers 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import warnings

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from nfabric_cli.benchmarks.runtime import MIN_STEPS, step_time
from nfabric_cli.ranks.functions import run_function_ranks
from nfabric_cli.runtime.probe import FP32, LOWBIT

ARMS = ("compute", "plain", "torch-hook", "fabric-fp32", "fabric-sign", "fabric-int8",
        "fabric-sign-measured", "fp16", "powersgd", "plain-views", "fabric-fp32-views")
# ratios taken round by round: an arm over the fastest of others in the same round
# (every arm's ratio to plain DDP is in the arms' table already)
PAIRS = (("fabric-fp32", ("torch-hook",)), ("fabric-fp32-views", ("plain-views",)),
         ("fabric-sign-measured", ("plain", "fabric-sign")))
PROBE_STEPS = 80  # untimed steps the measured arm may take to decide before the rounds


def _model(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _arms(rank: int, world: int, width: int, layers: int, total: int) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

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
    hooked = DDP(_model(width, layers))
    hooked.register_comm_hook(None, default_hooks.allreduce_hook)
    arms["torch-hook"] = (hooked, None)
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
    # gradients as views of their buckets: no copy into the bucket, so a hook's 1/W scan
    # (`ddp_mean_`) costs what plain DDP's division during that copy did
    arms["plain-views"] = (DDP(_model(width, layers), gradient_as_bucket_view=True), None)
    inner = _model(width, layers)
    ddp = DDP(inner, gradient_as_bucket_view=True)
    bindings = compile_profile(static_profile(inner, "fp32"), inner, world_size=world)
    arms["fabric-fp32-views"] = (ddp, attach(ddp, bindings, total_steps=total))
    return arms


def _probe(model: nn.Module, state, batch: tuple[torch.Tensor, torch.Tensor]) -> dict:  # noqa: ANN001
    """Run the measured arm untimed until its gate decides (looked at every 3 steps, at most
    PROBE_STEPS steps)."""
    for taken in range(3, PROBE_STEPS + 1, 3):
        step_time(model, batch, 3, state, loss="mse")
        decided = [e for e in state.events
                   if e.get("from") == "probe" and e.get("to") in (LOWBIT, FP32)]
        if decided:
            return {"steps": taken, "to": decided[-1]["to"], "reason": decided[-1]["reason"]}
    return {"steps": PROBE_STEPS, "to": None, "reason": "undecided"}


def _worker(rank: int, world: int, width: int, layers: int, steps: int, rounds: int) -> dict:
    arms = _arms(rank, world, width, layers, steps * rounds + PROBE_STEPS)
    gen = torch.Generator().manual_seed(rank)
    batch = (torch.randn(8, width, generator=gen), torch.randn(8, width, generator=gen))
    probe = _probe(*arms["fabric-sign-measured"], batch)
    names = list(arms)
    times: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            model, state = arms[name]
            times[name].append(step_time(model, batch, steps, state, loss="mse"))
    with warnings.catch_warnings():  # the step count differs from total_steps by the probe's
        warnings.filterwarnings("ignore", message="nfabric: the run closed")
        for _, state in arms.values():
            if state is not None:
                state.close()
    return {"times": times, "probe": probe}


def _same_round(rounds_s: dict[str, list[float]], num: str, dens: tuple[str, ...]) -> dict:
    """`num`'s round figure over the fastest of `dens` in the same round: the median over
    rounds and the rounds' [min, max]."""
    ratios = [t / min(rounds_s[d][i] for d in dens) for i, t in enumerate(rounds_s[num])]
    return {"median": statistics.median(ratios), "range": [min(ratios), max(ratios)]}


def run(width: int = 3072, layers: int = 5, steps: int = 8, rounds: int = 5) -> dict:
    per_rank = run_function_ranks(_worker, 2, width, layers, steps, rounds)
    # a round's figure is the slower rank's median step
    rounds_s = {name: [max(r["times"][name][i] for r in per_rank) for i in range(rounds)]
                for name in per_rank[0]["times"]}
    arms = {}
    for name, secs in rounds_s.items():
        vs = _same_round(rounds_s, name, ("plain",))
        arms[name] = {"ms": 1e3 * statistics.median(secs), "vs_plain": vs["median"],
                      "range": vs["range"]}
    paired = {f"{num} / min({', '.join(dens)})" if len(dens) > 1 else f"{num} / {dens[0]}":
              _same_round(rounds_s, num, dens) for num, dens in PAIRS}
    return {"params": layers * (width * width + width), "world_size": 2, "rounds": rounds,
            "arms": arms, "probe": per_rank[0]["probe"], "paired": paired}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--width", type=int, default=3072)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.steps < MIN_STEPS or min(args.rounds, args.width, args.layers) < 1:
        parser.error(f"--steps must be >= {MIN_STEPS} (two are warm-up), --rounds, --width, "
                     "--layers >= 1")
    res = run(args.width, args.layers, args.steps, args.rounds)
    if args.json:
        print(json.dumps(res, indent=2))
        return
    print(f"{res['params'] / 1e6:.1f}M parameters, 2 gloo ranks, median step over "
          f"{res['rounds']} rounds, ratio to plain DDP in the same round: median [min, max]")
    for name, v in res["arms"].items():
        lo, hi = v["range"]
        print(f"  {name:22s} {v['ms']:7.1f} ms  {v['vs_plain']:.3f}x [{lo:.3f}, {hi:.3f}]")
    print("same round:")
    for label, v in res["paired"].items():
        print(f"  {label}: {v['median']:.3f} [{v['range'][0]:.3f}, {v['range'][1]:.3f}]")
    p = res["probe"]
    print(f"the measured arm's probe, untimed: {p['to']} after {p['steps']} steps, {p['reason']}")


if __name__ == "__main__":
    main()
