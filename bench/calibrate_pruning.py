"""Hyperband vs no pruning on the same budget: training steps spent to reach the same best.

Three fresh studies with the same spec, seed and number of trials: no pruning, Hyperband
alone, and Hyperband with the traffic bound (a trial whose least possible traffic cannot beat
the best admissible trial is pruned before it trains; what `nfabric calibrate` does). With the
default random sampler every study proposes the same configurations in the same order (its
draws do not depend on results), so the comparison isolates the pruning. Per study: the best
objective, the simulated training steps spent until it was first reached, and in all. Ratios:
steps each pruned study spent to reach the unpruned study's best (or its own best, if it never
got there) over the steps the unpruned study spent. The FP32 reference is shared (computed
once) and not counted; sweep and seed trials are (`--no-sweep` leaves them out).

    OMP_NUM_THREADS=1 python -m bench.calibrate_pruning [--workload vision] [--trials 20] [--steps 60]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings

import optuna
from optuna.trial import TrialState

from nfabric_cli.calibration.spec import resolve_spec
from nfabric_cli.calibration.study import run_study
from nfabric_cli.workloads.registry import get_workload


def trajectory(study: optuna.Study) -> list[tuple[int, float | None, int]]:
    """(trial, value or None for a failed trial, cumulative steps) in trial order."""
    out, spent = [], 0
    for t in study.trials:
        spent += int(t.user_attrs.get("steps_run", 0))
        value = t.value if t.state in (TrialState.COMPLETE,) else None
        out.append((t.number, value, spent))
    return out


def steps_to_reach(traj: list[tuple[int, float | None, int]], target: float) -> int | None:
    for _, value, spent in traj:
        if value is not None and value <= target + 1e-12:
            return spent
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="vision")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--sampler", default="random")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-sweep", action="store_true",
                        help="search alone: no sweep or seed trials (they often find the best "
                             "before the pruner matters)")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)

    wl = get_workload(args.workload)
    base = resolve_spec(wl.name, wl.head_selector, wl.default_steps).with_overrides(
        steps=args.steps, eval_every=args.eval_every, trials=args.trials, sampler=args.sampler,
        seed=args.seed,
    )
    results, pruned = {}, {}
    arms = (("none", "none", False), ("hyperband", "hyperband", False),
            ("hyperband+bound", "hyperband", True))
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/bench.db"
        reference = None
        for label, pruner, bound in arms:
            spec = base.with_overrides(pruner=pruner)
            name = f"bench-{label}"
            if reference is not None:  # share the FP32 reference: same spec, same numbers
                study = optuna.create_study(study_name=name, storage=url)
                study.set_user_attr("workload", wl.name)
                study.set_user_attr("search_key", spec.search_key())
                study.set_user_attr("spec", {k: v for k, v in spec.to_dict().items()
                                             if k not in ("trials", "sampler", "pruner")})
                study.set_user_attr("reference", reference)
            t0 = time.perf_counter()
            run = run_study(wl, spec, url, name, sweep=not args.no_sweep, traffic_bound=bound)
            wall = time.perf_counter() - t0
            reference = run.reference
            results[label] = (trajectory(run.study), run.study.best_value, wall)
            pruned[label] = len(run.study.get_trials(states=(TrialState.PRUNED,)))
    print(f"workload {wl.name}, {args.trials} trials x {args.steps} steps, sampler {args.sampler}, "
          f"{'no sweep' if args.no_sweep else 'with sweep and seeds'}")
    for label, (traj, best, wall) in results.items():
        total = traj[-1][2] if traj else 0
        reach = steps_to_reach(traj, best)
        print(f"{label:>15}: best objective {best:.4f}, reached after {reach} steps, "
              f"{total} steps in all, {pruned[label]} pruned, {wall:.0f} s")
    none_traj, none_best, _ = results["none"]
    for label in ("hyperband", "hyperband+bound"):
        traj, best, _ = results[label]
        target = none_best if steps_to_reach(traj, none_best) is not None else best
        note = "the unpruned best" if target == none_best else "its own best (missed the unpruned best)"
        reach, base_reach = steps_to_reach(traj, target), steps_to_reach(none_traj, target)
        print(f"{label}: steps to reach {note} ({target:.4f}) {reach} vs none {base_reach} "
              f"-> ratio {reach / base_reach:.2f}; total steps ratio "
              f"{traj[-1][2] / none_traj[-1][2]:.2f}")


if __name__ == "__main__":
    main()
