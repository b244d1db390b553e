"""Seeding a study: the sensitivity sweep (each region alone on its cheapest route) and the
configurations it suggests, enqueued once each (again if one was lost to a killed worker)."""

from __future__ import annotations

import optuna
from optuna.trial import TrialState

from nfabric_cli.calibration.space import derived_configs, sweep_configs
from nfabric_cli.calibration.spec import CalibrationSpec

LIVE = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.WAITING, TrialState.RUNNING)


def enqueue_sweep(study: optuna.Study, spec: CalibrationSpec) -> None:
    """Enqueue each region's sweep trial unless the study has it (done, queued or running)."""
    have = {t.user_attrs.get("region") for t in study.get_trials(deepcopy=False, states=LIVE)
            if t.user_attrs.get("kind") == "sweep"}
    for region, config in sweep_configs(spec).items():
        if region not in have:
            study.enqueue_trial(config.params(spec), {"kind": "sweep", "region": region})


def sensitivity(study: optuna.Study, spec: CalibrationSpec) -> dict[str, float] | None:
    """Region -> degradation alone on its cheapest route; None until the sweep is done."""
    found: dict[str, float] = {}
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if t.user_attrs.get("kind") == "sweep" and "degradation" in t.user_attrs:
            found.setdefault(t.user_attrs["region"], float(t.user_attrs["degradation"]))
    wanted = set(sweep_configs(spec))
    return found if wanted <= set(found) else None


def enqueue_derived(study: optuna.Study, spec: CalibrationSpec) -> None:
    """Once the sweep is done, enqueue the seeds it suggests (again, if one was lost)."""
    sens = sensitivity(study, spec)
    if sens is None:
        return
    have = {t.user_attrs.get("key") for t in study.get_trials(deepcopy=False, states=LIVE)
            if t.user_attrs.get("kind") == "derived"}
    for config in derived_configs(spec, sens):
        if config.key() not in have:
            study.enqueue_trial(config.params(spec), {"kind": "derived", "key": config.key()})


def enqueue_seeds(study: optuna.Study, spec: CalibrationSpec) -> None:
    """Missing sweep trials, then (once the sweep is done) its seeds."""
    enqueue_sweep(study, spec)
    enqueue_derived(study, spec)
