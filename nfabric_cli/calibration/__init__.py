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
from nfabric_cli.calibration.warm import WarmStart
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
    write: bool = True,
    warm: Sequence[WarmStart] = (),
) -> tuple[StudyRun, Outcome]:
    """Run (or resume, or join) the study and write the winning profile under
    `out/<workload>/` if this worker is the one to (`publish.py`; never with `write=False`).

    `processes`: processes computing the simulated ranks' gradients (default one per CPU, at
    most the world size); results do not depend on it. `warm`: configurations the study
    trains first (`warm.py`, `--warm-start`)."""
    from nfabric_cli.binding.fingerprint import fingerprint_of, trainable_parameters
    from nfabric_cli.binding.matching import params_record
    from nfabric_cli.calibration.publish import publish

    run = run_study(workload, spec, storage, study_name, sink, callbacks, processes=processes,
                    warm=warm)
    params = trainable_parameters(workload.build_model(spec.seed))
    fingerprint, record = fingerprint_of(params), params_record(params)
    return run, publish(run, lambda: build_outcome(run, storage, run.study.study_name,
                                                   fingerprint, record), out, write)


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
