"""Publishing a study's profile: written once per study and trial count, whoever finishes.

A worker writes the profile when the study holds its budget and no trial is in flight, so
with several workers the one that finishes the last trial writes it and the others say so.
The write is claimed (`workers.Claim`, job `profile@<trials>`, with a `+confirm-<hash>`
suffix when the spec confirms) and recorded in the study's user attributes under the same
key: a worker that finishes at the same moment, or a rerun of a complete study, reports the
recorded profile instead of writing a second one, as long as that file still exists under the
run's `--out`; a rerun into another `--out` (or after the file was moved away) writes it there,
under a job and record of that folder's own (`_job`). The file itself takes the next free version
in its folder without ever replacing one (`write_next_version`), so calibrations of different
studies into one folder cannot clash.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from optuna.trial import TrialState

from nfabric_cli.calibration import workers
from nfabric_cli.calibration.choice import WARM
from nfabric_cli.calibration.outcome import Outcome
from nfabric_cli.calibration.plot import plot_search
from nfabric_cli.calibration.spec import CalibrationSpec
from nfabric_cli.calibration.study import StudyRun
from nfabric_cli.calibration.workers import counted
from nfabric_cli.profile import write_next_version

PROFILE_KEY = "profile@"


def profile_key(trials: int, spec: CalibrationSpec | None = None, warm: bool = False) -> str:
    """The job and record of one profile write: per trial count and, with a confirmation grid,
    per confirmation setting (a finished study confirmed later, or otherwise, may name another
    winner, so it writes another profile; a rerun of the same one reports the recorded one).
    `warm`: the study holds a warm start's trial, a confirmation candidate wherever it ranks
    since session 61 (a study published before may name another winner now)."""
    key = f"{PROFILE_KEY}{trials}"
    if spec is None or not spec.confirm_cells():
        return key
    fields: list[Any] = [spec.confirm_seeds, spec.confirm_steps, spec.confirm_candidates,
                         spec.confirm_rule]
    if spec.confirm_world_sizes:  # (appended only when set: earlier studies keep their names)
        fields.append(spec.confirm_world_sizes)
    if spec.confirm_repairs != 1:  # (appended only when not the default, for the same reason;
        fields.append({"repairs": spec.confirm_repairs})  # a round that trained changes `trials`)
    if warm:
        fields.append({"warm": "a candidate"})
    if spec.confirm_rule == "validate":  # (the rule is new: earlier names stand)
        fields.append({"validate_seeds": spec.confirm_validate_seeds})
    setting = json.dumps(fields)
    return f"{key}+confirm-{hashlib.sha256(setting.encode()).hexdigest()[:10]}"


def publish(run: StudyRun, build: Callable[[], Outcome], out_root: str | Path,
            write: bool = True) -> Outcome:
    """The study's outcome (`build()`), with its profile written here if this worker is the
    one to (see the module docstring); else `outcome.note` says why not, and the path is the
    recorded one if another worker wrote it."""
    study = run.study
    while True:
        workers.fail_dead_trials(study, run.worker)
        seen = counted(study)  # before `build()`, which reads the study more than once
        outcome = build()
        warm = any(t.user_attrs.get("kind") == WARM for t in seen)
        key = _job(study, profile_key(outcome.trials, run.spec, warm), out_root)
        if _recorded(study, key, outcome, out_root):
            return outcome
        if not write:
            outcome.note = "--no-write: this worker contributes trials only"
            return outcome
        running = [t for t in seen if t.state == TrialState.RUNNING]
        if running:
            names = sorted({t.user_attrs.get("worker", "?") for t in running})
            outcome.note = (f"{len(running)} trial(s) still running on {', '.join(names)}: the "
                            "worker that finishes the last one writes the profile")
            return outcome
        if outcome.pending:
            outcome.note = ("confirmation cells are still in training (`confirm.py`): the "
                            "worker that confirms the winner writes the profile")
            return outcome
        claim = workers.Claim(study, key, run.worker)
        if not claim.try_acquire():
            time.sleep(workers.POLL_S)  # the holder is writing it right now
            continue
        done = False  # recorded, by this worker or another: the claim is not taken again
        try:
            if done := _recorded(study, key, outcome, out_root):
                return outcome
            # a trial that started or finished since `build()` began changes what it saw
            now = counted(study)
            if _states(now) != _states(seen) or len(now) != outcome.trials:
                continue
            _write(run, outcome, out_root)
            study.set_user_attr(key, {"path": str(outcome.path.resolve()),
                                      "png": str(outcome.png.resolve()),
                                      "worker": run.worker.id, "written": time.time()})
            done = True
            return outcome
        finally:
            claim.release(done=done)


def _states(trials: list[Any]) -> list[tuple[int, TrialState]]:
    return sorted((t.number, t.state) for t in trials)


def _job(study: Any, key: str, out_root: str | Path) -> str:
    """The job and record of this write: `key`, unless the profile recorded under it is not
    in `out_root` (another `--out`, or moved away); then the folder's own job, a new
    generation of it each time its profile went missing (a claim once done is never taken
    again: reusing its name, the rerun waited for it forever)."""
    root = hashlib.sha256(str(Path(out_root).resolve()).encode()).hexdigest()[:10]
    for generation in itertools.count():
        job = key if not generation else f"{key}@out-{root}" + (
            f"#{generation}" if generation > 1 else "")
        record = study.user_attrs.get(job)
        if not record or _in(record, out_root):
            return job
    raise AssertionError("unreachable")


def _in(record: dict[str, Any], out_root: str | Path) -> bool:
    """Whether a recorded profile still exists under `out_root` (a path recorded relative,
    as before, is taken from the working directory)."""
    path = Path(record["path"]).resolve()
    return path.is_file() and path.is_relative_to(Path(out_root).resolve())


def _recorded(study: Any, key: str, outcome: Outcome, out_root: str | Path) -> bool:
    record = study.user_attrs.get(key)
    if not record or not _in(record, out_root):
        return False
    outcome.path, outcome.png = Path(record["path"]), Path(record["png"])
    outcome.written_by = record["worker"]
    return True


def _write(run: StudyRun, outcome: Outcome, out_root: str | Path) -> None:
    path = write_next_version(outcome.profile, out_root, run.workload.name)
    png = path.with_suffix(".png")
    plot_search(run, outcome.best, png)  # the choice the profile holds, not read again
    outcome.path, outcome.png, outcome.written_by = path, png, run.worker.id


def recorded_profiles(user_attrs: dict[str, Any]) -> list[dict[str, Any]]:
    """Every profile a study's `user_attrs` record as written: trials, path, worker, time."""
    out = [{"trials": int(re.match(r"\d+", k[len(PROFILE_KEY):]).group()), **v}  # type: ignore[union-attr]
           for k, v in user_attrs.items() if k.startswith(PROFILE_KEY) and isinstance(v, dict)]
    return sorted(out, key=lambda r: r["trials"])
