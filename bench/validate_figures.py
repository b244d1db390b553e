"""The validation figures: static low-bit vs a profile vs fp32 on real 4-rank DDP runs.

- `lm` at world size 4, 600 steps: is `static` (every parameter on sign) clearly worse than
  fp32 while the profile stays within tolerance?
- `vision` at world size 4, its default steps: is the profile within 1 accuracy point at
  <= 10 % of fp32 traffic (goal <= 4 %)?

Each line is one `nfabric validate` run (fp32, static, profile arms side by side, same seed,
data order and initial weights). Profiles: the committed `profiles/<workload>/` one when it
exists, and a hand-written one (`profile init --route sign --set HEAD=fp32 ...`), so both are
reported.

    OMP_NUM_THREADS=1 python -m bench.validate_figures [--only lm,vision] [--lm-steps 600]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from nfabric_cli.validation.config import ValidateConfig
from nfabric_cli.validation.run import run_validation

#: Hand-written profiles: sensitive regions on fp32, everything else on sign.
HAND_RULES = {
    "lm": [
        ("head.*", "fp32"),
        ("embed*", "fp32"),
        ("pos_embed*", "fp32"),
        ("type:LayerNorm", "fp32"),
    ],
    "vision": [("head.*", "fp32")],
}


def hand_profile(workload: str, out: Path) -> Path:
    from nfabric_cli.binding import static_profile
    from nfabric_cli.profile import write_profile
    from nfabric_cli.workloads.registry import get_workload

    model = get_workload(workload).build_model(0)
    return write_profile(
        static_profile(model, "sign", HAND_RULES[workload], workload=workload), out
    )


def profiles_for(workload: str, root: Path) -> dict[str, Path]:
    out = {}
    committed = Path("profiles") / workload
    if committed.is_dir() and any(committed.glob(f"{workload}.v*.parquet")):
        out["committed"] = committed
    rules = ",".join(f"{s}={r}" for s, r in HAND_RULES[workload])
    out[f"hand ({rules}, rest sign)"] = hand_profile(workload, root / f"{workload}-hand.parquet")
    return out


def run(workload: str, profile: Path, steps: int | None, world: int, report: Path) -> dict:
    cfg = ValidateConfig(
        source=str(profile), workload=workload, world_size=world, steps=steps,
        arms=["fp32", "static", "profile"], timeout_s=300.0, report_dir=str(report),
    )  # fmt: skip
    return run_validation(cfg).summary or {}


def show(workload: str, label: str, s: dict) -> None:
    print(f"\n== {workload}, W={s['world_size']}, {s['steps']} steps, profile: {label}")
    print(f"   tolerance {s['tolerance']:g} ({'higher' if s['higher_is_better'] else 'lower'} "
          f"is better), passed: {s['passed']}")  # fmt: skip
    for name, a in s["arms"].items():
        metric = "diverged" if a["metric"] is None else f"{a['metric']:.4f}"
        delta = "-" if a["metric_delta"] is None else f"{a['metric_delta']:+.4f}"
        print(f"   {name:<8} metric {metric:>9}  delta {delta:>8}  traffic "
              f"{100 * a['traffic_fraction']:6.2f} %  step {1000 * a['step_time_s']:7.1f} ms  "
              f"fallbacks {a['fallbacks']}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="lm,vision")
    parser.add_argument("--lm-steps", type=int, default=600)
    parser.add_argument("--vision-steps", type=int, default=None, help="default: the workload's")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None, help="Keep reports here.")
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="nfabric-bench-figures-"))
    root.mkdir(parents=True, exist_ok=True)
    steps = {"lm": args.lm_steps, "vision": args.vision_steps}
    lines = []
    for workload in args.only.split(","):
        for i, (label, profile) in enumerate(profiles_for(workload, root).items()):
            s = run(workload, profile, steps[workload], args.world_size, root / f"{workload}-{i}")
            show(workload, label, s)
            lines.append({"workload": workload, "profile": label, **s})
    (root / "figures.json").write_text(json.dumps(lines, indent=2))
    print(f"\nreports and figures.json: {root}")


if __name__ == "__main__":
    main()
