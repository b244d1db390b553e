"""Health monitor: decides, from agreed per-step statistics, which scopes must fall back to FP32.

The monitor is pure, deterministic logic. The DDP comm hook and the single-process simulator
both feed it `StepStats` that the caller has already all-reduced, so every rank holds identical
inputs and takes identical decisions at the same step; nothing here talks to a process group.

Each scope (a profile region) and the special scope ``"all"`` run one small state machine:

    ok --trip--> cooldown --`cooldown` steps--> probation --`healthy_to_readmit` healthy--> ok
                    ^  (a trip signal during cooldown restarts it)   |
                    +------ a real trip during probation (counted) --+
    any state --`max_trips` trips in the phase--> pinned --next phase--> ok

Non-finite steps: the caller zeroes every one; `nonfinite_repeat` of them within `window` steps
trip ``"all"`` (fewer only keep a scope in probation from counting the step as healthy).
Trips: repeated non-finite steps and loss spikes (above `loss_spike` times the median *and*
`loss_spike_z` robust standard deviations above it *and* `loss_spike_floor` times the run's
early loss, so the noise of small-batch losses near zero does not count) trip ``"all"``
(every scope on FP32; with `loss_spike_repeat` > 1 fewer spikes than that within `window`
steps are guarded in place, as a blow-up is);
a gradient-norm blow-up (above `grad_blowup` times the median *and* `grad_blowup_floor` times
the scope's early norm: late in a run, converged, single hard batches jump 10-17x a median
that has fallen tenfold; where the step's loss rose too, the norm's rise over the loss's must
pass `grad_blowup`: a batch the model fits badly lifts both, a corrupted gradient the norm
alone) is a detection handled in place: the controller's update guard holds
that step's update and the scope keeps its route (`grad_blowup_trips` = 1 makes it trip the
scope instead); a gradient-norm collapse and a sign-agreement collapse trip the one scope.
A scope whose gradient is exactly zero on every rank (parameters no rank used this step: an
expert not taken) is absent from that check, not collapsed (`absent_scopes`).
Judgements compare against windowed medians of earlier steps; re-admission uses the stricter readmit
thresholds, so a value between the readmit and the trip threshold keeps a scope on FP32
without counting a trip (hysteresis). Re-admission asks whether what tripped has passed: a
norm far *below* its old level keeps a scope held only after a collapse trip; after a blow-up
it is what a converging run does (transformer at 600 steps: norms 10x below the pre-trip
median kept every scope on fp32 for the last half of the run). Events are logged only on
transitions.

Example::

    monitor = HealthMonitor(["backbone", "head"])
    monitor.set_routes({"backbone": "sign", "head": "fp32"})
    events = monitor.check(StepStats(step=0, loss=2.3, nonfinite=False,
                                     grad_norms={"backbone": 1.1, "head": 0.4},
                                     sign_agreement={"backbone": 0.3}))
    route = monitor.effective_route("backbone")   # "fp32" while held, else "sign"
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from nfabric_cli.errors import InputError
from nfabric_cli.profile.thresholds import HealthThresholds
from nfabric_cli.routes.spec import ROUTE_NAMES

__all__ = ["ALL", "BLOWUP", "SPIKE", "HealthEvent", "HealthMonitor", "HealthThresholds", "StepStats",
           "absent_scopes"]

#: The scope name that stands for every scope at once.
ALL = "all"

@dataclass(frozen=True)
class StepStats:
    """One step's statistics, already all-reduced / agreed across ranks by the caller.

    ``sign_agreement[scope]`` is the mean over elements of |2*count/W - 1| (1 = unanimous,
    ~0 = coin flips), present only for scopes on the sign route.
    """

    step: int
    loss: float | None
    nonfinite: bool
    grad_norms: dict[str, float] = field(default_factory=dict)
    sign_agreement: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class HealthEvent:
    """One switch of a scope's route, with the step and the reason."""

    step: int
    scope: str
    from_route: str
    to_route: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "scope": self.scope,
            "from": self.from_route,
            "to": self.to_route,
            "reason": self.reason,
        }


