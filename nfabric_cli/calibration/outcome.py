"""From a finished study to an operating profile: the winner, its evidence, the Pareto front.

The winner is the completed trial with the lowest measured traffic fraction whose final metric
is within tolerance of the FP32 reference (ties: smaller degradation, then earlier trial); when
the spec has a confirmation grid, of the candidates that hold on every cell of it, the one with
the least traffic over its cells (`choice.py`). If no trial qualifies, the all-FP32 profile
wins: it is the reference itself. The profile records
where it was proven (`meta["proven"]`: seeds, lengths, world size, each cell's result), which
`validate` and `attach` compare with the run they are given (`profile/proven.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optuna.trial import FrozenTrial, TrialState

from nfabric_cli.calibration.choice import (
    best_admissible,
    candidate_verdict,
    completed,
    config_of,
    decide,
    verdicts,
)
from nfabric_cli.calibration.codeprint import code_fingerprint, foreign_results
from nfabric_cli.calibration.confirm import confirmation_cost
from nfabric_cli.calibration.space import Config, config_profile, fp32_config, route_param
from nfabric_cli.calibration.spec import CalibrationSpec
from nfabric_cli.calibration.storage import redact
from nfabric_cli.calibration.strategy import pruner_label
from nfabric_cli.calibration.study import StudyRun
from nfabric_cli.profile.operating import OperatingProfile
from nfabric_cli.profile.provenance import base_provenance
from nfabric_cli.profile.target import validation_quantile
from nfabric_cli.profile.thresholds import HealthThresholds


@dataclass
class Outcome:
    """What `nfabric calibrate` reports and writes."""

    profile: OperatingProfile
    path: Path | None  # None until written (`publish.py`); another worker's path if it wrote
    png: Path | None
    trials: int  # finished (complete + pruned) trials in the study
    pruned: int
    best: dict[str, Any]
    pareto: list[dict[str, Any]]
    steps_spent: int  # simulated training steps over the study, reference included
    new_trials: int
    written_by: str | None = None  # the worker that wrote the profile (`host:pid`)
    note: str | None = None  # why this worker did not write it, when it did not
    pending: bool = False  # a confirmation cell is still untrained: no winner may be written


def pareto_front(run: StudyRun) -> list[dict[str, Any]]:
    """Completed trials no other trial beats on both traffic and degradation (by traffic)."""
    points = [(t.user_attrs["traffic_fraction"], t.user_attrs["degradation"], t.number)
              for t in completed(run.study)]
    front = [p for p in points
             if not any(q[0] <= p[0] and q[1] <= p[1] and q[:2] != p[:2] for q in points)]
    seen, out = set(), []
    for traffic, degr, number in sorted(front):
        if (traffic, degr) not in seen:
            seen.add((traffic, degr))
            out.append({"trial": number, "traffic_fraction": traffic, "degradation": degr})
    return out


def steps_spent(run: StudyRun) -> int:
    trials = run.study.get_trials(deepcopy=False)
    return int(run.reference.get("steps_run", 0)) + sum(
        int(t.user_attrs.get("steps_run", 0)) for t in trials
    ) + confirmation_cost(run.study.user_attrs)["train_steps"]


def row_evidence(run: StudyRun, config: Config, winner: FrozenTrial | None) -> dict:
    """(region, phase) -> traffic_fraction, metric_delta, trials for the chosen config."""
    spec = run.spec
    done = completed(run.study)
    delta = 0.0 if winner is None else winner.user_attrs["metric"] - run.reference["metric"]
    rows = {} if winner is None else winner.user_attrs.get("row_traffic", {})
    out = {}
    for p, phase in enumerate(spec.phases):
        for r, region in enumerate(spec.regions):
            route = config.routes[p][r]
            name = route_param(region.name, phase)
            tried = sum(1 for t in done if t.params.get(name) == route)
            traffic = rows.get(f"{region.selector}@{phase}", 1.0 if route == "fp32" else None)
            out[(region.name, phase)] = {"traffic_fraction": traffic, "metric_delta": delta,
                                         "trials": tried}
    return out


def build_outcome(run: StudyRun, storage_url: str | None, study_name: str,
                  fingerprint: str, model_params: list | None = None) -> Outcome:
    """Pick the winner, build its profile and summarise the study (`publish` writes it)."""
    spec, study = run.spec, run.study
    confirmation = _confirmation(run)  # the candidates' verdicts, read once
    if confirmation is None:
        winner, waiting = best_admissible(study, spec.tolerance), False
    else:
        number, waiting = decide(confirmation["candidates"])
        winner = None if number is None else next(t for t in completed(study)
                                                  if t.number == number)
    config = fp32_config(spec) if winner is None else config_of(winner, spec)
    finished = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
    pruned = sum(1 for t in finished if t.state == TrialState.PRUNED)
    pareto = pareto_front(run) if run.multi_objective else []
    spent = steps_spent(run)
    reference = run.reference["metric"]
    best = {
        "trial": None if winner is None else winner.number,
        "traffic_fraction": 1.0 if winner is None else winner.user_attrs["traffic_fraction"],
        "metric": reference if winner is None else winner.user_attrs["metric"],
        "reference": reference,
        "metric_delta": 0.0 if winner is None else winner.user_attrs["metric"] - reference,
        "within_tolerance": True,
        "routes": config.labels(spec),
        "tau": config.tau if config.uses("ternary") else None,
        "error_feedback": config.error_feedback,
        "rounding": config.rounding if config.uses("int8") or config.uses("int4") else None,
        "sign_mode": config.sign_mode if config.uses("sign") else None,
        "boundaries": list(config.boundaries),
    }
    if confirmation is not None:
        best["confirmation"] = confirmation
    if winner is None:
        best["note"] = ("no low-bit configuration stayed within tolerance" +
                        (" on every confirmation cell" if confirmation else "") + ": all fp32")
    if run.multi_objective:
        best["pareto_front"] = pareto
    wl = run.workload
    meta = {
        "workload": wl.name,
        "model_fingerprint": fingerprint,
        "world_size": spec.world_size,
        "health": HealthThresholds.from_dict(run.health).to_dict(),
        "target": {"metric": wl.metric_name, "reference": reference,
                   "tolerance": spec.tolerance, "higher_is_better": wl.higher_is_better},
        "provenance": base_provenance(
            source="calibrate",
            study=study_name,
            storage=redact(storage_url or "sqlite:///.nfabric/studies.db"),
            sampler=spec.sampler,
            pruner=pruner_label(spec),
            seed=spec.seed,
            trials=len(finished),
            pruned=pruned,
            budget={"trials": spec.trials, "steps": spec.steps, "eval_every": spec.eval_every,
                    "train_steps_spent": spent},
            reference_metric=reference,
            data_fingerprint=wl.data_fingerprint(),
            code_fingerprint=code_fingerprint(),
            # stored results other code trained (a resumed study): their metrics are in this
            # record, and this code may not replay them
            foreign_results=len(foreign_results(run.study)),
            winner_trial=best["trial"],
            sensitivity=run.extra.get("sensitivity", {}),
            confirmation=None if confirmation is None else confirmation["cost"],
            pareto_front=pareto or None,
            spec=spec.to_dict(),
            model_params=model_params,
        ),
    }
    if spec.substrate:  # the fabric the gate priced during the search: validate prices it too
        meta["substrate"] = spec.substrate
    if winner is not None:
        meta["proven"] = _proven(run, winner, confirmation)
    elif confirmation is not None:  # nothing held: the profile is the reference, all fp32
        meta["proven"] = {"fp32": True}
    profile = config_profile(spec, config, meta, row_evidence(run, config, winner))
    return Outcome(profile, None, None, len(finished), pruned, best, pareto, spent, run.new_trials,
                   pending=waiting)


def _confirmation(run: StudyRun) -> dict[str, Any] | None:
    """The confirmation grid, every candidate's verdict and what it cost (None: no grid)."""
    cells = run.spec.confirm_cells()  # none for a multi-objective study: a Pareto front
    if not cells:
        return None
    home = run.spec.world_size
    doc = {"cells": [[c.seed, c.steps, c.ranks(home)] for c in cells],
           "rule": run.spec.confirm_rule,
           "candidates": verdicts(run.study, run.spec, run.workload.higher_is_better,
                                  run.reference),
           "cost": confirmation_cost(run.study.user_attrs)}
    if run.spec.confirm_rule == "validate":
        doc["validate_seeds"] = run.spec.confirm_validate_seeds
    return doc


