"""A workload's run-to-run noise: how far fp32 lands from itself after an invisible change.

Training is chaotic: two runs that differ in one bit drift apart, and their final metrics
differ by an amount that depends on the workload, its length and the seed, not on any
compression. A per-seed tolerance below that amount cannot tell a good profile from a bad
one (fp32 itself would fail it), so measure it before trusting per-seed verdicts.

Per seed, two simulated fp32 runs (`calibration/simulate.py`, bit-identical to real DDP) on the
same batches from the same weights, differing only by a perturbation no one would call a
change:

- `order` (default at three ranks or more): the same DDP run with another bucket cap, so
  gloo's ring sums each gradient element in another order (a last-bit difference, as between
  two reruns of one job on a GPU cluster). At two ranks a sum of two terms is exact in any
  order, so `order` changes nothing there.
- `ulp`: one initial weight moved by one unit in the last place (any world size).

Printed per seed: both metrics and their difference; summary: the mean and worst absolute
difference and the standard deviation of the difference, against `--tolerance` when given.

    python -m bench.noise_floor [--workload glyphs] [--seeds 0-4] [--steps N]
                                [--world-size 4] [--perturb order|ulp]
                                [--bucket-cap-mb 25] [--tolerance 0.02] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch

from nfabric_cli.binding import compile_profile, static_profile
from nfabric_cli.binding.buckets import first_step_buckets, plan_buckets
from nfabric_cli.binding.fingerprint import trainable_parameters
from nfabric_cli.calibration.simulate import simulate_run
from nfabric_cli.validation.seeds import parse_seeds
from nfabric_cli.workloads.registry import get_workload


def nudge_one_ulp(model: torch.nn.Module, index: int = 0) -> None:
    """Move element `index` of the first trainable weight to the next float toward +inf
    (another index: another run one ulp apart)."""
    p = trainable_parameters(model)[0].param
    with torch.no_grad():
        flat = p.view(-1)
        flat[index] = torch.nextafter(flat[index], torch.tensor(math.inf, dtype=p.dtype))


@contextlib.contextmanager
def nudged_builds(workload: Any, index: int = 0) -> Iterator[None]:
    """Within the block, `workload.build_model` returns models nudged by `nudge_one_ulp` at
    `index` (the simulator builds its ranks' models from it)."""
    build = workload.build_model

    def nudged(seed: int) -> torch.nn.Module:
        model = build(seed)
        nudge_one_ulp(model, index)
        return model

    workload.build_model = nudged
    try:
        yield
    finally:
        del workload.build_model  # the class's method again


def layouts_differ(model: torch.nn.Module, cap_mb: float) -> bool:
    """Whether DDP's buckets under `cap_mb` differ from its default's (else `order` is a
    no-op for this model)."""
    params = trainable_parameters(model)
    return (plan_buckets(params, None) != plan_buckets(params, cap_mb)
            or first_step_buckets(params, None) != first_step_buckets(params, cap_mb))


def run_seed(name: str, seed: int, steps: int, world: int, perturb: str, cap_mb: float) -> dict:
    workload = get_workload(name)
    model = workload.build_model(seed)
    profile = static_profile(model, "fp32", world_size=world)
    runs: dict[str, float] = {}
    t0 = time.perf_counter()
    for arm in ("fp32", perturb):
        cap = cap_mb if arm == "order" else None
        b = compile_profile(profile, model, world_size=world, total_steps=steps, bucket_cap_mb=cap)
        with nudged_builds(workload) if arm == "ulp" else contextlib.nullcontext():
            res = simulate_run(workload, b, world, steps, seed, checkpoints=(steps,), monitor=False)
        runs[arm] = res.metric
    sign = 1.0 if workload.higher_is_better else -1.0
    return {"seed": seed, "fp32": runs["fp32"], perturb: runs[perturb],
            "delta": sign * (runs[perturb] - runs["fp32"]), "seconds": time.perf_counter() - t0}


def summarise(rows: list[dict], tolerance: float | None) -> dict:
    deltas = [r["delta"] for r in rows]
    out = {"seeds": len(rows), "mean_abs": statistics.fmean(abs(d) for d in deltas),
           "worst_abs": max(abs(d) for d in deltas),
           "sd": statistics.stdev(deltas) if len(deltas) > 1 else 0.0, "tolerance": tolerance}
    if tolerance is not None:
        out["seeds_beyond_tolerance"] = sum(abs(d) > tolerance for d in deltas)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="glyphs")
    parser.add_argument("--seeds", default="0-4")
    parser.add_argument("--steps", type=int, default=None, help="default: the workload's")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--perturb", choices=("order", "ulp"), default=None,
                        help="default: order at three ranks or more, else ulp")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0,
                        help="the `order` run's DDP bucket cap (the reference keeps DDP's default)")
    parser.add_argument("--tolerance", type=float, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    workload = get_workload(args.workload)
    steps = args.steps or workload.default_steps
    perturb = args.perturb or ("order" if args.world_size >= 3 else "ulp")
    if perturb == "order":
        if args.world_size < 3:
            parser.error("--perturb order needs three ranks or more (two terms sum exactly)")
        if not layouts_differ(workload.build_model(0), args.bucket_cap_mb):
            parser.error(f"--bucket-cap-mb {args.bucket_cap_mb} gives this model DDP's default "
                         "buckets: pick another cap, or --perturb ulp")
    rows = []
    for seed in parse_seeds(args.seeds):
        row = run_seed(args.workload, seed, steps, args.world_size, perturb, args.bucket_cap_mb)
        rows.append(row)
        if not args.json:
            print(f"{args.workload} seed {seed} {steps} steps W={args.world_size}: fp32 "
                  f"{row['fp32']:.4f}, {perturb} {row[perturb]:.4f}, delta {row['delta']:+.4f} "
                  f"(+ is better; {row['seconds']:.0f} s)", flush=True)
    total = summarise(rows, args.tolerance)
    if args.json:
        print(json.dumps({"rows": rows, "summary": total}, indent=2))
    else:
        line = (f"\nrun-to-run noise ({perturb}) over {total['seeds']} seeds: mean |delta| "
                f"{total['mean_abs']:.4f}, worst {total['worst_abs']:.4f}, sd {total['sd']:.4f}")
        if args.tolerance is not None:
            line += (f"; {total['seeds_beyond_tolerance']} of {total['seeds']} seeds beyond "
                     f"the tolerance {args.tolerance} (fp32 against itself)")
        print(line)
    return total


if __name__ == "__main__":
    main()
