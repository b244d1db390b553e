"""`StepController`: every per-step decision of a run, in one place for the hook and the simulator.

The DDP hook (`runtime/state.py`) and the calibration simulator (`calibration/simulate.py`)
both drive one of these, so calibration predicts exactly what the runtime decides:

- `effective(name)`: a parameter's route now (the profile's, or fp32 while the health monitor
  holds its region); the capacity gate (`gate`) then judges the bucket;
- `decide(...)`, once per step on the agreed statistics and the reduced update's norms,
  *before* the update reaches the optimizer: the monitor's check, the update guard's
  scale-downs (`runtime/guard.py`) and whether the step is skipped (non-finite);
- `advance(step)`: count the step and enter the next phase;
- `gated_off()` / `priced(keys)`: whether the model gate refuses every bucket the phase's
  profile routes anything low-bit in (as the last step through the hook's worker laid them
  out), so the step goes out as plain DDP's; `direct(step, finite, ...)` is that step's whole
  decision (neutralised when its reduced result is not finite, ramped scopes held);
- `refused(step, scopes)`: the scopes the capacity gate sent on fp32 this step (see below).

A scope whose route changes at a phase boundary is *ramped* (with the monitor acting): the
update guard holds its update near the magnitude it had and lets it rise from there until a
window of steps caps nothing (`runtime/guard.py`), so a scheduled change from `sign` to fp32
cannot deliver the raw gradient at once. A plain phase entered with a ramp open runs judged,
as a low-bit one, until the ramp ends. The capacity gate's switches ramp too (`refused`): a step
it sends on fp32 (the measured gate's fp32 probe steps and decisions, a model gate's refusal or
revocation) after low-bit ones, and back; a step sent as plain DDP's then measures its update
norms for `direct` while the guard has something to hold (`guarding`).

A phase that routes every parameter on fp32 is plain DDP (`plain_phases`): nothing is judged,
held or skipped on its steps, whichever path the hook sends them by (`FabricState._fp32_direct`,
or its worker when a trace is recorded; while a ramp is open it is judged, above), and the
simulator, driving the same rule, trains such
a phase (a calibration's fp32 reference is one) as `validate`'s fp32 arm trains. `passive`
(benchmarks only) runs the detectors on every step and acts on nothing: what they would say
of a plain run.

Events are dicts (step, scope, from, to, reason) handed to `log` in the order they happen.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from nfabric_cli.binding.bindings import Bindings
from nfabric_cli.errors import InputError
from nfabric_cli.profile.phases import Phase
from nfabric_cli.routes import FP32
from nfabric_cli.routes.spec import RouteSpec
from nfabric_cli.runtime.gate import CapacityGate
from nfabric_cli.runtime.guard import Held, UpdateGuard
from nfabric_cli.runtime.health import (
    ALL,
    BLOWUP,
    HealthMonitor,
    HealthThresholds,
    StepStats,
    absent_scopes,
)

SKIP_REASON = "nonfinite gradient or loss: update neutralised on every rank"
SCALER_REASON = ("nonfinite gradient or loss: passed on not finite, for the loss scaler to skip "
                 "the step and lower its scale")
#: `nonfinite` modes: "zero" the step's update on every rank (the default: a NaN update would
#: wreck the model) or "pass" it on not finite, as plain DDP does, for a loss scaler (AMP's
#: GradScaler), which skips such a step and lowers its scale; it never sees a zeroed one.
NONFINITE_MODES = ("zero", "pass")


def fallbacks(events: list[dict[str, Any]]) -> int:
    """Switches to fp32 in an event log: health trips and gate revocations (a scope pinned
    while already on fp32 is not another switch)."""
    return sum(1 for e in events if e.get("to") == "fp32" and e.get("from") != "fp32")


@dataclass(frozen=True)
class StepDecision:
    """What happens to one step's reduced update before the optimizer sees it."""

    skip: bool  # neutralise it on every rank (non-finite): zeroed, or not finite for a scaler
    scales: dict[str, float] = field(default_factory=dict)  # scope -> factor (< 1)
    # scope -> k: each element of a parameter's update clipped to k x its mean |update|, before
    # the scale (a ramp to a full-precision wire: `StepController._ramp`)
    clips: dict[str, float] = field(default_factory=dict)

    def apply_(self, scope: str, update: torch.Tensor, full: bool) -> bool:
        """Clip (where the parameter went on a full-precision wire this step: `full`), then
        scale, one parameter's reduced `update` of `scope` in place, as its ramp and hold say;
        whether anything was done (its error-feedback residual then goes). On the update's
        device, no host read: the hook and the simulator take the same bits."""
        k = self.clips.get(scope) if full else None
        factor = self.scales.get(scope)
        if k is not None:
            bound = mean_abs(update) * k
            update.clamp_min_(-bound).clamp_max_(bound)  # (clamp_ with tensor ends: 1.5x slower)
        if factor is not None:
            update.mul_(factor)
        return k is not None or factor is not None