# Verdicts of one check for one scope, from worst to best. NONE: no data for the scope.
_TRIP, _UNHEALTHY, _HEALTHY, _NONE = "trip", "unhealthy", "healthy", "none"
#: A detection handled in place: the guard holds the scope's update this step, its route stays
#: (a gradient-norm blow-up unless `grad_blowup_trips`); unhealthy for the state machine.
_GUARD = "guard"
_COLLAPSE = "grad-norm collapse"
#: How a loss spike's detection reason starts (`calibration/quiet.py` reads them).
SPIKE = "loss spike"
#: How a gradient-norm blow-up's detection reason starts (the controller caps its step).
BLOWUP = "grad-norm blow-up"


@dataclass
class _Hold:
    """The mutable state machine of one scope (or of ``"all"``)."""

    status: str = "ok"  # ok | cooldown | probation | pinned
    trips: int = 0  # trips counted in the current phase
    hold_until: int = -1  # last step of the cooldown
    healthy_run: int = 0  # consecutive healthy checks in probation
    # tripped by a gradient-norm collapse: re-admission also needs the norm back up (after
    # any other trip a norm below its old level is training converging, not a fault)
    collapsed: bool = False

    @property
    def forced(self) -> bool:
        return self.status != "ok"


class HealthMonitor:
    """Per-scope FP32 fallback with cooldown, hysteresis and pinning; see the module docstring.

    Call `set_routes` with the profile's routes before the first `check` and at each phase
    change (before `on_phase_change`), then `check` once per step in step order.
    """

    def __init__(self, scopes: list[str], thresholds: HealthThresholds | None = None) -> None:
        if ALL in scopes:
            raise InputError(f"scope name {ALL!r} is reserved for the whole model")
        if len(set(scopes)) != len(scopes):
            raise InputError("health monitor scopes must be unique")
        self.thresholds = thresholds or HealthThresholds()
        self._scopes = list(scopes)
        self._routes: dict[str, str] = {s: "fp32" for s in scopes}
        self._holds: dict[str, _Hold] = {s: _Hold() for s in [ALL, *scopes]}
        w = self.thresholds.window
        self._loss_window: deque[float] = deque(maxlen=w)
        self._norm_windows: dict[str, deque[float]] = {s: deque(maxlen=w) for s in scopes}
        # the floors': the run's first `window` healthy losses (under "all") and norms per scope
        self._early: dict[str, list[float]] = {s: [] for s in [ALL, *scopes]}
        self._events: list[HealthEvent] = []
        #: (step, scope, reason) of every detection judged (a trip signal, or one guarded
        #: in place), acted on or not (a scope on fp32, one already held): what the detectors
        #: saw, e.g. their false-trip rate on fp32 runs
        self.detections: list[tuple[int, str, str]] = []
        self._nonfinite: list[int] = []  # steps of the non-finite checks within `window`
        self._spikes: list[int] = []  # steps of the loss spikes within `window`
        self._phase: str | None = None
        self._last_step: int | None = None

    # ----- routes and phases -------------------------------------------------------------

    @property
    def phase(self) -> str | None:
        """The phase the monitor last entered (None: none yet)."""
        return self._phase

    def set_routes(self, routes: Mapping[str, str]) -> None:
        """Set the profile route per scope for the current phase (scopes not named keep theirs).

        A scope whose route becomes fp32 drops any hold silently: there is nothing to fall back
        from, and its effective route does not change. The same holds for ``"all"`` when no
        scope is left on a non-fp32 route.
        """
        unknown = sorted(set(routes) - set(self._scopes))
        if unknown:
            raise InputError(f"unknown health scope(s): {', '.join(unknown)}")
        for scope, route in routes.items():
            if route not in ROUTE_NAMES:
                raise InputError(f"unknown route {route!r} for scope {scope!r}")
            self._routes[scope] = route
            if route == "fp32":
                self._holds[scope] = _Hold(trips=self._holds[scope].trips)
        if self._route_of(ALL) == "fp32":
            self._holds[ALL] = _Hold(trips=self._holds[ALL].trips)

    def on_phase_change(self, phase: str, step: int) -> list[HealthEvent]:
        """Enter `phase`: reset trip counts and release pinned scopes (one event each)."""
        if phase == self._phase:
            return []
        self._phase = phase
        events = []
        for scope, hold in self._holds.items():
            hold.trips = 0
            if hold.status == "pinned":
                self._holds[scope] = _Hold()
                route = self._route_of(scope)
                reason = f"pin released: phase {phase}"
                events.append(HealthEvent(step, scope, "fp32", route, reason))
        self._events.extend(events)
        return events

    # ----- the per-step check ------------------------------------------------------------

    def check(self, stats: StepStats) -> list[HealthEvent]:
        """Judge one step's agreed statistics; return the events it caused (in scope order)."""
        if self._last_step is not None and stats.step <= self._last_step:
            last = self._last_step
            raise ValueError(f"check() steps must increase: got {stats.step} after {last}")
        unknown = sorted((set(stats.grad_norms) | set(stats.sign_agreement)) - set(self._scopes))
        if unknown:
            raise ValueError(f"statistics for unknown scope(s): {', '.join(unknown)}")
        self._last_step = stats.step
        stats = present(stats)

        nonfinite_reason = _nonfinite_reason(stats)
        # the step's loss against its window, once: the spike check and every scope's use it
        loss_rise = self._ratio(stats.loss, self._loss_window)
        events: list[HealthEvent] = []
        if nonfinite_reason:
            verdict, reason = self._judge_nonfinite(stats.step, nonfinite_reason)
        else:
            verdict, reason = self._judge_all(stats, loss_rise)
        self._detect(stats.step, ALL, verdict, reason)
        if verdict == _GUARD:  # a lone loss spike: every scope's update held, routes kept
            verdict = _UNHEALTHY
        events += self._advance(ALL, verdict, reason, stats.step)
        for scope in self._scopes:
            if nonfinite_reason:  # not a healthy check for anyone; "all" carries any trip
                verdict, reason = _UNHEALTHY, ""
            else:
                verdict, reason = self._judge_scope(scope, stats, loss_rise)
            self._detect(stats.step, scope, verdict, reason)
            if verdict == _GUARD:  # held by the controller's guard; the scope's state stays
                verdict = _UNHEALTHY
            events += self._advance(scope, verdict, reason, stats.step)

        # The windows hold healthy steps only: a non-finite step's values, and a held scope's
        # (a trip's own spike, the steps until re-admission), never enter them, so
        # re-admission is judged against the run as it was before the trip. A detection guarded
        # in place (a blow-up, a lone loss spike) does enter its window, as one value of
        # `window` (the median barely moves); a lasting new scale then becomes the median
        # within half a window, and stops being held, instead of being held for good.
        if not nonfinite_reason:
            whole = self._holds[ALL].status == "ok"
            if stats.loss is not None and whole:
                self._healthy(ALL, float(stats.loss), self._loss_window)
            for scope, norm in stats.grad_norms.items():
                if whole and self._holds[scope].status == "ok":
                    self._healthy(scope, float(norm), self._norm_windows[scope])
        self._events.extend(events)
        return events

    def _healthy(self, key: str, value: float, window: deque[float]) -> None:
        """A healthy value joins its window, and the early values while there are fewer than
        `window` of them."""
        window.append(value)
        if len(self._early[key]) < self.thresholds.window:
            self._early[key].append(value)

    def early_loss(self) -> float | None:
        """The run's early loss: the median of its first `window` healthy losses (what the
        spike floor scales); None before any."""
        early = self._early[ALL]
        return statistics.median(early) if early else None

    def _floor(self, key: str, factor: float) -> float:
        """`factor` times the median of the early values under `key`."""
        return factor * statistics.median(self._early[key])

    def _detect(self, step: int, scope: str, verdict: str, reason: str) -> None:
        if verdict in (_TRIP, _GUARD):
            self.detections.append((step, scope, reason))

    def _judge_nonfinite(self, step: int, reason: str) -> tuple[str, str]:
        """A trip once `nonfinite_repeat` non-finite steps fall within `window` steps; a lone
        one is unhealthy only (the caller zeroes its update either way)."""
        self._nonfinite, trips, why = self._repeat(self._nonfinite, step,
                                                   self.thresholds.nonfinite_repeat, reason)
        return (_TRIP, why) if trips else (_UNHEALTHY, "")

    def _judge_all(self, stats: StepStats, ratio: float | None) -> tuple[str, str]:
        """Loss against its windowed median (a finite step without a loss is healthy)."""
        if ratio is None:
            return _HEALTHY, ""
        t = self.thresholds
        if ratio > t.loss_spike:
            z = _robust_z(float(stats.loss), self._loss_window)
            floor = self._floor(ALL, t.loss_spike_floor)
            if z > t.loss_spike_z and float(stats.loss) > floor:
                spread = f" ({z:.0f} robust sd)" if math.isfinite(z) else ""
                return self._spike(stats.step, f"{SPIKE} {ratio:.1f}x median{spread}")
            return _UNHEALTHY, ""
        return (_UNHEALTHY, "") if ratio > t.loss_readmit else (_HEALTHY, "")

    def _spike(self, step: int, reason: str) -> tuple[str, str]:
        """A loss spike trips once `loss_spike_repeat` of them fall within `window` steps;
        fewer are held in place by the guard (with no guard, every one trips)."""
        t = self.thresholds
        self._spikes, trips, why = self._repeat(self._spikes, step, t.loss_spike_repeat, reason)
        return (_TRIP, why) if trips or t.update_cap <= 0 else (_GUARD, reason)

    def _repeat(self, steps: list[int], step: int, need: int,
                reason: str) -> tuple[list[int], bool, str]:
        """`steps` within `window` of `step`, with it; whether they are `need` or more; the
        reason, with their count where more than one is needed."""
        window = self.thresholds.window
        steps = [s for s in steps if s > step - window] + [step]
        counted = reason if need == 1 else f"{reason} ({len(steps)} in {window} steps)"
        return steps, len(steps) >= need, counted

    def _judge_scope(self, scope: str, stats: StepStats,
                     loss: float | None) -> tuple[str, str]:
        """Grad norm against its windowed median, then sign agreement; worst verdict wins."""
        t = self.thresholds
        verdicts: list[tuple[str, str]] = []
        if scope in stats.grad_norms:
            ratio = self._ratio(stats.grad_norms[scope], self._norm_windows[scope])
            if ratio is None:
                verdicts.append((_HEALTHY, ""))
            elif ratio > t.grad_blowup:
                floor = self._floor(scope, t.grad_blowup_floor)
                # held in place by the guard, unless told to trip or there is no guard
                trips = t.grad_blowup_trips or t.update_cap <= 0
                blowup = (_TRIP if trips else _GUARD, f"{BLOWUP} {ratio:.1f}x median")
                over = self._over_loss(ratio, loss)
                if over <= t.grad_blowup:  # the batch's loss rose with it: a hard batch
                    verdicts.append((_UNHEALTHY, ""))
                else:
                    if over < ratio:
                        blowup = (blowup[0], f"{blowup[1]}, {over:.1f}x over the loss's rise")
                    verdicts.append(blowup if stats.grad_norms[scope] > floor else (_UNHEALTHY, ""))
            elif ratio < t.grad_collapse:
                if loss is not None and 0 <= loss < t.grad_collapse_loss:  # a batch already fit
                    verdicts.append((_UNHEALTHY, ""))
                else:
                    verdicts.append((_TRIP, f"{_COLLAPSE} {ratio:.2g}x median"))
            elif ratio > t.grad_readmit or (ratio * t.grad_readmit < 1
                                            and self._holds[scope].collapsed):
                verdicts.append((_UNHEALTHY, ""))
            else:
                verdicts.append((_HEALTHY, ""))
        if scope in stats.sign_agreement:
            agreement = stats.sign_agreement[scope]
            if agreement < t.sign_agreement_min:
                why = f"sign agreement {agreement:.3f} < {t.sign_agreement_min:g}"
                verdicts.append((_TRIP, why))
            else:
                verdicts.append((_HEALTHY, ""))
        order = (_TRIP, _GUARD, _UNHEALTHY, _HEALTHY)
        return min(verdicts, key=lambda v: order.index(v[0]), default=(_NONE, ""))

    def _over_loss(self, ratio: float, rise: float | None) -> float:
        """A norm's rise `ratio` over the step's loss rise `rise`, where the loss rose and the
        thresholds judge blow-ups so (`grad_blowup_per_loss`); else `ratio` itself."""
        per_loss = self.thresholds.grad_blowup_per_loss and rise is not None and rise > 1
        return ratio / rise if per_loss else ratio

    def _ratio(self, value: float | None, window: deque[float]) -> float | None:
        """value / median(window), or None when there is too little history or no scale."""
        if value is None or len(window) < self.thresholds.min_history:
            return None
        median = statistics.median(window)
        return value / median if median > 0 else None

    def _advance(self, scope: str, verdict: str, reason: str, step: int) -> list[HealthEvent]:
        """Apply one check's verdict to a scope's state machine; return its transition events."""
        route = self._route_of(scope)
        hold = self._holds[scope]
        t = self.thresholds
        if route == "fp32" or hold.status == "pinned":
            return []  # nothing to fall back from, or held until the next phase
        if hold.status == "cooldown" and step > hold.hold_until:
            hold.status = "probation"
        if verdict == _TRIP:
            # a collapse anywhere in the hold keeps the lower readmit bound until re-admission
            collapsed = reason.startswith(_COLLAPSE)
            hold.collapsed = collapsed or (hold.collapsed and hold.status != "ok")
            if hold.status == "cooldown":
                hold.hold_until = step + t.cooldown  # still bad: restart the hold, not a new trip
                return []
            was_ok = hold.status == "ok"
            hold.trips += 1
            hold.healthy_run = 0
            if hold.trips >= t.max_trips:
                hold.status = "pinned"
                n, phase = hold.trips, self._phase or "(unset)"
                pin = f"pinned: {n} trip{'s' * (n != 1)} in phase {phase} ({reason})"
                return [HealthEvent(step, scope, route if was_ok else "fp32", "fp32", pin)]
            hold.status, hold.hold_until = "cooldown", step + t.cooldown
            return [HealthEvent(step, scope, route, "fp32", reason)] if was_ok else []
        if hold.status != "probation":
            return []
        if verdict == _UNHEALTHY:
            hold.healthy_run = 0
        elif verdict == _HEALTHY:
            hold.healthy_run += 1
            if hold.healthy_run >= t.healthy_to_readmit:
                run = hold.healthy_run
                self._holds[scope] = _Hold(trips=hold.trips)
                why = f"re-admitted after {run} healthy checks"
                return [HealthEvent(step, scope, "fp32", route, why)]
        return []

    # ----- queries -----------------------------------------------------------------------

    def _route_of(self, scope: str) -> str:
        """A scope's profile route; for ``"all"``, its distinct non-fp32 routes joined by '+'."""
        if scope != ALL:
            if scope not in self._routes:
                raise InputError(f"unknown health scope {scope!r}")
            return self._routes[scope]
        used = set(self._routes.values()) - {"fp32"}
        return "+".join(r for r in ROUTE_NAMES if r in used) or "fp32"

    def forced_fp32(self, scope: str) -> bool:
        """True while the scope (or ``"all"``) is held, cooling, on probation or pinned."""
        if self._route_of(scope) == "fp32":
            return False
        return self._holds[scope].forced or self._holds[ALL].forced

    def effective_route(self, scope: str) -> str:
        """The route the hook should use for the scope now: "fp32" if forced, else the profile's."""
        return "fp32" if self.forced_fp32(scope) else self._route_of(scope)

    @property
    def events(self) -> list[HealthEvent]:
        """Every event so far, in order."""
        return list(self._events)

    def state_dict(self) -> dict[str, Any]:
        """Everything `check` depends on (JSON-able): a monitor loaded from it decides as the
        one that made it would have."""
        return {
            "scopes": list(self._scopes),
            "routes": dict(self._routes),
            "holds": {s: asdict(h) for s, h in self._holds.items()},
            "loss_window": list(self._loss_window),
            "early_losses": list(self._early[ALL]),
            "norm_windows": {s: list(w) for s, w in self._norm_windows.items()},
            "early_norms": {s: list(self._early[s]) for s in self._scopes},
            "events": [e.to_dict() for e in self._events],
            "nonfinite_steps": list(self._nonfinite),
            "loss_spike_steps": list(self._spikes),
            "phase": self._phase,
            "last_step": self._last_step,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if list(state["scopes"]) != self._scopes:
            raise InputError(f"health monitor state is for scopes {list(state['scopes'])}, "
                             f"this monitor has {self._scopes}")
        self._routes = dict(state["routes"])
        self._holds = {s: _Hold(**h) for s, h in state["holds"].items()}
        self._loss_window.clear()
        self._loss_window.extend(state["loss_window"])
        # a state saved before the floor existed: its window stands in for the early losses
        self._early = {ALL: list(state.get("early_losses", state["loss_window"]))}
        for s, values in state["norm_windows"].items():
            self._norm_windows[s].clear()
            self._norm_windows[s].extend(values)
        self._early.update({s: list(v) for s, v in
                            state.get("early_norms", state["norm_windows"]).items()})
        self._events = [HealthEvent(e["step"], e["scope"], e["from"], e["to"], e["reason"])
                        for e in state["events"]]
        self._nonfinite = list(state.get("nonfinite_steps", []))
        self._spikes = list(state.get("loss_spike_steps", []))
        self._phase, self._last_step = state["phase"], state["last_step"]

    def state(self) -> dict[str, Any]:
        """A JSON-able snapshot for reports."""

        def one(scope: str) -> dict[str, Any]:
            hold = self._holds[scope]
            return {
                "route": self._route_of(scope),
                "effective_route": self.effective_route(scope),
                "status": hold.status,
                "trips": hold.trips,
                "healthy_run": hold.healthy_run,
                "hold_until": hold.hold_until if hold.status == "cooldown" else None,
            }

        return {
            "phase": self._phase,
            "step": self._last_step,
            "thresholds": self.thresholds.to_dict(),
            "scopes": {s: one(s) for s in [ALL, *self._scopes]},
            "events": [e.to_dict() for e in self._events],
        }


def absent_scopes(grad_norms: Mapping[str, float]) -> set[str]:
    """The scopes with no gradient this step: a norm of exactly zero over every rank, which
    is what DDP reduces for parameters that no rank's graph used (a branch or an expert not
    taken, under find_unused_parameters). Not a collapse: such a scope is not judged, its
    windows do not take the zero, and DDP leaves its parameters untouched."""
    return {s for s, n in grad_norms.items() if n == 0.0}


def present(stats: StepStats) -> StepStats:
    """`stats` without the absent scopes' statistics (`absent_scopes`)."""
    absent = absent_scopes(stats.grad_norms)
    if not absent:
        return stats
    return StepStats(stats.step, stats.loss, stats.nonfinite,
                     {s: n for s, n in stats.grad_norms.items() if s not in absent},
                     {s: a for s, a in stats.sign_agreement.items() if s not in absent})


def _robust_z(value: float, window: deque[float]) -> float:
    """How many robust standard deviations (1.4826 * median absolute deviation) `value` lies
    above the window's median; inf when the window does not vary."""
    median = statistics.median(window)
    mad = statistics.median(abs(x - median) for x in window)
    return (value - median) / (1.4826 * mad) if mad > 0 else math.inf


def _nonfinite_reason(stats: StepStats) -> str:
    """Why the step is non-finite ("" if it is finite); a NaN sign is not a vote."""
    if stats.loss is not None and not math.isfinite(stats.loss):
        return "nonfinite loss"
    values = [*stats.grad_norms.values(), *stats.sign_agreement.values()]
    if stats.nonfinite or not all(math.isfinite(v) for v in values):
        return "nonfinite gradient"
    return ""
