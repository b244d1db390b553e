"""Which trial wins: the admissible trials, and the confirmation grid the leading ones must hold on.

The search trains every trial on one seed at one length, and the cheapest trial within
tolerance there is selected *for* passing: its margin is optimistic. Profiles chosen that way
failed 7 of 16 real runs on other seeds and lengths (issue 15), the lm profile by +0.070 nats
at seed 1 against a tolerance of 0.05. So, when the spec names confirmation seeds or lengths
(``[confirm]``), the leading admissible trials (by traffic, ``candidates`` of them, plus a warm
start's trial wherever it ranks, and repairs) are trained
again on every *cell* of the grid, seeds (the spec's and ``confirm.seeds``) times lengths (its
``steps`` and ``confirm.steps``) at the search's world size and at each of
``confirm.world_sizes``, each against an FP32 reference trained on the same cell.

The default rule (`confirm.rule = "worst"`) is `validate --seeds`' rule, the worst cell: a
candidate holds when every cell is within tolerance of that cell's reference; a candidate
stops at its first failing cell (`confirm.failed_first` trains the cells earlier candidates
failed on first). `rule = "bound"` asks more:
the one-sided 95 % prediction bound for one more seed, from the candidate's cells, within
tolerance (every cell is trained). `rule = "validate"` asks both, every cell and room for the
worst of `confirm.validate_seeds` more seeds at 95 % (`target.validation_bound`): what a
`validate --seeds` run on that many unseen seeds checks. Of the candidates that hold, the one with the least traffic
over its cells wins (a profile whose monitor falls back on other seeds or world sizes sends
those fp32 steps too): after a candidate holds, the next ones are confirmed only while their
search traffic is below its mean over the cells. When none holds, repairs (`repair.py`) add
candidates; when none of those holds either, the profile is all fp32 (the reference itself:
nothing unproven ships).

This module only reads: results live in the study's user attributes under `cell_job` names
(`confirm.py` trains them), so a resumed study and every worker see the same verdicts.
"""

from __future__ import annotations

import hashlib
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from nfabric_cli.calibration.space import Config, routing_key, suggest
from nfabric_cli.calibration.spec import CalibrationSpec, Cell
from nfabric_cli.profile.target import (
    degradation,
    prediction_bound,
    validation_bound,
    within_tolerance,
)

#: the kind of a trial confirmation enqueued to repair a failing candidate (`repair.py`)
REPAIR = "repair"
#: the kind of a warm start's trial: the last profile's routes (`warm.py`)
WARM = "warm"


def config_of(trial: FrozenTrial, spec: CalibrationSpec) -> Config:
    """Rebuild a trial's config from its stored parameters."""
    return suggest(optuna.trial.FixedTrial(trial.params), spec)


def completed(study: optuna.Study) -> list[FrozenTrial]:
    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if "traffic_fraction" in t.user_attrs]


def _rank(t: FrozenTrial) -> tuple[float, float, int]:
    return (t.user_attrs["traffic_fraction"], t.user_attrs["degradation"], t.number)


def admissible(study: optuna.Study, tolerance: float,
               repairs: bool = True) -> list[FrozenTrial]:
    """Completed trials within tolerance, cheapest first (ties: less degradation, then the
    earlier trial), one per configuration (`same_training`); `repairs=False` leaves out
    confirmation's repairs (`repair.py`)."""
    ok = sorted((t for t in completed(study)
                 if within_tolerance(t.user_attrs["degradation"], tolerance)
                 and (repairs or t.user_attrs.get("kind") != REPAIR)), key=_rank)
    seen: set[tuple[str, float, float]] = set()
    out = []
    for t in ok:
        key = same_training(t)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def same_training(t: FrozenTrial) -> tuple[str, float, float]:
    """What makes two trials one candidate: the same `routing_key` and the same search result.
    TPE samples a boundary between phases that route alike anyway (glyphs: trials 5 and 10,
    boundaries 0.05 and 0.16, equal results), and both took a candidate's place in
    confirmation (three runs that another configuration should have had)."""
    key = routing_key(t.user_attrs.get("key", str(t.number)))
    return key, t.user_attrs["traffic_fraction"], t.user_attrs["degradation"]