#: `mean_abs`'s chunk on CPU (elements): a reused float32 buffer that stays in cache, and
#: no larger than ATen's parallel grain (32768), so each chunk's sum is serial: the same bits
#: at any intra-op thread count (the hook's, the simulator's one)
ABS_CHUNK = 1 << 15


def mean_abs(x: torch.Tensor) -> torch.Tensor:
    """Mean |x| as a 0-d float32 tensor on x's device, no host read. On CPU in chunks through
    one small float32 buffer (a half-precision update summed in float32 too): ``x.abs()``
    allocates (and faults in) a full-size temporary; with it, and ``clamp_`` with tensor ends,
    a ramp's clip took 2-3x as long on a 47M-parameter model (`bench.ramp_cost`)."""
    flat, n = x.reshape(-1), max(x.numel(), 1)
    if x.device.type != "cpu":
        return flat.abs().sum(dtype=torch.float32) / n
    buf = torch.empty(min(flat.numel(), ABS_CHUNK), dtype=torch.float32, device=x.device)
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    for part in flat.split(ABS_CHUNK):
        chunk = buf[: part.numel()]
        if part.dtype == torch.float32:
            torch.abs(part, out=chunk)
        else:  # (abs cannot write a half tensor's result to a float32 one)
            chunk.copy_(part).abs_()
        total += chunk.sum()
    return total / n


def check_options(monitor: Any, gate: Any, nonfinite: Any) -> None:
    """InputError (one line) for an attach option the controller cannot take."""
    if nonfinite not in NONFINITE_MODES:
        raise InputError(f"nonfinite: one of {', '.join(map(repr, NONFINITE_MODES))}, "
                         f"got {nonfinite!r}")
    if not isinstance(monitor, bool):  # ("no" is truthy: it would turn the monitor on)
        raise InputError(f"monitor: True or False, got {monitor!r}")
    if gate is not True and gate is not False and gate != "measure":
        raise InputError(f"gate: True, False or 'measure', got {gate!r}")


