"""Simulated data-parallel training: W workers, one model, exactly what W DDP ranks with the
fabric hook would compute.

Per step: the plan (route per parameter: the profile's, or fp32 while the health monitor
holds its region or the capacity gate refuses its bucket; the gate's static verdicts, from
the profile's substrate, on DDP's real buckets of that step); each simulated rank's gradient
on its own batch (`train_batch(step, rank, W, seed)`), every parameter's aggregate under the
plan with per-rank error feedback (`ranks.py`, `aggregate.py`: in one process or spread over
forked ones; float routes add the ranks in the order gloo does in the real run's all-reduce of that
step's DDP bucket or float group, `reduces.py`); the health statistics gathered the way the
hook agrees them (per-region gradient norm = sqrt of the summed squared local norms, sign
agreement from the routes' `agree_sum / agree_n`, loss = mean of the ranks' losses, any
non-finite value marks the step) and the aggregate's norms go to the same `StepController`
the hook drives, whose decision (skip a non-finite step, scale down a held scope's update) is
applied before the optimizer and scheduler step; it also decides the next steps' plans.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from nfabric_cli.binding.bindings import Bindings
from nfabric_cli.binding.fingerprint import trainable_parameters
from nfabric_cli.calibration.aggregate import StepRoutes
from nfabric_cli.calibration.cpus import one_thread
from nfabric_cli.calibration.ranks import RanksStep, SimulatedRanks
from nfabric_cli.calibration.reduces import ReduceOrders, ddp_layouts
from nfabric_cli.calibration.traffic import StepBytes, TrafficTally, gated, step_bytes
from nfabric_cli.errors import InputError
from nfabric_cli.interrupt import deferred_sigint
from nfabric_cli.routes.spec import FP32, RouteSpec
from nfabric_cli.runtime.controller import StepController, StepDecision
from nfabric_cli.runtime.inject import Injection
from nfabric_cli.workloads.base import Workload, held_out_metric

#: Called after each checkpoint with (step, metric, projected traffic fraction of the whole
#: run: measured so far plus the profile's planned routes for the steps left, mean training
#: loss over the steps since the previous checkpoint); False stops it.
CheckpointFn = Callable[[int, float, float, float], bool]
#: a cached step plan: (phase, the scopes held on fp32, whether DDP has rebuilt its buckets,
#: whether the model gate sends the step as plain DDP's, whether it is a plain phase's with no
#: ramp open)
_PlanKey = tuple[str, frozenset[str], bool, bool, bool]


@dataclass
class SimResult:
    """What one simulated run measured."""

    curve: list[tuple[int, float]]  # (steps done, metric) at each checkpoint reached
    steps_run: int
    traffic_fraction: float
    row_traffic: dict[tuple[str, str], float]
    events: list[dict[str, Any]] = field(default_factory=list)
    skipped_steps: list[int] = field(default_factory=list)
    stopped: bool = False  # the checkpoint callback asked to stop (a pruned trial)
    model: torch.nn.Module | None = field(default=None, repr=False)  # the trained model
    #: (steps done, mean training loss of the ranks over the steps since the previous
    #: checkpoint) at each checkpoint reached: paired with the reference's (same batches), a
    #: smoother early signal than the metric
    loss_curve: list[tuple[int, float]] = field(default_factory=list)
    #: (step, scope, reason) of every detection the health monitor's detectors gave (trip
    #: signals and blow-ups guarded in place), acted on or not (`HealthMonitor.detections`)
    detections: list[tuple[int, str, str]] = field(default_factory=list)
    #: per step: the ranks' mean training loss, as the health monitor saw it
    losses: list[float] = field(default_factory=list)
    #: the monitor's early loss: the median of its first `window` healthy losses (None: none)
    early_loss: float | None = None

    @property
    def metric(self) -> float:
        return self.curve[-1][1] if self.curve else float("nan")


class SimulatedDDP:
    """The model, optimizer, per-rank error feedback and health monitor of one simulated run."""

    def __init__(
        self,
        workload: Workload,
        bindings: Bindings,
        world_size: int,
        total_steps: int,
        seed: int,
        monitor: bool = True,
        processes: int | None = None,
        injections: Sequence[Injection] = (),
        passive: bool = False,
    ) -> None:
        self.workload = workload
        self.bindings = bindings
        self.world_size = world_size
        self.total_steps = max(1, int(total_steps))
        self.seed = seed
        self.model = workload.build_model(seed)
        self.model.train()
        self.params = [(tp.name, tp.param) for tp in trainable_parameters(self.model)]
        check_float32(self.params)
        self.optimizer, self.scheduler = workload.make_optimizer(
            self.model.parameters(), self.total_steps
        )
        self.events: list[dict[str, Any]] = []
        self.controller = StepController(bindings, self.total_steps, world_size,
                                         self.events.append, monitor=monitor,
                                         passive=passive)
        self.scopes = self.controller.scopes
        self.monitor, self.gate = self.controller.monitor, self.controller.gate
        self.skipped_steps = self.controller.skipped_steps
        self.losses: list[float] = []  # per step: the ranks' mean loss (NaN when none finite)
        self.tally = TrafficTally()
        self._bytes_cache: dict[_PlanKey, StepBytes] = {}
        self._planned: dict[tuple[str, bool], StepBytes] = {}
        self._plans: dict[_PlanKey, StepRoutes] = {}
        self._refused: dict[_PlanKey, frozenset[str]] = {}  # regions a plan's gate refused
        self.names = [n for n, _ in self.params]
        groups = [tuple(sorted((ph, b.regions[ph], b.routes[ph].label()) for ph in b.routes))
                  for b in (bindings.params[n] for n in self.names)]
        # DDP's real buckets (one per dtype at the first step, rebuilt after it): the gate
        # prices them, the bytes count them and, from three ranks on, gloo's ring adds an
        # element's values in an order set by its place in them (at two it is rank order)
        layouts = ddp_layouts(workload, self.model, self.names, world_size, seed,
                              bindings.bucket_cap_mb, bindings.find_unused_parameters)
        self.buckets = layouts.named(self.names)
        # per (phase, rebuilt): the buckets it routes anything low-bit in (`gated_off`)
        self._lowbit_buckets = {(p.name, rebuilt): bindings.lowbit_buckets(p.name, buckets)
                                for p in bindings.phases
                                for rebuilt, buckets in zip((False, True), self.buckets,
                                                            strict=True)}
        orders = None
        if world_size > 2:
            orders = ReduceOrders(layouts, [p.numel() for _, p in self.params], world_size)
        self.ranks = SimulatedRanks(
            workload, self.model, [p for _, p in self.params], self.names, world_size, seed,
            processes, groups, self.optimizer, self.scheduler, injections, orders,
        )

    def close(self) -> None:
        """Stop the processes computing the ranks' gradients, if any."""
        self.ranks.close()

    # -- the hook's decisions ------------------------------------------------------------------
    @property
    def step(self) -> int:
        return self.controller.step

    @property
    def phase(self):  # noqa: ANN201 - a Phase
        return self.controller.phase

    def effective(self, name: str) -> RouteSpec:
        return self.controller.effective(name)

    def projected_fraction(self) -> float:
        """Traffic fraction of the whole run if the steps left follow the profile (no further
        fallbacks): what a checkpoint can best say about the final traffic. Equals the
        measured fraction once every step has run."""
        sent, ref = self.tally.sent, self.tally.fp32
        for step in range(self.step, self.total_steps):
            key = (self.bindings.phase_at(step, self.total_steps).name, step > 0)
            if key not in self._planned:
                phase, buckets = key[0], self.buckets[key[1]]
                routes = {n: b.routes[phase] for n, b in self.bindings.params.items()}
                planned = gated(self.bindings, phase, routes.__getitem__, self.gate, buckets)
                self._planned[key] = step_bytes(self.bindings, self.world_size, phase, planned,
                                                buckets)
            sent += self._planned[key].sent
            ref += self._planned[key].fp32
        return sent / ref if ref else 1.0

    # -- one step --------------------------------------------------------------------------------
    def _plan(self, gated_off: bool) -> tuple[StepRoutes, _PlanKey]:
        """This step's routes and scopes per parameter, and the key they are cached under (the
        gate's verdicts are static here: no timings; they are taken on the step's buckets). A
        gated-off step is all fp32, as the hook sends it, whatever the gate would say of this
        step's buckets (it priced the buckets of the last step through the worker)."""
        phase = self.phase.name
        key = (phase, self.controller.forced(), self.step > 0, gated_off, self.controller.plain)
        if key not in self._plans:
            buckets = self.buckets[key[2]]
            by_name = {n: self.effective(n) for n in self.names}
            routes = (_all_fp32 if gated_off else
                      gated(self.bindings, phase, by_name.__getitem__, self.gate, buckets))
            self._plans[key] = StepRoutes(
                tuple(self.bindings.params[n].regions[phase] for n in self.names),
                tuple(routes(n) for n in self.names),
                plain=self.controller.plain,
            )
            self._refused[key] = frozenset(  # routed low-bit, sent fp32 (the gate refused)
                self.bindings.params[n].regions[phase] for n in self.names
                if by_name[n].lowbit and not routes(n).lowbit)
            self._bytes_cache[key] = step_bytes(self.bindings, self.world_size, phase, routes,
                                                buckets)
        return self._plans[key], key

    def train_step(self) -> None:
        step = self.step
        # a step the model gate sends all fp32, as the hook sends it (plain DDP's path, no
        # statistics): zeroed when the summed gradients are not finite, its ramped and held
        # scopes held while the guard has any (`controller.direct`), nothing else judged
        gated_off = self.controller.gated_off()
        plan, key = self._plan(gated_off)
        self.tally.add(self._bytes_cache[key])
        # (the hook tells it before judging the step)
        self.controller.refused(step, None if gated_off else self._refused[key])

        def decide(done: RanksStep) -> StepDecision:
            finite_losses = [v for v in done.losses if math.isfinite(v)]
            loss_mean = sum(finite_losses) / len(done.losses)
            self.losses.append(loss_mean if finite_losses else math.nan)
            if gated_off:
                finite = all(math.isfinite(n) for norms in done.norms for n in norms)
                updates = dict(zip(self.names, done.update_norms, strict=True)) if (
                    done.update_norms is not None) else None
                return self.controller.direct(step, finite, updates)
            # Health statistics, as the hook measures them before any encoding (norms are
            # taken before a rank's non-finite values are zeroed: a NaN norm never votes).
            norm2: dict[str, float] = {}
            for rank_norms in done.norms:
                for region, norm in zip(plan.regions, rank_norms, strict=True):
                    if math.isfinite(norm):
                        norm2[region] = norm2.get(region, 0.0) + norm * norm
            agree = done.agreement
            agreement = {s: agree[s][0] / agree[s][1] for s in self.scopes
                         if agree.get(s, (0, 0))[1] > 0}
            norms = {s: math.sqrt(norm2.get(s, 0.0)) for s in self.scopes}
            updates = dict(zip(self.names, done.update_norms or (), strict=False))
            return self.controller.decide(step, loss_mean, done.nonfinite, norms, agreement,
                                          updates)

        # gradients, aggregate, decision, optimizer step (the aggregate's norms only feed the
        # update guard, so a run without the monitor does not measure them)
        measure = self.controller.acting and not self.controller.plain and (
            not gated_off or self.controller.guarding)
        out = self.ranks.step(step, plan, decide, measure=measure,
                              last=step == self.total_steps - 1)
        if not self.bindings.find_unused_parameters:
            self._check_used(step, out.used)
        if not gated_off:  # the buckets it laid out, as the hook records its worker steps'
            self.controller.priced(self._lowbit_buckets[key[0], key[2]])
        self.controller.advance(step)

    def _check_used(self, step: int, used: torch.Tensor) -> None:
        """A parameter some rank's graph left out (`used`: the step's flags, per rank and
        parameter) fails real DDP at the next step unless it finds unused parameters: say so
        here instead of simulating a run that cannot be had."""
        unused = torch.nonzero(~used).tolist()
        if unused:
            rank, i = unused[0]
            raise InputError(
                f"parameter {self.names[i]} got no gradient on rank {rank} at step {step}: DDP "
                "refuses that unless it finds unused parameters; declare "
                "find_unused_parameters = True on the workload (docs/workloads.md)")

    def evaluate(self) -> float:
        return held_out_metric(self.workload, self.model)