def best_admissible(study: optuna.Study, tolerance: float) -> FrozenTrial | None:
    """The cheapest trial within tolerance on the search's own seed and length, or None."""
    ok = admissible(study, tolerance)
    return ok[0] if ok else None


def candidates(study: optuna.Study, spec: CalibrationSpec) -> list[FrozenTrial]:
    """The trials confirmation tries, cheapest first: the `confirm_candidates` cheapest
    admissible trials other than repairs, the warm start's trial wherever it ranks (the last
    profile: a recalibration whose cheaper candidates all fail still tries it before repairs
    or all fp32), and the admissible repairs of the rounds the spec allows (`repair.py`; a
    repair that reused an identical earlier trial's result is that trial). A study without
    repairs or a warm start has exactly its cheapest admissible trials."""
    plain = admissible(study, spec.tolerance, repairs=False)[:spec.confirm_candidates]
    have = {same_training(t) for t in plain}
    allowed = {same_training(t) for t in completed(study)
               if t.user_attrs.get("kind") == WARM
               or (t.user_attrs.get("kind") == REPAIR
                   and int(t.user_attrs.get("repair_round", 0)) <= spec.confirm_repairs)} - have
    extra = [t for t in admissible(study, spec.tolerance) if same_training(t) in allowed]
    return sorted(plain + extra, key=_rank)


def _cell_path(cell: tuple[int, ...]) -> str:
    """`s<seed>/n<steps>`, and `/w<W>` for a world size other than the search's: cells at
    the search's own keep the names studies stored before world sizes were confirmed."""
    c = Cell(*cell)
    return f"s{c.seed}/n{c.steps}" + ("" if c.world_size is None else f"/w{c.world_size}")


def reference_job(cell: tuple[int, ...]) -> str:
    return f"reference/{_cell_path(cell)}"


def cell_job(config_key: str, cell: tuple[int, ...]) -> str:
    """The job name (and user-attribute key) of one configuration's run on one cell."""
    digest = hashlib.sha256(config_key.encode()).hexdigest()[:12]
    return f"confirm/{digest}/{_cell_path(cell)}"


def cell_verdict(attrs: dict[str, Any], key: str, cell: tuple[int, ...], spec: CalibrationSpec,
                 higher_is_better: bool) -> dict[str, Any] | None:
    """One candidate's stored result on one cell against that cell's reference; None when
    either run is not stored yet."""
    ref, run = attrs.get(reference_job(cell)), attrs.get(cell_job(key, cell))
    if ref is None or run is None:
        return None
    d = degradation(run["metric"], ref["metric"], higher_is_better)
    c = Cell(*cell)
    return {"seed": c.seed, "steps": c.steps, "world_size": c.ranks(spec.world_size),
            "metric": run["metric"],
            "reference": ref["metric"], "degradation": d,
            "traffic_fraction": run["traffic_fraction"],
            "within": within_tolerance(d, spec.tolerance)}


def candidate_verdict(t: FrozenTrial, attrs: dict[str, Any], spec: CalibrationSpec,
                      higher_is_better: bool, reference: dict[str, Any]) -> dict[str, Any]:
    """One candidate: its cells (the search's own first, then those of the grid stored in
    `attrs`), the worst and the mean degradation over them, the 95 % prediction bound for one
    more seed (`bound95`) and the one for the worst of the spec's `validate_seeds` more
    (`validate_bound95`), and its status, `holds`, `fails` or `pending`. Under the `worst` and
    `validate` rules a candidate fails at any cell outside tolerance (confirmation trains none
    of its cells after one); under `bound` it needs every cell. Under `bound` and `validate`
    it holds when that rule's bound is within tolerance as well. `cells` lists the stored
    ones in the grid's order."""
    rule = spec.confirm_rule
    own = {"seed": spec.seed, "steps": spec.steps, "world_size": spec.world_size,
           "metric": t.user_attrs["metric"],
           "reference": reference["metric"], "degradation": t.user_attrs["degradation"],
           "traffic_fraction": t.user_attrs["traffic_fraction"], "within": True}
    cells, missing = [own], False
    for cell in spec.confirm_cells():
        v = cell_verdict(attrs, t.user_attrs["key"], cell, spec, higher_is_better)
        if v is None:
            missing = True
        else:
            cells.append(v)
    failed = spec.every_cell_within and not all(c["within"] for c in cells)
    status = "fails" if failed else "pending" if missing else "holds"
    degrs = [c["degradation"] for c in cells]
    traffic = [c["traffic_fraction"] for c in cells]
    out = {"trial": t.number, "traffic_fraction": t.user_attrs["traffic_fraction"],
           "status": status, "cells": cells, "worst_degradation": max(degrs),
           "mean_degradation": sum(degrs) / len(degrs), "bound95": prediction_bound(degrs),
           "validate_bound95": validation_bound(degrs, spec.confirm_validate_seeds),
           "traffic_mean": sum(traffic) / len(traffic)}
    judged = out[judged_bound(rule)]
    if status == "holds" and rule != "worst" and not within_tolerance(
            judged if judged is not None else max(degrs), spec.tolerance):
        out["status"] = "fails"
    if t.user_attrs.get("kind") == REPAIR:
        a = t.user_attrs
        out["repair"] = {"of": a["repair_of"], "round": a["repair_round"], "region": a["region"]}
    return out


