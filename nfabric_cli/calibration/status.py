"""A study as it stands, for `nfabric calibrate --status`: trials, best, workers, profiles.

Read-only: it claims nothing and trains nothing, so it is safe to run beside live workers.
"""

from __future__ import annotations

import time
from typing import Any

import optuna
from optuna.trial import TrialState

from nfabric_cli.calibration.choice import best_admissible
from nfabric_cli.calibration.confirm import confirmation_cost
from nfabric_cli.calibration.publish import recorded_profiles
from nfabric_cli.calibration.storage import open_storage, redact
from nfabric_cli.calibration.workers import Claim, Worker, is_claim, live_workers
from nfabric_cli.errors import InputError


def study_status(storage_url: str | None, name: str) -> dict[str, Any]:
    """The named study's trials, counts, best admissible trial, workers and profiles."""
    storage = open_storage(storage_url, create=False)  # a status only reads
    try:
        study = optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        names = sorted(s.study_name for s in optuna.get_all_study_summaries(storage)
                       if not is_claim(s.study_name))
        known = f"; its studies: {', '.join(names)}" if names else "; it holds no study"
        raise InputError(f"no study {name!r} in {redact(storage_url or 'the default storage')}"
                         f"{known}") from None
    attrs = study.user_attrs
    tolerance = (attrs.get("spec") or {}).get("tolerance")
    trials = [_trial_row(t) for t in study.get_trials(deepcopy=False)]
    counts = {s.name.lower(): 0 for s in TrialState}
    for row in trials:
        counts[row["state"].lower()] += 1
    counts["dropped"] = sum(1 for row in trials if row["dropped"])
    counts["fail"] -= counts["dropped"]
    best = None if tolerance is None else best_admissible(study, tolerance)
    me = Worker.current()
    ref = attrs.get("reference")
    holder = Claim(study, "reference", me).peek() if ref is None else None
    reference = ({"state": "done", "metric": ref["metric"]} if ref is not None
                 else {"state": "running", "worker": holder.get("worker")} if holder is not None
                 else {"state": "not started"})
    return {
        "study": name,
        "workload": attrs.get("workload"),
        "tolerance": tolerance,
        "reference": reference,
        "counts": counts,
        "best": None if best is None else _trial_row(best),
        "trials": trials,
        "workers": live_workers(attrs, me),  # one read of the study's attributes for all
        "profiles": recorded_profiles(attrs),
        "confirmation": confirmation_cost(attrs),  # cells trained so far (`confirm.py`)
        "now": time.time(),
    }


def _trial_row(t: optuna.trial.FrozenTrial) -> dict[str, Any]:
    a = t.user_attrs
    last = a.get("last") or {}
    return {
        "trial": t.number,
        "kind": a.get("kind", "search"),
        "state": t.state.name,
        "worker": a.get("worker"),
        "traffic_fraction": a.get("traffic_fraction", last.get("traffic_fraction")),
        "degradation": a.get("degradation", last.get("degradation")),
        "steps_run": a.get("steps_run", 0),
        "routes": a.get("routes"),
        "reused_from": a.get("reused_from"),
        "dropped": a.get("dropped"),
    }
