"""Hyperband vs no pruning on the same budget: training steps spent to reach the same best.

Three fresh studies with the same spec, seed and number of trials: no pruning, Hyperband
alone, and Hyperband with the traffic bound (a trial whose least possible traffic cannot beat
the best admissible trial is pruned before it trains; what `nfabric calibrate` does). With the
default random sampler every study proposes the same configurations in the same order (its
draws do not depend on results), so the comparison isolates the pruning. Per study: the best
objective, the simulated training steps spent until it was first reached, and in all. Ratios:
steps each pruned study spent to reach the unpruned study's best (or its own best, if it never
got there) over the steps the unpruned study spent. The FP32 reference is shared (computed
once per seed) and not counted; sweep and seed trials are (`--no-sweep` leaves them out).

Which trial first reaches the best depends on the order the sampler proposes configurations
(every configuration that improves on the best so far has to train to the end to show it is
within tolerance), so one order says little: `--seeds` repeats the comparison for several
seeds (each its own model, data order and proposals) and pools the steps.

    OMP_NUM_THREADS=1 python -m bench.calibrate_pruning [--workload vision] [--trials 20]
        [--steps 60] [--seeds 0,1,2,3,4] [--no-sweep]
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


def record_floor(traj: list[tuple[int, float | None, int]], target: float, steps: int) -> int:
    """Steps any pruner must spend before reaching `target` in this trial order: every trial
    that beats the best so far *within tolerance* (objective < 1) has to train to the end to
    show it, pruned or not; everything else could in principle cost nothing."""
    best, records = float("inf"), 0
    for _, value, _ in traj:
        if value is not None and value < best:
            best = value
            records += value < 1.0
        if value is not None and value <= target + 1e-12:
            break
    return records * steps


def steps_to_reach(traj: list[tuple[int, float | None, int]], target: float) -> int | None:
    for _, value, spent in traj:
        if value is not None and value <= target + 1e-12:
            return spent
    return None


ARMS = (("none", "none", False), ("hyperband", "hyperband", False),
        ("hyperband+bound", "hyperband", True))


def compare(wl, base, seed: int, sweep: bool) -> dict[str, tuple[list, float, float, int]]:  # noqa: ANN001
    """One seed: label -> (trajectory, best objective, wall seconds, pruned count)."""
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/bench.db"
        reference = None
        for label, pruner, bound in ARMS:
            spec = base.with_overrides(pruner=pruner, seed=seed)
            name = f"bench-{label}"
            if reference is not None:  # share the FP32 reference: same spec, same numbers
                study = optuna.create_study(study_name=name, storage=url)
                study.set_user_attr("workload", wl.name)
                study.set_user_attr("search_key", spec.search_key())
                study.set_user_attr("spec", {k: v for k, v in spec.to_dict().items()
                                             if k not in ("trials", "sampler", "pruner")})
                study.set_user_attr("reference", reference)
            t0 = time.perf_counter()
            run = run_study(wl, spec, url, name, sweep=sweep, traffic_bound=bound)
            wall = time.perf_counter() - t0
            reference = run.reference
            pruned = len(run.study.get_trials(states=(TrialState.PRUNED,)))
            results[label] = (trajectory(run.study), run.study.best_value, wall, pruned)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="vision")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--sampler", default="random")
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated")
    parser.add_argument("--no-sweep", action="store_true",
                        help="search alone: no sweep or seed trials (they often find the best "
                             "before the pruner matters)")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)

    wl = get_workload(args.workload)
    base = resolve_spec(wl.name, wl.head_selector, wl.default_steps).with_overrides(
        steps=args.steps, eval_every=args.eval_every, trials=args.trials, sampler=args.sampler,
    )
    print(f"workload {wl.name}, {args.trials} trials x {args.steps} steps (checkpoint every "
          f"{args.eval_every}), sampler {args.sampler}, "
          f"{'no sweep' if args.no_sweep else 'with sweep and seeds'}")
    pooled = {label: [0, 0, 0] for label, _, _ in ARMS}  # steps to reach, none's, total
    floor = 0
    for seed in (int(x) for x in args.seeds.split(",")):
        results = compare(wl, base, seed, not args.no_sweep)
        none_traj, none_best, _, _ = results["none"]
        seed_floor = record_floor(none_traj, none_best, args.steps)
        floor += seed_floor
        print(f"seed {seed}: (floor for any pruner in this order: {seed_floor} steps)")
        for label, (traj, best, wall, pruned) in results.items():
            total = traj[-1][2] if traj else 0
            reach = steps_to_reach(traj, best)
            print(f"  {label:>15}: best objective {best:.4f}, reached after {reach} steps, "
                  f"{total} steps in all, {pruned} pruned, {wall:.0f} s")
        for label, (traj, best, _, _) in results.items():
            target = none_best if steps_to_reach(traj, none_best) is not None else best
            reach, base_reach = steps_to_reach(traj, target), steps_to_reach(none_traj, target)
            missed = "" if target == none_best else " (missed the unpruned best: own best)"
            pooled[label][0] += reach
            pooled[label][1] += base_reach
            pooled[label][2] += traj[-1][2]
            if label != "none":
                print(f"  {label}: steps to reach {target:.4f}: {reach} vs none {base_reach} -> "
                      f"{reach / base_reach:.2f}{missed}; total steps {traj[-1][2] / none_traj[-1][2]:.2f}")
    total_none = pooled["none"][2]
    print(f"pooled over seeds (floor for any pruner: {floor} steps -> "
          f"{floor / pooled['none'][1]:.2f}):")
    for label in ("hyperband", "hyperband+bound"):
        reach, base_reach, total = pooled[label]
        print(f"  {label}: steps to reach the same best {reach} vs none {base_reach} -> "
              f"ratio {reach / base_reach:.2f}; total steps ratio {total / total_none:.2f}")


if __name__ == "__main__":
    main()
