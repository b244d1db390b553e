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
        [--steps 60] [--seeds 0,1,2,3,4] [--no-sweep] [--processes N]
        [--hb-min-resource 1,2] [--hb-reduction-factor 2,3] [--hb-brackets 1,3]
        [--intermediate slack,strict]

Several Hyperband shapes (the cross product of `--hb-min-resource`, `--hb-reduction-factor`
and `--hb-brackets`; 'd' is the spec's default) and checkpoint formulas (`--intermediate`,
names of `objective.INTERMEDIATE`) are each run alone and with the bound against one unpruned
study per seed. `--keep DIR` keeps every study (`DIR/seed<S>-arm<I>.db`); `--unpruned-only`
trains only the unpruned one (what `--replay` needs).

`--replay DIR` trains nothing: with the random sampler a pruned study proposes what the
unpruned one did and each trial reports the same values until it is pruned (runs are
deterministic), so it replays the kept unpruned studies (`seed<S>-arm0.db`) through
`make_pruner` and the traffic bound, exactly as `run_study` decides (it reproduces the live
arms' steps). The values a trial reports are recomputed with each arm's formula from its raw
checkpoints (the `checkpoints` user attr: step, metric, projected traffic, training loss); a
study kept before that attr existed replays its stored values, for the default formula only,
and `loss` needs studies kept with the training loss. `--trials N` replays the first N
trials; `--names K` repeats every replay under K study names, since Optuna assigns trials to
brackets by a hash of the study name and trial number (a live run uses one name, "bench").
Pooled figures add the missed bests: studies that ended on a worse best than the unpruned
one, and the mean regret (objective lost).
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import optuna
from optuna.trial import TrialState

from nfabric_cli.calibration.objective import DEFAULT_INTERMEDIATE, INTERMEDIATE, intermediate_value
from nfabric_cli.calibration.space import suggest
from nfabric_cli.calibration.spec import NOT_IN_SEARCH_KEY, CalibrationSpec, resolve_spec
from nfabric_cli.calibration.strategy import make_pruner, pruner_label
from nfabric_cli.calibration.study import Calibrator, run_study
from nfabric_cli.workloads.registry import get_workload


def trajectory(trials: list[optuna.trial.FrozenTrial]) -> list[tuple[int, float | None, int]]:
    """(trial, value or None for a pruned or failed trial, cumulative steps) in trial order."""
    out, spent = [], 0
    for t in trials:
        spent += int(t.user_attrs.get("steps_run", 0))
        out.append((t.number, t.value if t.state == TrialState.COMPLETE else None, spent))
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


@dataclass(frozen=True)
class Arm:
    """One study of the comparison: a pruner, the traffic bound on or off, Hyperband's shape
    (None: the spec's default), the checkpoint formula (a name in `objective.INTERMEDIATE`)."""

    label: str
    pruner: str
    bound: bool
    shape: tuple[int | None, int | None, int | None] = (None, None, None)  # min, rf, brackets
    intermediate: str = DEFAULT_INTERMEDIATE

    def overrides(self) -> dict[str, int | None]:
        keys = ("hyperband_min_resource", "hyperband_reduction_factor", "hyperband_brackets")
        return dict(zip(keys, self.shape, strict=True))


def make_arms(shapes: list[tuple[int | None, int | None, int | None]],
              formulas: tuple[str, ...] = (DEFAULT_INTERMEDIATE,)) -> list[Arm]:
    """The unpruned study, then Hyperband alone and with the bound for every formula and
    shape asked for (all against the one unpruned study per seed)."""
    arms = [Arm("none", "none", False)]
    for formula, shape in itertools.product(formulas, shapes):
        tag = "" if len(shapes) == 1 else "[" + ",".join(str(x or "d") for x in shape) + "]"
        if formulas != (DEFAULT_INTERMEDIATE,):
            tag += f"/{formula}"
        arms += [Arm(f"hyperband{tag}", "hyperband", False, shape, formula),
                 Arm(f"hyperband+bound{tag}", "hyperband", True, shape, formula)]
    return arms


def compare(wl, base, seed: int, sweep: bool, arms: list[Arm],  # noqa: ANN001
            processes: int | None, keep: Path | None) -> dict[str, tuple[list, float, float, int]]:
    """One seed, trained: label -> (trajectory, best objective, wall seconds, pruned count).

    Each arm has its own SQLite file and the same study name: Hyperband assigns trials to
    brackets by a hash of the study name and trial number, so every arm of one shape sees the
    same assignment. `keep`: a folder to keep the files in (else a temporary one)."""
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        reference = None
        for i, arm in enumerate(arms):
            spec = base.with_overrides(pruner=arm.pruner, seed=seed, **arm.overrides())
            db = folder / f"seed{seed}-arm{i}.db"
            db.unlink(missing_ok=True)
            url = f"sqlite:///{db}"
            if reference is not None:  # share the FP32 reference: same spec, same numbers
                study = optuna.create_study(study_name="bench", storage=url)
                study.set_user_attr("workload", wl.name)
                study.set_user_attr("search_key", spec.search_key())
                study.set_user_attr("spec", {k: v for k, v in spec.to_dict().items()
                                             if k not in NOT_IN_SEARCH_KEY})
                study.set_user_attr("reference", reference)
            t0 = time.perf_counter()
            run = run_study(wl, spec, url, "bench", sweep=sweep, traffic_bound=arm.bound,
                            processes=processes, intermediate=arm.intermediate)
            wall = time.perf_counter() - t0
            reference = run.reference
            pruned = len(run.study.get_trials(states=(TrialState.PRUNED,)))
            results[arm.label] = (trajectory(run.study.trials), run.study.best_value, wall, pruned)
    return results


def replay(wl, base: CalibrationSpec, seed: int, arms: list[Arm], folder: Path,  # noqa: ANN001
           names: list[str]) -> list[dict[str, tuple[list, float, float, int]]]:
    """One seed, replayed from the kept unpruned study: one `compare`-like dict per name."""
    spec = base.with_overrides(seed=seed)
    kept = optuna.load_study(study_name="bench", storage=f"sqlite:///{folder}/seed{seed}-arm0.db")
    trials = sorted(kept.get_trials(deepcopy=False), key=lambda t: t.number)[:spec.trials]
    if len(trials) < spec.trials:
        raise SystemExit(f"seed {seed}: the kept study has {len(trials)} trials, not {spec.trials}")
    calibrator = Calibrator(wl, spec)
    calibrator.reference = kept.user_attrs["reference"]
    values = {f: reported_values(trials, calibrator, f, seed)
              for f in {a.intermediate for a in arms[1:]}}
    bounds = {}  # the traffic lower bound of every configuration, as _prune_by_bound prices it
    for t in trials:
        bindings = calibrator.bindings_for(suggest(optuna.trial.FixedTrial(t.params), spec))
        bounds[t.number] = calibrator.lower_bound(bindings)
    none = trajectory(trials)
    none_best = min(v for _, v, _ in none if v is not None)
    out = []
    for name in names:
        results = {"none": (none, none_best, 0.0, 0)}
        for arm in arms[1:]:
            pruner = make_pruner(spec.with_overrides(pruner=arm.pruner, **arm.overrides()))
            traj = replay_arm(trials, spec, pruner, bounds if arm.bound else None, name,
                              values[arm.intermediate])
            best = min(v for _, v, _ in traj if v is not None)
            results[arm.label] = (traj, best, 0.0, sum(v is None for _, v, _ in traj))
        out.append(results)
    return out


def reported_values(trials: list[optuna.trial.FrozenTrial], calibrator: Calibrator,
                    formula: str, seed: int) -> dict[int, dict[int, float]]:
    """Trial number -> {checkpoint index: value} that `formula` makes `Calibrator.objective`
    report, from the trials' raw checkpoints; the stored values for a study kept without them
    (the default formula only: it is what those studies reported)."""
    marks = calibrator.spec.checkpoints()
    out = {}
    for t in trials:
        if not t.intermediate_values:
            continue
        if "checkpoints" not in t.user_attrs:
            if formula != DEFAULT_INTERMEDIATE:
                raise SystemExit(f"seed {seed}: trial {t.number} has no raw checkpoints (kept "
                                 f"before they were recorded): only --intermediate "
                                 f"{DEFAULT_INTERMEDIATE} can replay it")
            out[t.number] = dict(t.intermediate_values)
            continue
        if formula == "loss" and any(len(c) < 4 for c in t.user_attrs["checkpoints"]):
            raise SystemExit(f"seed {seed}: trial {t.number} has no training losses (kept before "
                             f"they were recorded): --intermediate loss cannot replay it")
        out[t.number] = {
            marks.index(step) + 1: intermediate_value(
                traffic, calibrator.degr(metric, step), calibrator.spec.tolerance,
                calibrator.slack(step), step == marks[-1], formula,
                calibrator.loss_degr(step, rest[0] if rest else None))
            for step, metric, traffic, *rest in t.user_attrs["checkpoints"]}
    return out


def replay_arm(trials: list[optuna.trial.FrozenTrial], spec: CalibrationSpec,
               pruner: optuna.pruners.BasePruner, bounds: dict[int, float] | None,
               name: str, values: dict[int, dict[int, float]]) -> list[tuple[int, float | None, int]]:
    """The unpruned study's trials through `pruner` (and the bound), as Calibrator.objective
    would run them, each reporting `values` (see `reported_values`): a repeated configuration
    reuses the first completed one for 0 steps."""
    study = optuna.create_study(study_name=name, pruner=pruner)
    curves = {t.user_attrs["key"]: t for t in trials if t.intermediate_values}
    marks = spec.checkpoints()
    done: dict[str, float] = {}
    admissible: list[float] = []
    traj, spent = [], 0
    for t in trials:
        trial, key = study.ask(), t.user_attrs["key"]
        reused = t.user_attrs.get("reused_from") == "reference" or key in done
        if reused:  # all fp32 (the reference) or a completed twin: no training
            value = done.get(key, t.value)
            if key not in done:
                admissible.append(1.0)
            study.tell(trial, value)
            traj.append((t.number, value, spent))
            continue
        prunable = t.user_attrs.get("kind", "search") == "search"
        if prunable and bounds is not None and admissible and \
                bounds[t.number] > min(admissible) + 1e-12:
            study.tell(trial, state=TrialState.PRUNED)
            traj.append((t.number, None, spent))
            continue
        src, stopped = curves[key], None
        for index, value in sorted(values[src.number].items()):
            trial.report(value, index)
            # pruned at the last checkpoint, a trial has trained anyway: simulate_run
            # completes it
            if prunable and trial.should_prune() and marks[index - 1] < spec.steps:
                stopped = marks[index - 1]
                break
        if stopped is not None:
            spent += stopped
            study.tell(trial, state=TrialState.PRUNED)
            traj.append((t.number, None, spent))
            continue
        spent += spec.steps
        study.tell(trial, src.value)
        done[key] = src.value
        if src.user_attrs.get("degradation", float("inf")) <= spec.tolerance:
            admissible.append(src.user_attrs["traffic_fraction"])
        traj.append((t.number, src.value, spent))
    return traj


def int_list(text: str) -> list[int | None]:
    """'1,2' -> [1, 2]; 'd' -> [None] (the spec's default)."""
    return [None if x.strip() == "d" else int(x) for x in text.split(",")]


def report(label_seed: str, results: dict[str, tuple[list, float, float, int]], steps: int,
           pooled: dict[str, list], verbose: bool) -> int:
    """Print one seed's figures, add them to `pooled`; returns the seed's floor in steps."""
    none_traj, none_best, _, _ = results["none"]
    floor = record_floor(none_traj, none_best, steps)
    if verbose:
        print(f"{label_seed}: (floor for any pruner in this order: {floor} steps -> "
              f"{floor / steps_to_reach(none_traj, none_best):.2f})")
        for label, (traj, best, wall, pruned) in results.items():
            print(f"  {label:>15}: best objective {best:.4f}, reached after "
                  f"{steps_to_reach(traj, best)} steps, {traj[-1][2]} steps in all, "
                  f"{pruned} pruned, {wall:.0f} s")
    for label, (traj, best, _, _) in results.items():
        target = none_best if steps_to_reach(traj, none_best) is not None else best
        reach, base_reach = steps_to_reach(traj, target), steps_to_reach(none_traj, target)
        missed = "" if target == none_best else " (missed the unpruned best: own best)"
        row = pooled.setdefault(label, [0, 0, 0, 0, 0.0])  # reach, none's, total, missed, regret
        row[0] += reach
        row[1] += base_reach
        row[2] += traj[-1][2]
        row[3] += bool(missed)
        row[4] += best - none_best
        if label != "none" and verbose:
            print(f"  {label}: steps to reach {target:.4f}: {reach} vs none {base_reach} -> "
                  f"{reach / base_reach:.2f}{missed}; total steps {traj[-1][2] / none_traj[-1][2]:.2f}")
    return floor


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
    parser.add_argument("--hb-min-resource", type=int_list, default=[None],
                        help="Hyperband min_resource in checkpoints, comma-separated to compare "
                             "several against one unpruned study ('d': the default)")
    parser.add_argument("--hb-reduction-factor", type=int_list, default=[None],
                        help="Hyperband reduction factor(s), comma-separated ('d': default)")
    parser.add_argument("--hb-brackets", type=int_list, default=[None],
                        help="Hyperband bracket count(s), comma-separated ('d': default)")
    parser.add_argument("--processes", type=int, default=None,
                        help="processes computing the simulated ranks' gradients (default: one "
                             "per CPU); the results do not depend on it")
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep every study's SQLite file in this folder (seed<S>-arm<I>.db)")
    parser.add_argument("--intermediate", default=DEFAULT_INTERMEDIATE,
                        help="checkpoint formula(s), comma-separated to compare several: "
                             + ", ".join(INTERMEDIATE))
    parser.add_argument("--unpruned-only", action="store_true",
                        help="train only the unpruned study (to --keep it for --replay)")
    parser.add_argument("--replay", type=Path, default=None,
                        help="train nothing: replay the unpruned studies kept in this folder")
    parser.add_argument("--names", type=int, default=1,
                        help="with --replay: study names to replay each seed under")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    if args.replay is not None and args.sampler != "random":
        parser.error("--replay needs the random sampler (TPE proposes from what was pruned)")

    wl = get_workload(args.workload)
    base = resolve_spec(wl.name, wl.head_selector, wl.default_steps).with_overrides(
        steps=args.steps, eval_every=args.eval_every, trials=args.trials, sampler=args.sampler,
    )
    formulas = tuple(args.intermediate.split(","))
    if not set(formulas) <= set(INTERMEDIATE):
        parser.error(f"--intermediate: one of {', '.join(INTERMEDIATE)}, got {args.intermediate}")
    arms = make_arms(list(itertools.product(args.hb_min_resource, args.hb_reduction_factor,
                                            args.hb_brackets)), formulas)
    if args.unpruned_only:
        arms = arms[:1]
    shapes = {a.label: pruner_label(base.with_overrides(pruner="hyperband", **a.overrides()))
              for a in arms if a.pruner == "hyperband"}
    mode = f"replayed from {args.replay} under {args.names} name(s)" if args.replay else "trained"
    print(f"workload {wl.name}, {args.trials} trials x {args.steps} steps (checkpoint every "
          f"{args.eval_every}), sampler {args.sampler}, "
          f"{'no sweep' if args.no_sweep else 'with sweep and seeds'}, {mode}")
    for i, arm in enumerate(arms):
        formula = f", {arm.intermediate} at checkpoints" if arm.pruner != "none" else ""
        print(f"  arm{i} {arm.label}: {shapes.get(arm.label, 'no pruning')}{formula}"
              f"{', traffic bound' if arm.bound else ''}")
    pooled: dict[str, list] = {}
    floor = studies = 0
    names = ["bench"] + [f"bench-{i}" for i in range(1, args.names)]
    for seed in (int(x) for x in args.seeds.split(",")):
        if args.replay is None:
            runs = [compare(wl, base, seed, not args.no_sweep, arms, args.processes, args.keep)]
        else:
            runs = replay(wl, base, seed, arms, args.replay, names)
        for results in runs:
            floor += report(f"seed {seed}", results, args.steps, pooled, len(runs) == 1)
            studies += 1
    none = pooled["none"]
    print(f"pooled over {studies} studies (floor for any pruner: {floor} steps -> "
          f"{floor / none[1]:.2f}):")
    for arm in arms[1:]:
        reach, base_reach, total, missed, regret = pooled[arm.label]
        print(f"  {arm.label}: steps to reach the same best {reach} vs none {base_reach} -> "
              f"ratio {reach / base_reach:.2f}; total steps ratio {total / none[2]:.2f}; "
              f"missed the best in {missed}, mean regret {regret / studies:.4f}")


if __name__ == "__main__":
    main()
