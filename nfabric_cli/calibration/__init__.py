"""Calibration: search precision per region and phase with simulated data-parallel trials.

`calibrate(workload, spec)` runs the FP32 reference, the sensitivity sweep and the Optuna
study (`study.py`) on simulated DDP workers (`simulate.py`), then writes the lowest-traffic
profile within tolerance (`outcome.py`). Specs are TOML files (`spec.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import optuna

from nfabric_cli.calibration.outcome import Outcome, build_outcome, trial_rows
from nfabric_cli.calibration.simulate import SimResult, SimulatedDDP, simulate_run
from nfabric_cli.calibration.spec import CalibrationSpec, load_spec, parse_spec, resolve_spec
from nfabric_cli.calibration.study import ProgressSink, StudyRun, run_study
from nfabric_cli.workloads.base import Workload


def calibrate(
    workload: Workload,
    spec: CalibrationSpec,
    storage: str | None = None,
    study_name: str | None = None,
    out: str | Path = "profiles",
    sink: ProgressSink | None = None,
    callbacks: Sequence[Callable[[optuna.Study, optuna.trial.FrozenTrial], None]] = (),
    processes: int | None = None,
) -> tuple[StudyRun, Outcome]:
    """Run (or resume) the study and write the winning profile under `out/<workload>/`.

    `processes`: processes computing the simulated ranks' gradients (default one per CPU, at
    most the world size); results do not depend on it."""
    from nfabric_cli.binding.fingerprint import model_fingerprint

    run = run_study(workload, spec, storage, study_name, sink, callbacks, processes=processes)
    fingerprint = model_fingerprint(workload.build_model(spec.seed))
    outcome = build_outcome(run, out, storage, run.study.study_name, fingerprint)
    return run, outcome


__all__ = [
    "CalibrationSpec",
    "Outcome",
    "ProgressSink",
    "SimResult",
    "SimulatedDDP",
    "StudyRun",
    "calibrate",
    "load_spec",
    "parse_spec",
    "resolve_spec",
    "run_study",
    "simulate_run",
    "trial_rows",
]