def _all_fp32(name: str) -> RouteSpec:
    return FP32


def check_float32(params: list[tuple[str, torch.Tensor]]) -> None:
    """The simulator computes in float32 (its gradient buffers, its aggregates); a bf16 or
    fp16 model is trained by DDP in its own dtype, which it cannot replay."""
    other = [(n, p.dtype) for n, p in params if p.dtype != torch.float32]
    if other:
        shown = ", ".join(f"{n} ({str(d).removeprefix('torch.')})" for n, d in other[:3])
        more = f" (+{len(other) - 3} more)" if len(other) > 3 else ""
        raise InputError(
            f"calibration simulates float32 models; {len(other)} parameter(s) are not: {shown}"
            f"{more}. Calibrate a float32 build of the model (build_model without the cast), "
            "then compile-profile, attach and validate bind the profile to the model as you "
            "train it, in any dtype (docs/calibration.md, Limits)")


def simulate_run(
    workload: Workload,
    bindings: Bindings,
    world_size: int,
    steps: int,
    seed: int,
    checkpoints: tuple[int, ...] = (),
    on_checkpoint: CheckpointFn | None = None,
    on_step: Callable[[int], None] | None = None,
    monitor: bool = True,
    processes: int | None = None,
    injections: Sequence[Injection] = (),
    passive: bool = False,
) -> SimResult:
    """Train `steps` simulated DDP steps; evaluate after each step in `checkpoints`.

    The global RNG is forked and seeded, so a run depends only on its arguments (not on
    `processes`, the number of processes computing the ranks' gradients; default one per
    CPU, at most W). `injections`: nan / spike faults, as `validate --inject` puts them.
    `passive` (benchmarks): the monitor's detectors judge every step and nothing acts on
    them (`SimResult.detections` lists what they said).
    """
    marks = set(checkpoints)
    curve: list[tuple[int, float]] = []
    loss_curve: list[tuple[int, float]] = []
    stopped = False
    with torch.random.fork_rng(devices=[]), one_thread(), deferred_sigint() as interrupt:
        torch.manual_seed(seed)
        sim = SimulatedDDP(workload, bindings, world_size, steps, seed, monitor, processes,
                           injections, passive)
        try:
            while sim.step < steps:
                interrupt.check()  # Ctrl-C stops the run here, between steps
                sim.train_step()
                if on_step is not None:
                    on_step(sim.step)
                if sim.step in marks:
                    metric = sim.evaluate()
                    curve.append((sim.step, metric))
                    since = curve[-2][0] if len(curve) > 1 else 0
                    window = sim.losses[since:sim.step]
                    loss_curve.append((sim.step, sum(window) / len(window)))
                    if on_checkpoint is not None and not on_checkpoint(
                        sim.step, metric, sim.projected_fraction(), loss_curve[-1][1]
                    ):
                        stopped = sim.step < steps
                        break
        finally:
            sim.close()
    return SimResult(
        curve=curve,
        steps_run=sim.step,
        traffic_fraction=sim.tally.fraction(),
        row_traffic=sim.tally.row_fractions(),
        events=sim.events,
        skipped_steps=sim.skipped_steps,
        stopped=stopped,
        model=sim.model,
        loss_curve=loss_curve,
        detections=list(sim.monitor.detections),
        losses=list(sim.losses),
        early_loss=sim.monitor.early_loss(),
    )
