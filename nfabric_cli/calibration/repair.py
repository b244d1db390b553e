"""Repairs: when confirmation rejects every candidate, spend more bits where one failed.

The search ranks its trials on one seed, so its cheapest admissible trials are often close
variants of one configuration, and a seed that configuration loses on rejects them all (the
transformer at ten seeds, session 56: its three cheapest were all `sign` and all failed
seed 5 at two ranks). The study then wrote the all-fp32 profile, though the same routes with
one fragile region on fp32 held (head on fp32: degradation +1.67 points there, against
+2.78).

A repair round takes the cheapest candidate that failed (round 1: of the search's candidates;
round k: of round k-1's repairs) and enqueues one trial per region it routes low-bit, with
that region on fp32 in every phase. They train on the search's cell like any trial (never
pruned, outside the trial budget: `kind` "repair"), and the admissible ones join the
candidates (`choice.candidates`), confirmed on the cells that failed first
(`confirm.failed_first`). A round that a stopped run left unfinished is finished first. No
new round starts once a candidate holds, after `confirm.repairs` rounds (spec; default 1;
0: off, and a study's earlier repairs are no candidates), or when the last round left no
failed admissible repair with a region left to raise: a round whose repairs all missed the
tolerance on the search's cell ends the repairs. A region must list fp32 among its routes to
be raised; the all-fp32 configuration is the reference and never a repair.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from nfabric_cli.calibration.choice import REPAIR, candidates, config_of, same_training, verdicts
from nfabric_cli.calibration.space import Config
from nfabric_cli.calibration.spec import CalibrationSpec

if TYPE_CHECKING:
    from nfabric_cli.calibration.study import Calibrator


def raised(config: Config, spec: CalibrationSpec) -> dict[str, Config]:
    """Region name -> `config` with that region on fp32 in every phase, for each region it
    routes below fp32 in some phase and that may take fp32 (spec order); never the all-fp32
    config (the reference, which needs no confirming)."""
    out = {}
    for r, region in enumerate(spec.regions):
        if "fp32" not in region.routes or all(p[r] == "fp32" for p in config.routes):
            continue
        routes = tuple(tuple("fp32" if i == r else route for i, route in enumerate(per_phase))
                       for per_phase in config.routes)
        repaired = Config(routes, config.boundaries, config.tau, config.error_feedback,
                          config.rounding, config.sign_mode)
        if not repaired.all_fp32():
            out[region.name] = repaired
    return out


#: a repair trial that exists or will train (a killed worker's FAIL is enqueued again)
LIVE = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.WAITING, TrialState.RUNNING)


def _repairs(study: optuna.Study) -> list[FrozenTrial]:
    return [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("kind") == REPAIR]


def _live_keys(repairs: list[FrozenTrial]) -> set[str]:
    """Configurations of `repairs` that exist or will train."""
    return {t.user_attrs.get("key") for t in repairs if t.state in LIVE}


def due(study: optuna.Study, spec: CalibrationSpec, higher_is_better: bool,
        reference: dict[str, Any]) -> tuple[int, FrozenTrial] | None:
    """(round, the trial it repairs) when a round is due: the last one's repairs are not all
    trained (a resumed study), or every candidate failed and fewer than `confirm.repairs`
    rounds ran; else None (a candidate holds or is pending, or nothing is left to raise)."""
    reps = _repairs(study)
    current = max((int(t.user_attrs["repair_round"]) for t in reps), default=0)
    if 0 < current <= spec.confirm_repairs:  # the last round, finished if a run stopped it
        number = next(int(t.user_attrs["repair_of"]) for t in reps
                      if int(t.user_attrs["repair_round"]) == current)
        parent = next(t for t in study.get_trials(deepcopy=False) if t.number == number)
        live = _live_keys(reps)
        if waiting_repairs(study) or any(c.key() not in live for c in
                                         raised(config_of(parent, spec), spec).values()):
            return current, parent
    if current >= spec.confirm_repairs:
        return None
    tried = candidates(study, spec)
    found = verdicts(study, spec, higher_is_better, reference, tried)
    if any(v["status"] != "fails" for v in found):
        return None
    # a candidate's round: its repair's, matched as `candidates` matches (a repair that reused a
    # searched trial's result is that trial); a searched candidate's is 0
    round_of = {same_training(t): int(t.user_attrs["repair_round"])
                for t in reps if t.state == TrialState.COMPLETE}
    failed = [t for t in tried  # cheapest first
              if round_of.get(same_training(t), 0) == current
              and raised(config_of(t, spec), spec)]
    return (current + 1, failed[0]) if failed else None


def enqueue_repairs(study: optuna.Study, spec: CalibrationSpec, number: int,
                    parent: FrozenTrial) -> list[str]:
    """Enqueue round `number`'s repairs of `parent` that the study does not hold live yet
    (another worker may have); the regions raised."""
    live = _live_keys(_repairs(study))
    raises = raised(config_of(parent, spec), spec)
    for region, config in raises.items():
        if config.key() not in live:
            study.enqueue_trial(config.params(spec), {
                "kind": REPAIR, "key": config.key(), "repair_of": parent.number,
                "repair_round": number, "region": region})
    return list(raises)


def waiting_repairs(study: optuna.Study) -> int:
    return sum(1 for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
               if t.user_attrs.get("kind") == REPAIR)


def repair(cal: Calibrator, study: optuna.Study, train: Callable[[], None]) -> bool:
    """One repair round, if one is due (`due`): enqueue it and train what waits (`train()`
    runs one queued trial). Whether anything trained; `confirm` judges it next."""
    found = due(study, cal.spec, cal.workload.higher_is_better, cal.reference)
    if found is None:
        return False
    number, parent = found
    regions = enqueue_repairs(study, cal.spec, number, parent)
    if not waiting_repairs(study):  # another worker trains and confirms them; `publish`
        return False                # leaves the profile to the worker that finishes last
    cal.sink.note(f"no candidate holds: repair round {number} trains trial {parent.number} "
                  f"with one region on fp32 ({', '.join(regions)})")
    while waiting_repairs(study):  # (a leftover seed trial popped first is dropped: the
        train()                    # budget is full)
    return True