def judged_bound(rule: str) -> str:
    """The verdict key of the bound a confirmation rule judges by (and tables print)."""
    return "validate_bound95" if rule == "validate" else "bound95"


def beaten(search_traffic: float, best: dict[str, Any] | None) -> bool:
    """Whether a candidate that measured `search_traffic` in the search need not be
    confirmed: a holder measured no more than that over its cells (`traffic_mean`). A
    heuristic that bounds the confirmation's cost: a candidate's mean over its cells is
    usually no less than its search traffic (its fallbacks elsewhere add fp32 steps), but may
    be where other cells send fewer bytes or the search cell itself fell back."""
    return best is not None and search_traffic >= best["traffic_mean"]


def verdicts(study: optuna.Study, spec: CalibrationSpec, higher_is_better: bool,
             reference: dict[str, Any],
             tried: list[FrozenTrial] | None = None) -> list[dict[str, Any]]:
    """`candidate_verdict` of every candidate (`tried`, default `candidates`), in order (one
    read of the study's attributes)."""
    attrs = study.user_attrs
    return [candidate_verdict(t, attrs, spec, higher_is_better, reference)
            for t in (candidates(study, spec) if tried is None else tried)]


def decide(found: list[dict[str, Any]]) -> tuple[int | None, bool]:
    """From the candidates' verdicts, in order: (the winning trial's number or None, whether a
    candidate that could still win is pending). The winner is the holder with the least
    traffic over its cells (`traffic_mean`: the fp32 steps its fallbacks sent on the other
    seeds, lengths and world sizes count), among the candidates up to the first whose search
    traffic is no less than that (`beaten`); a pending one before it leaves the choice open."""
    best = None
    for v in found:
        if beaten(v["traffic_fraction"], best):
            break
        if v["status"] == "pending":
            return None, True
        if v["status"] == "holds" and (best is None or v["traffic_mean"] < best["traffic_mean"]):
            best = v
    return (None if best is None else best["trial"]), False


def robust_winner(study: optuna.Study, spec: CalibrationSpec, higher_is_better: bool,
                  reference: dict[str, Any]) -> FrozenTrial | None:
    """The winner: without a grid, the cheapest admissible trial; with one, of the
    candidates whose every cell is stored and within tolerance, the one with the least
    traffic over its cells (`decide`; None: all fp32). A multi-objective study has no
    grid (`CalibrationSpec.confirm_cells`): its winner is the cheapest admissible trial."""
    if not spec.confirm_cells():
        return best_admissible(study, spec.tolerance)
    number, _ = decide(verdicts(study, spec, higher_is_better, reference))
    return None if number is None else next(t for t in completed(study) if t.number == number)


def pending(study: optuna.Study, spec: CalibrationSpec, higher_is_better: bool,
            reference: dict[str, Any]) -> bool:
    """Whether confirmation still has a cell to train before the winner is known (asked by
    `confirm`, which a multi-objective study never reaches)."""
    return decide(verdicts(study, spec, higher_is_better, reference))[1]