class StepController:
    """Phase, health monitor, update guard and capacity gate of one run (see module doc)."""

    def __init__(
        self,
        bindings: Bindings,
        total_steps: int,
        world_size: int,
        log: Callable[[dict[str, Any]], None],
        *,
        monitor: bool = True,
        gate: bool | str = True,
        passive: bool = False,
        nonfinite: str = "zero",
    ) -> None:
        check_options(monitor, gate, nonfinite)
        self.nonfinite = nonfinite
        self.bindings = bindings
        self.total_steps = max(1, int(total_steps))
        self.log = log
        self.scopes = sorted({r for b in bindings.params.values() for r in b.regions.values()})
        thresholds = HealthThresholds.from_profile(bindings.meta)
        self.monitor_enabled = monitor
        self.passive = passive
        # phases that are plain DDP (see the module doc): a property of the routes alone, so a
        # recorded trace (the hook's worker path) trains them as an untraced run does
        self.plain_phases = frozenset(
            p.name for p in bindings.phases
            if all(b.routes[p.name].name == "fp32" for b in bindings.params.values()))
        # per phase, the regions it routes low-bit: a step where the monitor holds them all
        # sends nothing low-bit (`all_held`)
        self._lowbit_regions = {
            p.name: frozenset(b.regions[p.name] for b in bindings.params.values()
                              if b.routes[p.name].lowbit) for p in bindings.phases}
        self.monitor = HealthMonitor(self.scopes, thresholds)
        self.guard = UpdateGuard(self.scopes, thresholds.window, thresholds.min_history,
                                 thresholds.update_cap, thresholds.blowup_cap)
        self.gate = CapacityGate(bindings.meta.get("substrate"), world_size, enabled=bool(gate),
                                 measure=gate == "measure")
        self.step = 0
        self.skipped_steps: list[int] = []
        self.held: list[tuple[int, str, float]] = []  # (step, scope, factor) per scale-down
        self._holding: set[str] = set()  # held scopes whose hold has been scaled down
        # scopes whose route (or the gate's wire) changed, until their ramp closes: [step it
        # began, the change in words, steps it capped, steps in a row it capped none, whether
        # it clips (to a full-precision wire), whether its first event was logged]
        self._ramps: dict[str, list[Any]] = {}
        # the last step's scopes routed low-bit (not held) and those of them the gate sent on
        # fp32 (`refused`): a change opens a ramp; None before the first step
        self._wire: tuple[frozenset[str], frozenset[str]] | None = None
        # whether the last step went out whole on fp32 (plain DDP's path): its scopes routed
        # low-bit sent nothing low-bit (with some buckets refused, a scope may have sent part)
        self._wire_whole = False
        # per phase, the gate keys of the buckets with a low-bit route in its profile, as its
        # last step through the hook's worker laid them out
        self._priced: dict[str, tuple[tuple, ...]] = {}
        self.phase = bindings.phase_at(0, self.total_steps)
        self._enter_phase(self.phase, 0)

    # -- routes ------------------------------------------------------------------------------
    def effective(self, name: str) -> RouteSpec:
        """`name`'s route now: the profile's, or fp32 while the monitor holds its region."""
        pb = self.bindings.params[name]
        spec = pb.routes[self.phase.name]
        if spec.lowbit and self.acting and self.monitor.forced_fp32(pb.regions[self.phase.name]):
            return FP32
        return spec

    @property
    def plain(self) -> bool:
        """Whether this step is plain DDP's: its phase routes every parameter on fp32 and no
        route change is still ramping."""
        return self.phase.name in self.plain_phases and not self._ramps

    @property
    def acting(self) -> bool:
        """Whether the monitor's verdicts change routes and updates (on, and not passive)."""
        return self.monitor_enabled and not self.passive

    def forced(self) -> frozenset[str]:
        """The scopes the monitor holds on fp32 now."""
        if not self.acting:
            return frozenset()
        return frozenset(s for s in self.scopes if self.monitor.forced_fp32(s))

    def all_held(self) -> bool:
        """Whether nothing is on a low-bit route now: the monitor holds every region the
        phase routes low-bit (or the phase routes none)."""
        return self._lowbit_regions[self.phase.name] <= self.forced()

    def region(self, name: str) -> str:
        return self.bindings.params[name].regions[self.phase.name]

    # -- the step ----------------------------------------------------------------------------
    def decide(
        self,
        step: int,
        loss: float | None,
        nonfinite: bool,
        grad_norms: Mapping[str, float],
        agreement: Mapping[str, float],
        update_norms: Mapping[str, float],
    ) -> StepDecision:
        """Judge step `step` from agreed numbers: the ranks' mean loss, whether anything was
        not finite, each scope's gradient norm (before the reduce) and sign agreement, and
        each parameter's norm of the reduced update (identical on every rank). A step of a
        plain phase is plain DDP's: nothing is judged, held or skipped (unless passive).
        A non-finite update from finite gradients is a non-finite step too: an `fp16` wire
        overflows past 65504 (as PyTorch's fp16_compress_hook does), and its infinity must
        not reach the optimizer (seen where update norms are taken: with the monitor on)."""
        if self.plain and not self.passive:
            return StepDecision(False)
        nonfinite = nonfinite or not all(math.isfinite(v) for v in update_norms.values())
        if nonfinite and self.nonfinite == "pass" and not self.passive:
            # a loss scaler's overflow: the scaler's to skip, and expected (a too-large scale), so
            # nothing is judged or held (an fp16 wire's overflow shrinks with the scale too)
            self.record_skip(step)
            return StepDecision(True)
        if self.monitor_enabled:
            # Held: routed on fp32 for this step (held before it), tripped by it, or any scope
            # a detector fired on (one on an fp32 route too: its raw spike must not pass).
            routed_fp32 = self.forced()
            seen = len(self.monitor.detections)
            stats = StepStats(step, loss, nonfinite, dict(grad_norms), dict(agreement))
            for ev in self.monitor.check(stats):
                self.log(ev.to_dict())
            why = {scope: reason for _, scope, reason in self.monitor.detections[seen:]}
            if ALL in why:
                why = {**dict.fromkeys(self.scopes, why.pop(ALL)), **why}
            absent = absent_scopes(grad_norms)  # not judged, and nothing to hold
            updates = {n: v for n, v in update_norms.items() if self.region(n) not in absent}
            held, clips = ([], {}) if self.passive else self._guard(
                step, updates, nonfinite, routed_fp32 | self.forced() | set(why), why)
        else:
            held, clips = [], {}
        skip = nonfinite and not self.passive
        if skip:
            self.record_skip(step)
        return StepDecision(skip, {h.scope: h.factor for h in held}, clips)

    def record_skip(self, step: int) -> None:
        """Step `step`'s update is neutralised on every rank (non-finite)."""
        self.skipped_steps.append(step)
        self.log({"step": step, "scope": "all", "from": "update", "to": "skipped",
                  "reason": SCALER_REASON if self.nonfinite == "pass" else SKIP_REASON})

    def priced(self, keys: list[tuple]) -> None:
        """The gate keys of a worker step's buckets with a low-bit route in the phase's
        profile, held on fp32 or not (for `gated_off`)."""
        self._priced[self.phase.name] = tuple(keys)

    def gated_off(self) -> bool:
        """Whether this step goes out as plain DDP's: the model gate refuses (a cached or
        revoked verdict) every bucket the phase's profile routes anything low-bit in, so
        nothing low-bit is sent and there is nothing to decide. The monitor sees no such step;
        a non-finite one is still neutralised (`direct`). A bucket held on fp32 by the monitor
        counts too: one the gate has not priced (or admitted) keeps the steps on the worker,
        where the monitor can re-admit it."""
        keys = self._priced.get(self.phase.name)
        return bool(keys) and all(self.gate.refuses(k) for k in keys)

    @property
    def guarding(self) -> bool:
        """Whether the update guard has something to hold (monitor acting): a ramp is open or
        the monitor holds a scope. A step sent as plain DDP's in a low-bit phase then reads
        its update norms for `direct` (none are taken otherwise)."""
        return self.acting and bool(self._ramps or self.forced())

    def refused(self, step: int, scopes: Iterable[str] | None = None) -> None:
        """The scopes routed low-bit that step `step` sent on fp32 in some bucket the capacity
        gate refused (None: the whole step, sent as plain DDP's), told before the step is
        judged. A scope the phase routes low-bit, not held by the monitor on this step or the
        last one, whose wire the gate changed between them (a measured gate's fp32 probe step
        or decision, a model gate's refusal or revocation, and back) opens a ramp, as a phase
        boundary's route change does: seen on real ranks, `vision.v13` at 1000 Mbit/s, seed
        18, the measured gate's re-check probed fp32 in 4-step blocks at step 134 and the
        loss spiked 33.5x at step 144."""
        if not self.acting:  # (nothing ramps)
            return
        routed = self._lowbit_regions[self.phase.name] - self.forced()
        gated = routed if scopes is None else routed & frozenset(scopes)
        last, self._wire = self._wire, (routed, gated)
        self._wire_whole = scopes is None
        if last is None:
            return
        was_routed, was_gated = last
        for scope in sorted((gated ^ was_gated) & routed & was_routed):
            ramp = self._ramps.get(scope)
            if ramp is not None and ramp[0] == step:  # a phase's route change this step
                if scope in gated:  # to a full-precision wire after all: it clips
                    self._open_ramp(scope, step, f"{ramp[1]}, sent on fp32 by the capacity "
                                                 "gate", True)
                continue
            change = ("low-bit -> fp32 (the capacity gate)" if scope in gated
                      else "fp32 -> low-bit (the capacity gate admits it again)")
            self._open_ramp(scope, step, change, scope in gated)

    def direct(self, step: int, finite: bool,
               update_norms: Mapping[str, float] | None = None) -> StepDecision:
        """A step sent as plain DDP's in a low-bit phase (gated off): neutralised on every rank
        when its reduced gradients (or update norms) are not finite (a sum carries any rank's
        NaN or inf to every rank). While the guard has something to hold (`guarding`: the
        caller then passes the update norms, by parameter) the ramped scopes and the
        monitor's held ones are held, and ramps to fp32 clipped, as on the worker path;
        nothing else is judged: the monitor sees no loss on these steps. A scope whose updates
        are all zero (no gradient this step) is not judged."""
        finite = finite and all(math.isfinite(v) for v in (update_norms or {}).values())
        if not finite:
            self.record_skip(step)
            return StepDecision(True)
        if not update_norms or not self.guarding:
            return StepDecision(False)
        live = {self.region(n) for n, v in update_norms.items() if v > 0}
        updates = {n: v for n, v in update_norms.items() if self.region(n) in live}
        held, clips = self._guard(step, updates, False, self.forced(), {})
        return StepDecision(False, {h.scope: h.factor for h in held}, clips)

    def _guard(self, step: int, update_norms: Mapping[str, float], skipped: bool,
               scopes: frozenset[str], why: Mapping[str, str],
               ) -> tuple[list[Held], dict[str, float]]:
        """The step's scale-downs (held and ramped scopes) and its ramps' clips."""
        sums: dict[str, float] = {}
        for name in self.bindings.params:  # a fixed order: the same float sums everywhere
            if name in update_norms:
                scope = self.region(name)
                sums[scope] = sums.get(scope, 0.0) + update_norms[name] ** 2
        norms = {s: math.sqrt(v) for s, v in sums.items()}
        blowups = [s for s, reason in why.items() if reason.startswith(BLOWUP)]
        held = self.guard.judge(norms, scopes, skipped, blowups, self._ramps)
        clips: dict[str, float] = {}
        if not skipped:
            clips = self._clips(step)
            self._ramp(step, {h.scope: h for h in held if h.scope not in scopes}, clips)
        self._holding &= scopes  # a scope released by the monitor logs its next hold again
        for h in held:
            self.held.append((step, h.scope, h.factor))
            if h.scope not in scopes:  # a ramp's (its events are `_ramp`'s)
                continue
            if h.scope not in self._holding:  # one event per hold: its first scale-down
                self._holding.add(h.scope)
                kept = "" if self.monitor.forced_fp32(h.scope) else ", route kept"
                cause = f" for {why[h.scope]}{kept}" if h.scope in why else ""
                self.log({"step": step, "scope": h.scope, "from": "update", "to": "held",
                          "reason": f"update norm {h.norm:.3g} held to {h.cap:.3g} "
                                    f"({h.multiple:g} x median of healthy updates){cause}; "
                                    "every held step is scaled down likewise"})
        return held, clips

    def _clips(self, step: int) -> dict[str, float]:
        """Per scope whose ramp clips (to a full-precision wire), this step's multiple: the
        `ramp_clip` threshold, doubling every half window from the ramp's first step; none
        past 2^20 x it (a ramp the norm cap keeps open that long clips nothing any more, and
        the multiple would overflow)."""
        t = self.monitor.thresholds
        doublings = {s: 2 * (step - r[0]) / t.window for s, r in self._ramps.items() if r[4]}
        return {s: t.ramp_clip * 2 ** d for s, d in doublings.items() if d <= 20}

    def _ramp(self, step: int, capped: Mapping[str, Held], clips: Mapping[str, float]) -> None:
        """Count this step in each open ramp: capped, or not (an update that fit, or a scope
        the monitor holds or that is absent this step: nothing to ramp then). A ramp closes
        after `window` steps in a row capped nothing (an update that fits can be followed by
        the blow-up it was held from: `vision.v13`, seed 18, a ramp closed at its first fit,
        3 steps after it opened, and the loss went from 0.04 to 10 six steps later), or at
        once when its first step caps nothing, unless it clips (`clips`: it lasts `window`
        steps at least). One event when a ramp first acts (caps or clips), one when it closes
        after acting."""
        window = self.monitor.thresholds.window
        for scope in list(self._ramps):
            ramp = self._ramps[scope]
            began, change, steps, fits, clip, logged = ramp
            h = capped.get(scope)
            if not logged and (h is not None or clip):
                held = (f"update norm {h.norm:.3g} held to {h.cap:.3g} ({h.multiple:g} x "
                        "median of its recent updates)" if h is not None else "")
                k = clips.get(scope)
                clipped = (f"each element clipped to {k:.3g} x its parameter's mean |update|, "
                           f"doubling every {window / 2:g} steps" if k is not None else "")
                self.log({"step": step, "scope": scope, "from": "update", "to": "ramped",
                          "reason": f"{change} from step {began}: "
                                    f"{'; '.join(x for x in (clipped, held) if x)}; the norm "
                                    "rising with what it delivers until "
                                    f"{window} steps in a row fit"})
                ramp[5] = True
            if h is not None:
                ramp[2:4] = [steps + 1, 0]
            else:
                ramp[3] = fits + 1
                if (not steps and not clip) or fits + 1 >= window:
                    del self._ramps[scope]
                    if ramp[5]:
                        clipped = f", {step - began + 1} clipped" if clip else ""
                        self.log({"step": step, "scope": scope, "from": "ramped", "to": "update",
                                  "reason": f"{window} steps in a row capped nothing "
                                            f"after {steps} capped steps{clipped}"})

    def advance(self, step: int) -> bool:
        """Close step `step`; enter the next phase if it changes (True when it did)."""
        self.step = step + 1
        nxt = self.bindings.phase_at(min(self.step, self.total_steps), self.total_steps)
        if nxt.name == self.phase.name:
            return False
        self._enter_phase(nxt, self.step)
        return True

    def _enter_phase(self, phase: Phase, step: int, old: Phase | None = None) -> None:
        """Enter `phase` at `step` from `old` (default: the phase now): the monitor takes its
        routes, and each scope whose route changes opens a ramp (replacing an open one)."""
        old, self.phase = old or getattr(self, "phase", phase), phase
        if old.name != phase.name and self.acting:
            # The scopes the last step may have sent low-bit (`refused`; None before any
            # step): routed low-bit, unless the step went out whole on fp32. One the monitor
            # held, or a step the gate sent as plain DDP's, changes no wire at a low-bit -> fp32
            # boundary: it does not clip, and a ramp open on it (the gate's switch to fp32)
            # goes on as it was, where a new one would restart its clip's doubling. (A scope
            # some of whose buckets the model gate refused counts as sent: it clips.)
            sent = (None if self._wire is None
                    else frozenset() if self._wire_whole else self._wire[0])
            # per scope: its (last) change, to a full-precision wire?, its wire unchanged?
            changes: dict[str, tuple[str, bool, bool]] = {}
            for b in self.bindings.params.values():
                was, now = b.routes[old.name], b.routes[phase.name]
                if was != now:
                    scope = b.regions[phase.name]
                    _, full, kept = changes.get(scope, ("", False, True))
                    to_fp32 = was.lowbit and not now.lowbit
                    unwired = to_fp32 and sent is not None and b.regions[old.name] not in sent
                    changes[scope] = (f"phase {phase.name!r}: {was.label()} -> {now.label()}",
                                      full or to_fp32 and not unwired, kept and unwired)
            for scope, (change, full, kept) in changes.items():
                if not (kept and scope in self._ramps):
                    self._open_ramp(scope, step, change, full)
        routes = {b.regions[phase.name]: b.routes[phase.name].name for b in self.bindings.params.values()}
        self.monitor.set_routes(routes)
        for ev in self.monitor.on_phase_change(phase.name, step):
            self.log(ev.to_dict())

    def _open_ramp(self, scope: str, step: int, change: str, full: bool) -> None:
        """Open `scope`'s ramp at `step` for `change` (in words), replacing an open one;
        `full`: to a full-precision wire from a low-bit one, so it clips (`_clips`: a heavy
        tailed update of the norm a `sign` one had still breaks a model trained on `sign`),
        unless `ramp_clip` is 0."""
        old = self._ramps.get(scope)
        if old is not None and old[5]:  # one that acted: closed
            self.log({"step": step, "scope": scope, "from": "ramped", "to": "update",
                      "reason": f"the route changes again ({change}) after "
                                f"{step - old[0]} ramped steps"})
        self._ramps[scope] = [step, change, 0, 0, full and self._clipping(), False]

    def _clipping(self) -> bool:
        """Whether a ramp to a full-precision wire clips: `ramp_clip` on, and the update
        guard on (`update_cap` 0 turns every part of it off)."""
        t = self.monitor.thresholds
        return t.ramp_clip > 0 and t.update_cap > 0

    # -- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything the next decisions depend on (JSON-able)."""
        return {"step": self.step, "skipped_steps": list(self.skipped_steps),
                "monitor": self.monitor.state_dict(), "gate": self.gate.state_dict(),
                "guard": self.guard.state_dict(), "held": [list(h) for h in self.held],
                "holding": sorted(self._holding),
                "ramps": {s: list(r) for s, r in self._ramps.items()},
                "wire": None if self._wire is None else [*(sorted(w) for w in self._wire),
                                                         self._wire_whole],
                "priced": {ph: [list(names) for names, _ in keys]
                           for ph, keys in self._priced.items()}}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.monitor.load_state_dict(sd["monitor"])
        self.gate.load_state_dict(sd["gate"])
        if "guard" in sd:  # states saved before the guard existed resume with empty windows
            self.guard.load_state_dict(sd["guard"])
            self.held = [tuple(h) for h in sd["held"]]  # type: ignore[misc]
            self._holding = set(sd["holding"])
        # (states saved before ramps: none open)
        # (ramps saved before clips: [began, change, steps, fits], none clipping)
        # A run whose monitor does not act opens none and would never close a restored one
        # (it would keep an all-fp32 phase off plain DDP's path): dropped. A ramp saved while
        # it clipped clips on only while `ramp_clip` and the guard are on here (resumed with
        # `ramp_clip` 0 it clipped each element to 0 x the mean |update|)
        clipping = self._clipping()

        def restored(r: list[Any]) -> list[Any]:
            clips, acted = r[4:] or (False, r[2] > 0)
            return [*r[:4], bool(clips) and clipping, acted]

        self._ramps = ({s: restored(r) for s, r in sd.get("ramps", {}).items()}
                       if self.acting else {})
        wire = sd.get("wire")  # (states saved before it: the next step opens no gate ramp)
        self._wire = None if wire is None else (frozenset(wire[0]), frozenset(wire[1]))
        self._wire_whole = wire is not None and len(wire) > 2 and bool(wire[2])  # (saved since)
        # (states saved before it: the first step resumed prices its buckets again)
        self._priced = {ph: tuple((tuple(names), ph) for names in rows)
                        for ph, rows in sd.get("priced", {}).items()}
        self.skipped_steps[:] = list(sd["skipped_steps"])
        self.step = int(sd["step"])
        self.phase = self.bindings.phase_at(min(self.step, self.total_steps), self.total_steps)
        if self.monitor.phase != self.phase.name:  # resumed with another total_steps: its
            # routes, trips reset, pins released, and the ramps of a route change, as a run
            # crossing the boundary would have
            saved = next((p for p in self.bindings.phases if p.name == self.monitor.phase), None)
            self._enter_phase(self.phase, self.step, saved)
