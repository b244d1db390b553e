"""Sensitivity of each built-in workload to 1-bit `sign` aggregation, at world size 4.

Three arms per workload, run side by side from the same seed and the same batches:
- `fp32`: every gradient averaged exactly (the reference);
- `sign`: every parameter on the sign route (majority vote of per-rank signs, decoded as the
  ranks' mean |g| per chunk times the vote);
- `head-fp32`: the workload's head (`head_selector`) on fp32, everything else on sign.

W workers are simulated in one process: each step computes the W per-rank gradients on their
own batches, aggregates them per route with the real route code (`Route.simulate`, the same
codec as the DDP hook), and steps one optimizer. The printed traffic is the routes' exact
wire bytes per rank per step as a fraction of fp32. The paper's finding to check: all-sign can
collapse the metric, and keeping the head on fp32 recovers most of it.

    OMP_NUM_THREADS=1 python -m bench.workload_sensitivity [--workloads vision,lm] [--seeds 0,1]
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import time
from dataclasses import asdict, dataclass

import torch

from nfabric_cli.routes import RouteSpec, make_route
from nfabric_cli.workloads.base import Workload, held_out_metric
from nfabric_cli.workloads.registry import BUILTINS, get_workload

ARMS = ("fp32", "sign", "head-fp32")


@dataclass
class ArmResult:
    workload: str
    arm: str
    seed: int
    metric: float
    traffic_fraction: float
    seconds: float


def route_of(arm: str, name: str, head_selector: str) -> str:
    """The route a parameter takes in an arm."""
    if arm == "fp32" or (arm == "head-fp32" and fnmatch.fnmatchcase(name, head_selector)):
        return "fp32"
    return "sign"


def train_arm(workload: Workload, arm: str, world_size: int, steps: int, seed: int) -> ArmResult:
    """Train `steps` simulated data-parallel steps with the arm's routes; return the metric."""
    start = time.perf_counter()
    model = workload.build_model(seed)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups: dict[str, list[int]] = {}
    for i, (name, _) in enumerate(named):
        groups.setdefault(route_of(arm, name, workload.head_selector), []).append(i)
    segments = {r: tuple(named[i][1].numel() for i in idx) for r, idx in groups.items()}
    routes = {r: make_route(RouteSpec(r)) for r in groups}
    fp32 = make_route(RouteSpec("fp32"))
    total = sum(p.numel() for _, p in named)
    sent = sum(
        routes[r].wire_bytes(sum(s), world_size, segments=s).total for r, s in segments.items()
    )
    traffic = sent / fp32.wire_bytes(total, world_size).total

    opt, scheduler = workload.make_optimizer([p for _, p in named], steps)
    for step in range(steps):
        per_rank = []  # per rank: {route: flat gradient of that route's parameters}
        for rank in range(world_size):
            model.zero_grad(set_to_none=True)
            workload.loss(model, workload.train_batch(step, rank, world_size, seed)).backward()
            per_rank.append(
                {
                    r: torch.cat([_grad(named[i][1]).reshape(-1) for i in idx])
                    for r, idx in groups.items()
                }
            )
        for r, idx in groups.items():
            agg = routes[r].simulate([g[r] for g in per_rank], segments[r])
            for i, chunk in zip(idx, agg.split(segments[r]), strict=True):
                named[i][1].grad = chunk.view_as(named[i][1]).clone()
        opt.step()
        if scheduler is not None:
            scheduler.step()
    metric = held_out_metric(workload, model)
    return ArmResult(workload.name, arm, seed, metric, traffic, time.perf_counter() - start)


def _grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def main(argv: list[str] | None = None) -> list[ArmResult]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(BUILTINS))
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=None, help="default: each workload's own")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results: list[ArmResult] = []
    for name in args.workloads.split(","):
        workload = get_workload(name)
        steps = args.steps or workload.default_steps
        for seed in (int(s) for s in args.seeds.split(",")):
            for arm in ARMS:
                res = train_arm(workload, arm, args.world_size, steps, seed)
                results.append(res)
                if not args.json:
                    print(
                        f"{name:12s} seed {seed} {arm:10s} {workload.metric_name} "
                        f"{res.metric:.4f}  traffic {res.traffic_fraction:7.2%}  "
                        f"({steps} steps, W={args.world_size}, {res.seconds:.0f} s)",
                        flush=True,
                    )
        if not args.json:
            _print_ratio(workload, [r for r in results if r.workload == name])
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    return results


def _print_ratio(workload: Workload, rows: list[ArmResult]) -> None:
    """Mean over seeds per arm, and the share of the sign arm's loss that the fp32 head recovers."""
    mean = {}
    for arm in ARMS:
        values = [r.metric for r in rows if r.arm == arm]
        mean[arm] = sum(values) / len(values)
    sign = 1.0 if workload.higher_is_better else -1.0
    lost = sign * (mean["fp32"] - mean["sign"])  # > 0: all-sign is worse than fp32
    text = (
        f"vs fp32: sign {-lost:+.4f}, head-fp32 {sign * (mean['head-fp32'] - mean['fp32']):+.4f} "
        "(+ is better)"
    )
    if lost > 0.02 * abs(mean["fp32"]):  # a ratio of differences inside the noise means nothing
        recovered = sign * (mean["head-fp32"] - mean["sign"]) / lost
        text += f"; the fp32 head recovers {recovered:.0%} of the loss"
    print(
        f"{workload.name:12s} mean: fp32 {mean['fp32']:.4f}  sign {mean['sign']:.4f}  "
        f"head-fp32 {mean['head-fp32']:.4f}  | {text}\n",
        flush=True,
    )


if __name__ == "__main__":
    main()
