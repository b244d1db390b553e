"""Confirmation runs: the leading candidates trained on the grid `choice.py` defines.

Runs at the end of `run_study`, in every worker of the study, once no trial is in flight (so
all of them see the same candidates). Each cell is a shared job (`WorkerLog.shared`): workers
split the cells, and a resumed study trains only what is missing. The cost, per candidate
tried, is one run per cell it reaches, plus one FP32 reference per cell, shared by all the
candidates; `nfabric calibrate` prints it and the profile's provenance keeps it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import TrialState

from nfabric_cli.calibration import workers
from nfabric_cli.calibration.choice import (
    candidate_verdict,
    candidates,
    cell_job,
    cell_verdict,
    config_of,
    judged_bound,
    pending,
    reference_job,
)
from nfabric_cli.calibration.codeprint import KEY, code_fingerprint
from nfabric_cli.calibration.quiet import spikes_of
from nfabric_cli.calibration.simulate import simulate_run
from nfabric_cli.calibration.space import Config, fp32_config
from nfabric_cli.calibration.spec import CalibrationSpec, Cell
from nfabric_cli.profile.target import require_finite_reference

if TYPE_CHECKING:
    from nfabric_cli.calibration.study import Calibrator


def confirm(cal: Calibrator, study: optuna.Study) -> None:
    """Train confirmation cells until the winner is known (`choice.decide`): the holder with
    the least traffic over its cells, or none."""
    spec = cal.spec
    cells = spec.confirm_cells()
    if spec.confirm_ignored():
        cal.sink.note("no confirmation: a multi-objective study (nsga2) has a Pareto front, not "
                      "a list of candidates; the profile is proven on the search's own cell")
    if not cells:
        return
    _wait_for_trials(cal, study)
    higher = cal.workload.higher_is_better
    for trial in candidates(study, spec):
        if not pending(study, spec, higher, cal.reference):  # the winner is known
            return
        if candidate_verdict(trial, study.user_attrs, spec, higher,
                             cal.reference)["status"] == "fails":
            continue  # judged already (an earlier call, before a repair round)
        key, config = trial.user_attrs["key"], config_of(trial, spec)
        for cell in failed_first(study, spec, higher):
            where = _where(cell)
            ref = reference(cal, cell)
            require_finite_reference(ref["metric"], f"({where})")
            label = f"confirm trial {trial.number} {where}"
            _shared(cal, cell_job(key, cell), config, cell, label)
            verdict = cell_verdict(study.user_attrs, key, cell, spec, higher)
            assert verdict is not None  # both jobs are stored now
            if spec.every_cell_within and not verdict["within"]:
                cal.sink.note(f"trial {trial.number} fails on {where}: degradation "
                              f"{verdict['degradation']:+.4f}")
                break
        else:
            mine = candidate_verdict(trial, study.user_attrs, spec, higher, cal.reference)
            key95 = judged_bound(spec.confirm_rule)
            bound = "n/a" if mine[key95] is None else f"{mine[key95]:+.4f}"
            if mine["status"] == "holds":
                cal.sink.note(f"trial {trial.number} holds on every confirmation cell "
                              f"(worst {mine['worst_degradation']:+.4f}, bound {bound}; "
                              f"traffic {mine['traffic_mean']:.4f} over its cells)")
                continue
            cal.sink.note(f"trial {trial.number} fails the {spec.confirm_rule} rule: worst "
                          f"{mine['worst_degradation']:+.4f}, bound {bound}")


def failed_first(study: optuna.Study, spec: CalibrationSpec, higher_is_better: bool) -> list[Cell]:
    """The grid, the cells more candidates failed on first (stable): a candidate after them,
    a repair above all (`repair.py`), most likely fails where they did, and under the worst
    and validate rules it stops at its first failure. Under the bound rule every cell is
    trained anyway."""
    cells = spec.confirm_cells()
    if not spec.every_cell_within:
        return cells
    attrs = study.user_attrs
    keys = [t.user_attrs["key"] for t in candidates(study, spec)]
    fails = {cell: sum(1 for k in keys
                       if (v := cell_verdict(attrs, k, cell, spec, higher_is_better)) is not None
                       and not v["within"]) for cell in cells}
    return sorted(cells, key=lambda c: -fails[c])


def _where(cell: Cell) -> str:
    """'seed 1, 600 steps', and ', world size 2' where it is not the search's."""
    world = "" if cell.world_size is None else f", world size {cell.world_size}"
    return f"seed {cell.seed}, {cell.steps} steps{world}"


def reference(cal: Calibrator, cell: Cell) -> dict[str, Any]:
    """The FP32 reference of `cell`, stored or run here (shared by every worker). The
    detectors judge it passively: its loss spikes set the study's spike floor
    (`Calibrator.quiet`, run before the search)."""
    return _shared(cal, reference_job(cell), fp32_config(cal.spec), cell,
                   f"reference {_where(cell)}", passive=True)


def _shared(cal: Calibrator, job: str, config: Config, cell: Cell, label: str,
            passive: bool = False) -> dict[str, Any]:
    assert cal.log is not None  # run_study sets it
    return cal.log.shared(job, lambda: run_cell(cal, config, cell, label, passive),
                          lambda holder: cal.sink.note(f"waiting for {label}: {holder} runs it"))


def run_cell(cal: Calibrator, config: Config, cell: Cell, label: str,
             passive: bool = False) -> dict[str, Any]:
    """`config` trained on one cell (seed, steps, world size), evaluated once, at its end;
    `passive`: the detectors judge every step, nothing acts, and the loss spikes they report
    are kept (`quiet.spike_heights`)."""
    seed, steps, world = cell.seed, cell.steps, cell.ranks(cal.spec.world_size)
    cal.sink.trial_started(None, label, steps)
    start = time.perf_counter()
    result = simulate_run(cal.workload, cal.bindings_for(config, steps, world), world,
                          steps, seed, (steps,), None, cal.sink.step, processes=cal.processes,
                          passive=passive)
    out = {"metric": result.metric, "traffic_fraction": result.traffic_fraction,
           "steps_run": result.steps_run, "wall_s": round(time.perf_counter() - start, 2),
           "worker": cal.worker.id, KEY: code_fingerprint()}
    if passive:
        out["spikes"] = spikes_of(result)
    cal.sink.trial_finished({"number": None, "kind": label, "state": "COMPLETE",
                             "traffic_fraction": out["traffic_fraction"], "metric": out["metric"],
                             "note": f"metric {out['metric']:.4f}, traffic "
                                     f"{out['traffic_fraction']:.4f}"})
    return out


def _wait_for_trials(cal: Calibrator, study: optuna.Study) -> None:
    """Until no other worker's trial is running (a dead worker's is failed meanwhile)."""
    told = False
    while True:
        workers.fail_dead_trials(study, cal.worker)
        running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if not running:
            return
        if not told:
            told = True
            names = sorted({t.user_attrs.get("worker", "?") for t in running})
            cal.sink.note(f"confirmation waits for {len(running)} trial(s) on {', '.join(names)}")
        time.sleep(workers.POLL_S)


def confirmation_cost(user_attrs: dict[str, Any]) -> dict[str, Any]:
    """Runs, training steps and wall seconds the study's confirmation cells took."""
    jobs = [v for k, v in user_attrs.items()
            if (k.startswith("confirm/") or k.startswith("reference/")) and isinstance(v, dict)]
    return {"runs": len(jobs), "train_steps": sum(int(j.get("steps_run", 0)) for j in jobs),
            "wall_s": round(sum(float(j.get("wall_s", 0.0)) for j in jobs), 1)}
