"""How early can a checkpoint tell which trials will end out of tolerance?

Reads unpruned studies kept by `bench.calibrate_pruning --unpruned-only --keep DIR` (every
trial trained to the end, so each one's final verdict is known) and prints, per checkpoint,
the ROC AUC with which each early signal separates the trials that end out of tolerance from
those that end within it (1.0: every failing trial scores above every admissible one; 0.5:
chance). The signals:

- `metric gap`: the trial's metric behind the reference's at the same step (what the default
  checkpoint formula judges, `slack`);
- `loss gap`: the trial's mean training loss over the steps since the previous checkpoint
  minus the reference's over the same steps (the same batches: data noise cancels; what the
  `loss` formula judges, scaled to metric units).

A pruner can only cut a trial safely at a checkpoint where its signal separates well; below
about 0.9, cutting the worse part of a rung also cuts trials that would have ended within
tolerance, and among them, sometimes, the study's winner.

    python -m bench.calibrate_signal DIR [--tolerance X]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import optuna

from nfabric_cli.profile.target import degradation
from nfabric_cli.workloads.registry import get_workload


def auc(scores: list[float], failed: list[bool]) -> float:
    """P(a failing trial scores above an admissible one), ties counting half."""
    pos = [s for s, f in zip(scores, failed, strict=True) if f]
    neg = [s for s, f in zip(scores, failed, strict=True) if not f]
    if not pos or not neg:
        return float("nan")
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def signals(path: Path, higher_is_better: bool) -> list[tuple[float, list[float], list[float]]]:
    """(final degradation, metric gap per checkpoint, loss gap per checkpoint) per trained
    trial of one kept study."""
    study = optuna.load_study(study_name="bench", storage=f"sqlite:///{path}")
    ref = study.user_attrs["reference"]
    if "loss_curve" not in ref:
        raise SystemExit(f"{path}: kept before training losses were recorded")
    ref_metric = {int(s): m for s, m in ref["curve"]}
    ref_loss = {int(s): v for s, v in ref["loss_curve"]}
    out = []
    for t in study.get_trials(deepcopy=False):
        cps = t.user_attrs.get("checkpoints")
        if not cps or t.state != optuna.trial.TrialState.COMPLETE:
            continue  # reused (trained nothing) or failed
        metric_gap = [degradation(m, ref_metric[int(s)], higher_is_better) for s, m, *_ in cps]
        loss_gap = [c[3] - ref_loss[int(c[0])] for c in cps]
        out.append((float(t.user_attrs["degradation"]), metric_gap, loss_gap))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="kept studies: seed<S>-arm0.db")
    parser.add_argument("--workload", default="vision")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="default: the workload's calibration spec")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    wl = get_workload(args.workload)
    if args.tolerance is None:
        from nfabric_cli.calibration.spec import resolve_spec
        args.tolerance = resolve_spec(wl.name, wl.head_selector, wl.default_steps).tolerance
    rows = [r for path in sorted(args.folder.glob("seed*-arm0.db"))
            for r in signals(path, wl.higher_is_better)]
    if not rows:
        raise SystemExit(f"no kept studies (seed*-arm0.db) in {args.folder}")
    failed = [d > args.tolerance for d, _, _ in rows]
    print(f"{len(rows)} trained trials, {sum(failed)} ended out of tolerance "
          f"({args.tolerance} on {wl.name})")
    print("checkpoint  AUC metric gap  AUC loss gap")
    for i in range(min(len(r[1]) for r in rows)):
        print(f"{i + 1:>10}  {auc([r[1][i] for r in rows], failed):>14.2f}  "
              f"{auc([r[2][i] for r in rows], failed):>12.2f}")


if __name__ == "__main__":
    main()
