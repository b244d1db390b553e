"""Step time behind a shaped link: profile vs fp32, static sign and PyTorch's fp16 and PowerSGD.

For each rate, one `nfabric validate` run (2 ranks of `vision` by default) puts every arm behind
the same `tc tbf`-shaped loopback in a fresh network namespace, so the arms' step times are
measured side by side in one run. Printed per rate: each arm's median step time and its ratio
to fp32, the traffic fraction, and the bytes the arm claims to have sent (all ranks) against
the namespace's loopback tx counter (kernel-counted bytes). Needs root (ip netns, tc); rate 0
is plain loopback in the same kind of namespace.

Arms: `fp32` (plain DDP), `static` (every parameter on sign: the kernel-counted bytes of an
all-sign run), `profile` (no substrate, so with `--gate measure` it keeps whichever of
low-bit and plain fp32 its probe steps timed faster, whole steps), `fp16` and `powersgd` (rank 2). Issue 16's
goals: at every rate profile <= 1.05 x min(fp32, static); at 20 Mbit/s profile <= 0.8 x
PowerSGD and <= 0.08 x fp32; all-sign loopback tx / fp32's <= 0.04.

    OMP_NUM_THREADS=1 python -m bench.validate_link [--rates 20,50,100,200,500,1000,0]
        [--steps 60] [--workload vision] [--profile PATH] [--world-size 2] [--gate measure]
        [--runs N]

One run's ratios move by about +-15 % on this 2-core machine (a 16 ms step); `--runs 3` gives
each ratio's median and range. `bench.link_paired` times the same arms interleaved in the same
ranks, which a shared host's drifting load cannot skew; this one counts the bytes.

Without --profile a hand-written one is used: the workload's head on fp32, the rest on sign.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from nfabric_cli.validation.config import ValidateConfig
from nfabric_cli.validation.run import run_validation

ARM_ORDER = ("fp32", "profile", "fp16", "powersgd", "static")


def head_fp32_profile(workload: str, out: Path) -> Path:
    from nfabric_cli.binding import static_profile
    from nfabric_cli.profile import write_profile
    from nfabric_cli.workloads.registry import get_workload

    wl = get_workload(workload)
    model = wl.build_model(0)
    prof = static_profile(model, "sign", [(wl.head_selector, "fp32")], workload=wl.name)
    return write_profile(prof, out)


def run_rate(args: argparse.Namespace, profile: Path, mbit: float | None, root: Path) -> dict:
    cfg = ValidateConfig(
        source=str(profile), workload=args.workload, world_size=args.world_size,
        steps=args.steps, arms=["fp32", "static", "profile"], baselines=["fp16", "powersgd"],
        link_mbit=mbit, tolerance=1.0, timeout_s=300.0, gate=args.gate,
        report_dir=str(root / f"link-{mbit or 'none'}"),
    )  # fmt: skip
    return run_validation(cfg).summary or {}


def print_rate(mbit: float | None, s: dict) -> None:
    arms = s["arms"]
    base = arms["fp32"]["step_time_s"]
    title = f"{mbit:g} Mbit/s" if mbit else "no shaping"
    print(f"\n== {s['workload']}, {s['world_size']} ranks, {s['steps']} steps, {title}")
    print(f"{'arm':<9} {'step ms':>9} {'x fp32':>7} {'traffic':>8} {'claimed B':>12} "
          f"{'lo tx B':>12} {'tx/claimed':>10} {'B/packet over':>13}")  # fmt: skip
    for name in ARM_ORDER:
        if name not in arms:
            continue
        a = arms[name]
        link = a.get("link_bytes") or {}
        ratio, packets = link.get("ratio"), link.get("packets")
        extra = (link["measured_tx"] - link["claimed"]) / packets if packets else None
        print(
            f"{name:<9} {1000 * a['step_time_s']:>9.1f} {a['step_time_s'] / base:>7.3f} "
            f"{100 * a['traffic_fraction']:>7.2f}% {link.get('claimed', 0):>12,} "
            f"{link.get('measured_tx', 0):>12,} {'' if ratio is None else f'{ratio:.4f}':>10} "
            f"{'' if extra is None else f'{extra:.1f}':>13}"
        )


def ratios(s: dict) -> dict[str, float]:
    """Each arm's step time / fp32's, and the profile's / min(fp32, static)'s (issue 16's goal)."""
    arms = s["arms"]
    out = {n: arms[n]["step_time_s"] / arms["fp32"]["step_time_s"] for n in ARM_ORDER if n in arms}
    if "profile" in out and "static" in out:
        out["profile/best"] = out["profile"] / min(1.0, out["static"])
    return out


def values_over_runs(rows: list[dict]) -> dict[str, list[float]]:
    """Per key that is a number in every run's row (a ratio), its values over the runs, in run
    order: what a summary over several runs takes its median and spread from."""
    return {key: [r[key] for r in rows] for key, value in rows[0].items()
            if isinstance(value, float) and all(isinstance(r.get(key), float) for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="20,50,100,200,500,1000,0",
                        help="Mbit/s, comma separated; 0: loopback unshaped")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--workload", default="vision")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--profile", type=Path, default=None)
    parser.add_argument("--gate", default="measure", choices=("model", "measure"),
                        help="The profile arm's capacity gate (no substrate: measure times it).")
    parser.add_argument("--runs", type=int, default=1,
                        help="Sweeps over every rate, one after another (rates interleaved, so "
                             "drift in load hits them alike); the summary gives each ratio's "
                             "median and range over them.")
    parser.add_argument("--out", type=Path, default=None, help="Keep reports here.")
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="nfabric-bench-link-"))
    profile = args.profile or head_fp32_profile(args.workload, root / "head-fp32.parquet")
    rates = args.rates.split(",")
    results: dict[str, list[dict[str, float]]] = {text: [] for text in rates}
    for run in range(args.runs):
        for text in rates:
            mbit = float(text) or None
            s = run_rate(args, profile, mbit, root / f"run-{run}")
            results[text].append(ratios(s))
            print_rate(mbit, s)
    print(f"\nratios (step time / fp32 step time; profile/best: / min(fp32, static)), "
          f"{args.runs} run(s): median, and [min, max] over runs")
    for text, runs in results.items():
        row: dict[str, object] = {"mbit": float(text)}
        for name, vals in values_over_runs(runs).items():
            row[name] = round(statistics.median(vals), 3)
            if len(vals) > 1:
                row[f"{name} range"] = [round(min(vals), 3), round(max(vals), 3)]
        print(json.dumps(row))
    print(f"reports: {root}")


if __name__ == "__main__":
    main()