def rule_text(spec: CalibrationSpec | None) -> str:
    """`meta["proven"]["rule"]`: the confirmation rule in words (None: no grid, the search's
    own cell alone, judged like `worst`)."""
    rule = "worst" if spec is None else spec.confirm_rule
    if rule == "bound":
        return "the 95 % prediction bound for one more seed within tolerance"
    every = "every cell within tolerance of its own fp32 reference"
    if rule == "worst":
        return every
    return (f"{every}, and the worst of {spec.confirm_validate_seeds} more seeds within it at "
            "95 % (the prediction bound for one more seed at "
            f"{validation_quantile(spec.confirm_validate_seeds):.2%})")


def _proven(run: StudyRun, winner: FrozenTrial, confirmation: dict[str, Any] | None
            ) -> dict[str, Any]:
    """Where the winner was shown within tolerance: every cell it ran on (the search's own,
    and the confirmation grid's), in the simulator, at the spec's world size and the grid's
    others (`world_sizes`; `world_size` stays the search's, as profiles before it read)."""
    spec = run.spec
    mine = (candidate_verdict(winner, {}, spec, run.workload.higher_is_better, run.reference)
            if confirmation is None  # no grid: the search's own cell alone
            else next(v for v in confirmation["candidates"] if v["trial"] == winner.number))
    cells = [{k: c[k] for k in ("seed", "steps", "world_size", "metric", "reference",
                                "degradation")}
             for c in mine["cells"]]
    return {"seeds": sorted({c["seed"] for c in cells}),
            "steps": sorted({c["steps"] for c in cells}),
            "world_size": spec.world_size,
            "world_sizes": sorted({c["world_size"] for c in cells}), "simulated": True,
            "rule": rule_text(spec if confirmation is not None else None),
            "worst_degradation": mine["worst_degradation"], "bound95": mine["bound95"],
            "validate_bound95": mine["validate_bound95"],
            "validate_seeds": spec.confirm_validate_seeds,
            "cells": cells}


def trial_rows(run: StudyRun) -> list[dict[str, Any]]:
    """Every finished trial, for tables and the plot."""
    rows = []
    for t in run.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        a = t.user_attrs
        last = a.get("last") or {}
        rows.append({
            "trial": t.number,
            "kind": a.get("kind", "search"),
            "state": t.state.name,
            "traffic_fraction": a.get("traffic_fraction", last.get("traffic_fraction")),
            "degradation": a.get("degradation", last.get("degradation")),
            "steps_run": a.get("steps_run", 0),
        })
    return rows
