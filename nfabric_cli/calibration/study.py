"""The calibration study: FP32 reference, sensitivity sweep, then the Optuna search.

Objective (one value, so pruners work): the trial's measured traffic fraction when its metric
stays within tolerance of the FP32 reference, else ``1 + traffic + excess / tolerance``, so
every out-of-tolerance trial ranks behind every admissible one (the all-fp32 profile scores
1.0; `objective.py`). Each checkpoint reports `intermediate_value`, what Hyperband and the median pruner
compare. Before a search trial trains, it is pruned if its traffic lower bound already loses to
the best admissible trial. With ``--sampler nsga2`` the study has two objectives (traffic,
metric degradation) for a Pareto front; Optuna cannot prune those.

Order of trials: the reference runs outside the study (its curve is stored in the study's user
attrs, so a resumed study reuses it); the sweep configurations (each region alone on its
cheapest route) are enqueued first and never pruned; when they are done, the configurations
they suggest are enqueued; then the sampler proposes. A configuration already completed in the
study is not trained again: its stored result is reused.

Budget: `spec.trials` is the study's total of finished trials, whoever ran them; a worker
stops when the study reaches it, so a rerun of an interrupted study finishes its budget and a
larger `--trials` extends it. Several workers may run one study at once: `workers.py` says
how they share the reference, the budget and the configurations.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import TrialState
from torch import nn

from nfabric_cli.binding.bindings import Bindings
from nfabric_cli.binding.compile import compile_profile
from nfabric_cli.binding.fingerprint import model_fingerprint, trainable_parameters
from nfabric_cli.calibration.choice import REPAIR
from nfabric_cli.calibration.codeprint import KEY, code_fingerprint, foreign_results
from nfabric_cli.calibration.confirm import confirm
from nfabric_cli.calibration.confirm import reference as confirm_reference
from nfabric_cli.calibration.objective import (
    DEFAULT_INTERMEDIATE,
    INTERMEDIATE,
    PENALTY_CAP,
    intermediate_value,
    loss_scale,
    objective_value,
    store_result,
)
from nfabric_cli.calibration.quiet import quiet_floor, spikes_of
from nfabric_cli.calibration.reduces import ddp_layouts
from nfabric_cli.calibration.repair import repair
from nfabric_cli.calibration.seeding import enqueue_seeds, sensitivity
from nfabric_cli.calibration.simulate import SimResult, check_float32, simulate_run
from nfabric_cli.calibration.space import Config, config_profile, fp32_config, suggest
from nfabric_cli.calibration.spec import NOT_IN_SEARCH_KEY, CalibrationSpec
from nfabric_cli.calibration.storage import load_or_create, open_storage
from nfabric_cli.calibration.strategy import default_study_name, make_pruner, make_sampler
from nfabric_cli.calibration.traffic import traffic_lower_bound
from nfabric_cli.calibration.warm import WarmStart, enqueue_warm
from nfabric_cli.calibration.workers import (
    Dropped,
    Worker,
    WorkerLog,
    budget_reached,
    counted,
    duplicate_of,
    fail_dead_trials,
    finished_by,
    live_workers,
    surplus,
    wait_for_same,
)
from nfabric_cli.profile.target import degradation, require_finite_reference, within_tolerance
from nfabric_cli.runtime.gate import CapacityGate
from nfabric_cli.workloads.base import Workload, find_unused, held_out_metric


class ProgressSink:
    """Receives progress; the CLI draws bars from it. Every method is optional."""

    def trial_started(self, number: int | None, kind: str, steps: int) -> None: ...

    def step(self, done: int) -> None: ...

    def trial_finished(self, record: dict[str, Any]) -> None: ...

    def note(self, message: str) -> None: ...


@dataclass
class StudyRun:
    """A finished `run_study`: the study and what this call did."""

    study: optuna.Study
    spec: CalibrationSpec
    workload: Workload
    reference: dict[str, Any]
    resumed: bool
    new_trials: int
    multi_objective: bool
    extra: dict[str, Any] = field(default_factory=dict)
    worker: Worker = field(default_factory=Worker.current)

    #: the health thresholds the study ran under: the spec's, and a spike floor its fp32
    #: references raised (`quiet.py`)
    health: dict[str, Any] = field(default_factory=dict)


class Calibrator:
    """Runs the reference, the sweep and the search for one workload and spec."""

    def __init__(
        self,
        workload: Workload,
        spec: CalibrationSpec,
        sink: ProgressSink | None = None,
        sweep: bool = True,
        traffic_bound: bool = True,
        processes: int | None = None,
        intermediate: str = DEFAULT_INTERMEDIATE,
    ) -> None:
        self.workload = workload
        self.processes = processes
        if intermediate not in INTERMEDIATE:
            raise ValueError(f"intermediate: one of {', '.join(INTERMEDIATE)}, got {intermediate!r}")
        self.intermediate = intermediate
        self.sweep = sweep
        self.traffic_bound = traffic_bound
        self.spec = spec
        self.sink = sink or ProgressSink()
        self.multi = spec.sampler == "nsga2"
        self.model = workload.build_model(spec.seed)
        check_float32([(tp.name, tp.param) for tp in trainable_parameters(self.model)])
        synced = [n for n, m in self.model.named_modules() if isinstance(m, nn.SyncBatchNorm)]
        if synced:
            self.sink.note(
                f"warning: {len(synced)} SyncBatchNorm layer(s) ({synced[0]}"
                f"{', ...' if len(synced) > 1 else ''}): the simulator normalises each rank's "
                "batch on its own statistics, as BatchNorm does; real ranks normalise over every "
                "rank's batch, so the calibrated metrics approximate theirs (docs/calibration.md, "
                "Limits)")
        self.health = dict(spec.health)
        self.bindings_for(fp32_config(spec))  # dead or missing selectors fail here, exit 2
        self.reference: dict[str, Any] = {}
        self.worker = Worker.current()
        self.log: WorkerLog | None = None
        self._layouts: tuple | None = None  # DDP's (first, rebuilt) buckets (`lower_bound`)

    # -- building blocks -------------------------------------------------------------------
    def bindings_for(self, config: Config, steps: int | None = None,
                     world_size: int | None = None) -> Bindings:
        """`config` compiled over `steps` (default the spec's) for `world_size` (default the
        search's; a confirmation cell may name another)."""
        world = world_size or self.spec.world_size
        meta: dict[str, Any] = {"world_size": world, "health": self.health}
        if self.spec.substrate:
            meta["substrate"] = self.spec.substrate
        profile = config_profile(self.spec, config, meta)
        return compile_profile(
            profile, self.model, world_size=world, bucket_cap_mb=None,
            total_steps=steps or self.spec.steps,
            find_unused_parameters=find_unused(self.workload),
        )

    def lower_bound(self, bindings: Bindings) -> float:
        """The least traffic fraction any search run of `bindings` can measure
        (`traffic_lower_bound`), on the buckets the simulator counts: DDP's, traced once."""
        if self._layouts is None:
            names = [tp.name for tp in trainable_parameters(self.model)]
            self._layouts = ddp_layouts(
                self.workload, self.model, names, self.spec.world_size, self.spec.seed,
                bindings.bucket_cap_mb, bindings.find_unused_parameters).named(names)
        gate = CapacityGate(bindings.meta.get("substrate"), self.spec.world_size)
        return traffic_lower_bound(bindings, self.spec.world_size, self.spec.steps, gate,
                                   self._layouts)

    def simulate(self, config: Config, on_checkpoint=None, bindings=None,  # noqa: ANN001
                 passive: bool = False) -> SimResult:
        return simulate_run(
            self.workload, bindings or self.bindings_for(config), self.spec.world_size,
            self.spec.steps, self.spec.seed, self.spec.checkpoints(), on_checkpoint, self.sink.step,
            processes=self.processes, passive=passive,
        )

    def _prune_by_bound(self, trial: optuna.Trial, bindings: Bindings) -> None:
        """Prune before training when even the traffic lower bound cannot make this config
        a candidate: fallbacks only move regions to fp32, so no run of it can measure less
        than the cheapest mix of its routes and fp32. A candidate is the best trial within
        tolerance, or with confirmation one of the `confirm_candidates` cheapest (if the
        cheapest fail on other seeds or lengths, the next ones must have been trained)."""
        done = trial.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        ok = sorted(t.user_attrs["traffic_fraction"] for t in done
                    if t.user_attrs.get("kind") != REPAIR  # repairs come after the search
                    and within_tolerance(t.user_attrs.get("degradation", math.inf),
                                         self.spec.tolerance)
                    and "traffic_fraction" in t.user_attrs)
        k = self.spec.confirm_candidates if self.spec.confirm_cells() else 1
        if len(ok) < k:
            return
        bound = self.lower_bound(bindings)
        if bound <= ok[k - 1] + 1e-12:
            return
        trial.set_user_attr("steps_run", 0)
        trial.set_user_attr("traffic_bound", bound)
        rank = "best admissible" if k == 1 else f"the {k} cheapest admissible, up to"
        note = f"traffic bound {bound:.4f} > {rank} {ok[k - 1]:.4f}"
        self.sink.trial_finished({"number": trial.number, "kind": trial.user_attrs.get("kind"),
                                  "state": "PRUNED", "note": note})
        raise optuna.TrialPruned(note)

    def quiet(self, reference: dict[str, Any]) -> None:
        """Raise the loss-spike floor above the loss spikes of every fp32 reference the study
        has: the search's, and each confirmation cell's (run here, before the search, if not
        stored yet; the confirmation then finds them). Every worker derives the same floor
        from the same shared references (`quiet.py`)."""
        refs = [reference, *(confirm_reference(self, cell) for cell in self.spec.confirm_cells())]
        if any("spikes" not in r for r in refs):  # stored by older code: the study keeps its floor
            self.sink.note("the loss-spike floor was not checked against the fp32 references: "
                           "some were stored before nfabric judged them (a new --study does)")
            return
        raised, note = quiet_floor([tuple(h) for r in refs for h in r["spikes"]], self.spec.health)
        if note:
            self.sink.note(note)
        self.health.update(raised)

    def reference_for(self, study: optuna.Study) -> dict[str, Any]:
        """The study's FP32 reference: stored, or run here under a claim while any other
        worker waits for it (a claim whose holder died is taken over)."""
        assert self.log is not None  # run_study sets it
        return self.log.shared(
            "reference", lambda: {**self.run_reference(), "worker": self.worker.id,
                                  KEY: code_fingerprint()},
            lambda holder: self.sink.note(f"waiting for the FP32 reference: {holder} is running it"))

    def run_reference(self) -> dict[str, Any]:
        self.sink.trial_started(None, "reference", self.spec.steps)
        # the detectors judge this healthy run (passive: nothing acts): a loss spike they
        # report raises the spike floor for the whole study (`quiet.py`)
        result = self.simulate(fp32_config(self.spec), passive=True)
        require_finite_reference(result.metric, f"(seed {self.spec.seed}, {self.spec.steps} steps)")
        untrained = held_out_metric(self.workload, self.workload.build_model(self.spec.seed))
        if degradation(result.metric, untrained, self.workload.higher_is_better) >= 0:
            self.sink.note(
                f"warning: the fp32 reference did not learn: {self.workload.metric_name} "
                f"{result.metric:.4g} after {self.spec.steps} steps, {untrained:.4g} untrained. "
                "Every route will look harmless against it: train longer (--steps) or check "
                "the workload's optimizer and data")
        ref = {"curve": [list(c) for c in result.curve], "metric": result.metric,
               "steps_run": result.steps_run, "loss_curve": [list(c) for c in result.loss_curve],
               "spikes": spikes_of(result)}
        self.sink.trial_finished({"number": None, "kind": "reference", "state": "COMPLETE",
                                  "traffic_fraction": 1.0, "metric": result.metric,
                                  "degradation": 0.0})
        return ref

    def degr(self, metric: float, step: int | None = None) -> float:
        curve = dict((int(s), m) for s, m in self.reference["curve"])
        ref = self.reference["metric"] if step is None else curve[step]
        return degradation(metric, ref, self.workload.higher_is_better)

    def slack(self, step: int) -> float:
        """What the reference itself still gains after `step`: a trial that far behind at a
        checkpoint may still finish within tolerance, so it is not penalised yet (early
        checkpoints are noisy; the last one has no slack)."""
        curve = dict((int(s), m) for s, m in self.reference["curve"])
        return max(0.0, degradation(curve[step], self.reference["metric"],
                                    self.workload.higher_is_better))

    def loss_degr(self, step: int, loss: float | None) -> float | None:
        """The degradation a trial's training loss predicts at a checkpoint: its window's mean
        loss minus the reference's over the same steps (the same batches, so data noise
        cancels), in metric units by `loss_scale`. None without a loss or a scale."""
        ref = dict((int(s), v) for s, v in self.reference.get("loss_curve", []))
        scale = loss_scale(self.reference["curve"], self.reference.get("loss_curve", []),
                           self.workload.higher_is_better)
        if loss is None or scale is None or step not in ref or not math.isfinite(loss):
            return None
        return scale * (loss - ref[step])

    def values(self, traffic: float, degr: float) -> float | tuple[float, float]:
        if self.multi:
            return (traffic, min(degr, PENALTY_CAP))
        return objective_value(traffic, degr, self.spec.tolerance)

    # -- the objective ---------------------------------------------------------------------
    def objective(self, trial: optuna.Trial) -> float | tuple[float, float]:
        study = trial.study
        self.worker.tag(trial)
        kind = trial.user_attrs.get("kind", "search")
        peers = counted(study)  # one read for the budget, twin and same-config checks
        if kind != REPAIR and surplus(peers, trial, self.spec.trials):
            self._drop(trial, kind, f"the study's budget of {self.spec.trials} trials is reached")
        twin = duplicate_of(peers, trial, kind)
        if twin is not None:
            self._drop(trial, kind, f"trial {twin} holds the same {kind} configuration")
        config = suggest(trial, self.spec)
        trial.set_user_attr("kind", kind)
        trial.set_user_attr("key", config.key())
        trial.set_user_attr("routes", config.labels(self.spec))
        self.sink.trial_started(trial.number, kind, self.spec.steps)
        if self.log is not None:
            self.log.set(f"trial {trial.number} ({kind})")
        wait_for_same(study, peers, trial, config.key(), self.worker, lambda other: self.sink.note(
            f"trial {trial.number} waits for trial {other.number} "
            f"({other.user_attrs.get('worker', 'another worker')} trains the same configuration)"))
        reused = self._reuse(trial, config)
        if reused is not None:
            return reused
        prunable = not self.multi and kind == "search" and self.spec.pruner != "none"
        bindings = self.bindings_for(config)
        if prunable and self.traffic_bound:
            self._prune_by_bound(trial, bindings)
        marks = self.spec.checkpoints()
        seen: list[list[float]] = []

        def on_checkpoint(step: int, metric: float, traffic: float, loss: float) -> bool:
            d = self.degr(metric, step)
            seen.append([step, metric, traffic, loss])  # raw: a bench replays other formulas
            trial.set_user_attr("checkpoints", seen)
            trial.set_user_attr("steps_run", step)
            trial.set_user_attr("last", {"step": step, "metric": metric, "traffic_fraction": traffic,
                                         "degradation": d})
            if self.multi:
                return True
            value = intermediate_value(traffic, d, self.spec.tolerance, self.slack(step),
                                       step == marks[-1], self.intermediate,
                                       self.loss_degr(step, loss))
            trial.report(value, marks.index(step) + 1)
            return not (prunable and trial.should_prune())

        result = self.simulate(config, on_checkpoint, bindings)
        record = self._record(trial, result)
        if result.stopped:
            self.sink.trial_finished({**record, "state": "PRUNED"})
            raise optuna.TrialPruned(f"pruned at step {result.steps_run}")
        self.sink.trial_finished({**record, "state": "COMPLETE"})
        return self.values(result.traffic_fraction, record["degradation"])

    def _drop(self, trial: optuna.Trial, kind: str, reason: str) -> None:
        """End `trial` untrained (FAIL, outside the budget) with the reason in its attrs."""
        trial.set_user_attr("dropped", reason)
        self.sink.trial_finished({"number": trial.number, "kind": kind, "state": "DROPPED",
                                  "note": reason})
        raise Dropped(reason)

    def stop_at_budget(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        if budget_reached(study, self.spec.trials, self.worker):
            study.stop()

    def _record(self, trial: optuna.Trial, result: SimResult) -> dict[str, Any]:
        d = self.degr(result.metric, result.curve[-1][0]) if result.curve else math.inf
        record = {
            "number": trial.number,
            "kind": trial.user_attrs.get("kind"),
            "traffic_fraction": result.traffic_fraction,
            "metric": result.metric,
            "degradation": d,
            "steps_run": result.steps_run,
        }
        store_result(trial, record, result)
        return record

    def _reuse(self, trial: optuna.Trial, config: Config) -> float | tuple[float, float] | None:
        """The stored result of an identical completed configuration, if any (no training)."""
        if config.all_fp32():
            attrs = {"traffic_fraction": 1.0, "metric": self.reference["metric"],
                     "degradation": 0.0, "curve": self.reference["curve"], "row_traffic": {},
                     "fallbacks": 0, "skipped_steps": 0, "reused_from": "reference",
                     KEY: self.reference.get(KEY)}
        else:
            key = config.key()
            same = [t for t in trial.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                    if t.user_attrs.get("key") == key and "traffic_fraction" in t.user_attrs]
            if not same:
                return None
            src = same[0].user_attrs
            attrs = {k: src[k] for k in ("traffic_fraction", "metric", "degradation", "curve",
                                         "checkpoints", "row_traffic", "fallbacks",
                                         "skipped_steps", KEY) if k in src}
            attrs["reused_from"] = same[0].number
        for k, v in attrs.items():
            trial.set_user_attr(k, v)
        trial.set_user_attr("steps_run", 0)
        record = {"number": trial.number, "kind": trial.user_attrs.get("kind"), "state": "COMPLETE",
                  "traffic_fraction": attrs["traffic_fraction"], "metric": attrs["metric"],
                  "degradation": attrs["degradation"], "steps_run": 0,
                  "reused_from": attrs["reused_from"]}
        self.sink.trial_finished(record)
        return self.values(attrs["traffic_fraction"], attrs["degradation"])

    # -- seeding (seeding.py) -------------------------------------------------------------
    def sensitivity(self, study: optuna.Study) -> dict[str, float] | None:
        return sensitivity(study, self.spec)

    def after_trial(self, study: optuna.Study, *_: Any) -> None:
        """Keep the queue seeded: missing sweep trials, then (once the sweep is done) seeds."""
        if self.sweep:
            enqueue_seeds(study, self.spec)


def run_study(
    workload: Workload,
    spec: CalibrationSpec,
    storage_url: str | None = None,
    study_name: str | None = None,
    sink: ProgressSink | None = None,
    callbacks: Sequence[Callable[[optuna.Study, optuna.trial.FrozenTrial], None]] = (),
    sweep: bool = True,
    traffic_bound: bool = True,
    processes: int | None = None,
    intermediate: str = DEFAULT_INTERMEDIATE,
    warm: Sequence[WarmStart] = (),
) -> StudyRun:
    """Reference, sweep and trials until the named study (created or resumed) holds
    `spec.trials` finished trials, all workers' together.

    `warm`: configurations enqueued first, unless the study holds them (`warm.py`).

    `sweep=False` leaves out the sweep and its seeds, `traffic_bound=False` the pruning of
    trials whose traffic lower bound cannot win, `intermediate` picks another checkpoint
    formula from `INTERMEDIATE` (all three for benchmarks). `processes`: see `simulate_run`."""
    calibrator = Calibrator(workload, spec, sink, sweep, traffic_bound, processes, intermediate)
    storage = open_storage(storage_url)
    name = study_name or default_study_name(spec, workload.name)
    spec_dict = {k: v for k, v in spec.to_dict().items() if k not in NOT_IN_SEARCH_KEY}
    # what the study's stored results were trained on, besides the spec: the model and its
    # data (a plugin edited between two runs keeps its name; written before `search_key`,
    # which a worker that joins waits for)
    attrs = {"workload": workload.name, "model": model_fingerprint(calibrator.model),
             "data": workload.data_fingerprint(), "search_key": spec.search_key(),
             "spec": spec_dict}
    n_obj = 2 if calibrator.multi else 1
    study, resumed = load_or_create(
        storage, name, n_obj, optuna.samplers.RandomSampler(), make_pruner(spec), attrs
    )
    worker = calibrator.worker
    log = calibrator.log = WorkerLog(study, worker, spec.trials)
    with log.running():
        others = [w for w in live_workers(study.user_attrs, worker)
                  if w["live"] and w["worker"] != worker.id]
        offset = len(study.get_trials(deepcopy=False)) + (worker.pid if others else 0)
        study.sampler = make_sampler(spec, offset)
        fail_dead_trials(study, worker)  # a killed run's trial: failed, its sweep re-queued
        calibrator.reference = reference = calibrator.reference_for(study)
        calibrator.quiet(reference)  # before any trial: the floor holds for all of them
        if resumed and (foreign := foreign_results(study)):
            calibrator.sink.note(
                f"study {name}: {len(foreign)} stored result(s) ({', '.join(foreign[:4])}"
                f"{', ...' if len(foreign) > 4 else ''}) were trained by other nfabric code; "
                "a profile from this study records their metrics, which this code may not "
                "replay: a new --study retrains everything")
        before = finished_by(study, worker)
        full = budget_reached(study, spec.trials, worker)
        for note in enqueue_warm(study, spec, warm, study.get_trials(deepcopy=False), full):
            calibrator.sink.note(note)
        calibrator.after_trial(study)
        if full:
            calibrator.sink.note(f"the study holds its budget of {spec.trials} trials")
        else:
            log.set("searching")
            study.optimize(
                calibrator.objective,
                n_trials=None,
                catch=(Dropped,),
                callbacks=[calibrator.after_trial, calibrator.stop_at_budget, *callbacks],
                gc_after_trial=False,
            )
        confirm(calibrator, study)
        # no candidate held: repairs (`repair.py`), each round confirmed in turn
        while repair(calibrator, study, lambda: study.optimize(
                calibrator.objective, n_trials=1, catch=(Dropped,), callbacks=list(callbacks),
                gc_after_trial=False)):
            confirm(calibrator, study)
        new = finished_by(study, worker) - before
        log.set("finishing")
    return StudyRun(study, spec, workload, reference, resumed, new, calibrator.multi,
                    {"sensitivity": calibrator.sensitivity(study) or {}}, worker,
                    dict(calibrator.health))
