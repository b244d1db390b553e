"""Warm starts: an existing profile's routes enqueued as a trial of a new search.

`nfabric calibrate --warm-start PROFILE` reads a profile (an earlier version, say, before the
rules changed) back into the search space's `Config` and enqueues it (Optuna's
`enqueue_trial`), so the study trains it, ranks it with every other trial and may confirm
it: a recalibration then never misses the configuration that won last time, however the
sampler wanders. The trial is one of the study's budget, of kind "warm".

Only what the search varies is read back: routes, phase boundaries, tau, error feedback,
int rounding and the sign mode. Options it does not vary (a row's chunk size, its reducer,
sign's zero vote) take the search's values; each difference is a note for the user, e.g.
a schema-1.0 profile's sign rows voting zeros "negative" retrained under "split".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import TrialState

from nfabric_cli.calibration.choice import WARM
from nfabric_cli.calibration.space import (
    BOUNDARY_STEP,
    TAU_STEP,
    Config,
    config_profile,
    fp32_config,
    grid_step,
)
from nfabric_cli.calibration.spec import CalibrationSpec
from nfabric_cli.calibration.spec_values import Range
from nfabric_cli.errors import InputError
from nfabric_cli.profile.operating import OperatingProfile, ProfileRow
from nfabric_cli.routes.spec import LOWBIT_ROUTES


@dataclass(frozen=True)
class WarmStart:
    """A profile read back as a config: its `source` (for the trial's record) and the
    differences between the profile and what the trial trains (`notes`)."""

    source: str
    config: Config
    notes: tuple[str, ...] = ()
    model: str | None = None  # the profile's model fingerprint (None: it records none)


def warm_start(spec: CalibrationSpec, profile: OperatingProfile, source: str) -> WarmStart:
    """`profile` as a point of `spec`'s search space; InputError (one line, naming `source`)
    where it does not fit: other phases or regions, a route a region may not take, an option
    outside the spec's choices."""
    def refuse(why: str) -> InputError:
        return InputError(f"--warm-start {source}: {why}")

    phases = profile.phases()
    names = [p.name for p in phases]
    if tuple(names) != spec.phases:
        raise refuse(f"its phases ({', '.join(names)}) are not the spec's "
                     f"({', '.join(spec.phases)})")
    selectors = [r.selector for r in spec.regions]
    routes, rows = [], []
    for phase in names:
        by_region = {r.region: r for r in profile.rules(phase)}
        if sorted(by_region) != sorted(selectors):
            raise refuse(f"phase {phase!r} has rules for {sorted(by_region)}, the spec's "
                         f"regions are {sorted(selectors)}")
        per_phase = []
        for region in spec.regions:
            row = by_region[region.selector]
            if row.route not in region.routes:
                raise refuse(f"region {region.name!r} in phase {phase!r} takes {row.route!r}, "
                             f"not one of the spec's {', '.join(region.routes)}")
            per_phase.append(row.route)
            rows.append(row)
        routes.append(tuple(per_phase))
    bounds = tuple(_on_grid(p.start, b, BOUNDARY_STEP, f"phase {p.name!r} starts at", refuse)
                   for p, b in zip(phases[1:], spec.boundaries, strict=True))
    base = fp32_config(spec)  # the options of a config that does not use them
    tau = _one(rows, "tau", {"ternary"}, refuse)
    ef = _one(rows, "error_feedback", set(LOWBIT_ROUTES), refuse)
    rounding = _one(rows, "rounding", {"int8", "int4"}, refuse)
    mode = _one(rows, "mode", {"sign"}, refuse)
    for label, value, choices in (("error feedback", ef, spec.error_feedback),
                                  ("rounding", rounding, spec.rounding),
                                  ("sign mode", mode, spec.sign_mode)):
        if value is not None and value not in choices:
            raise refuse(f"its {label} {value!r} is not one of the spec's "
                         f"{', '.join(map(str, choices))}")
    config = Config(
        tuple(routes), bounds,
        base.tau if tau is None else _on_grid(float(tau), spec.tau, TAU_STEP, "tau", refuse),
        base.error_feedback if ef is None else ef,
        base.rounding if rounding is None else rounding,
        base.sign_mode if mode is None else mode)
    return WarmStart(source, config, _differences(spec, config, profile),
                     profile.meta.get("model_fingerprint"))


Refuse = Callable[[str], InputError]


def _one(rows: Sequence[ProfileRow], field: str, routes: set[str], refuse: Refuse) -> Any:
    """The one value of option `field` over the rows of `routes`, as the route takes it (an
    unset one is its default: `ProfileRow.spec`), for the search sets one per trial; None
    when no row takes it; refused where rows disagree."""
    values = {getattr(r.spec(), field) for r in rows if r.route in routes}
    if len(values) > 1:
        raise refuse(f"its rows disagree on {field} ({', '.join(sorted(map(str, values)))}), "
                     "and a trial sets one")
    return values.pop() if values else None


def _on_grid(value: float, allowed: Range, step: float, what: str, refuse: Refuse) -> float:
    """`value` as the search would sample it: inside `allowed`, on its grid of `step`."""
    if not allowed.lo - 1e-9 <= value <= allowed.hi + 1e-9:
        raise refuse(f"{what} {value:g}, outside the spec's range [{allowed.lo:g}, {allowed.hi:g}]")
    if allowed.fixed or grid_step(allowed, step) is None:
        return allowed.lo if allowed.fixed else round(value, 6)
    k = (value - allowed.lo) / step
    if abs(k - round(k)) > 1e-6:
        raise refuse(f"{what} {value:g}, not on the search's grid of {step:g} from {allowed.lo:g}")
    return round(allowed.lo + round(k) * step, 6)


def _differences(spec: CalibrationSpec, config: Config, profile: OperatingProfile) -> tuple[str, ...]:
    """What the trial trains otherwise than `profile` says: per option, the rows it changes."""
    trained = {r.key: r.spec() for r in config_profile(spec, config).rows}
    changed: dict[str, list[str]] = {}
    for row in profile.rows:
        given, got = row.spec(), trained[row.key]
        for option in ("chunk", "reducer", "zeros"):
            was, now = getattr(given, option), getattr(got, option)
            if was != now and row.route in LOWBIT_ROUTES:
                changed.setdefault(f"{option} {_shown(was)} -> {_shown(now)}", []).append(
                    f"{row.region}@{row.phase}")
    return tuple(f"{what} on {len(where)} row(s) ({', '.join(where[:3])}"
                 f"{', ...' if len(where) > 3 else ''}): the search's, not the profile's"
                 for what, where in changed.items())


def _shown(value: object) -> str:
    """An option's value as a note shows it (None: the route's default)."""
    return "the route's default" if value is None else repr(value)


def enqueue_warm(study: optuna.Study, spec: CalibrationSpec, warm: Sequence[WarmStart],
                 trials: Sequence[optuna.trial.FrozenTrial], full: bool) -> list[str]:
    """Enqueue each warm start unless one of `trials` (the study's) answers it already: a
    finished, running or queued trial of the same configuration, any kind (a pruned one
    does not: it stopped short). Nothing is enqueued into a study that holds its budget
    (`full`: it would never train). A note per warm start not enqueued."""
    answered = (TrialState.COMPLETE, TrialState.RUNNING) + (() if full else (TrialState.WAITING,))
    held = {t.user_attrs.get("key"): f"{_STATE[t.state]} trial {t.number}"
            for t in trials if t.state in answered}  # queued, in a full study: never trains
    notes = []
    for w in warm:
        key = w.config.key()
        if key in held:
            notes.append(f"warm start {w.source}: the study holds its configuration already "
                         f"({held[key]})")
        elif full:
            notes.append(f"warm start {w.source}: not trained, the study holds its budget "
                         f"of {spec.trials} trials (a larger --trials extends it)")
        else:
            study.enqueue_trial(w.config.params(spec), {"kind": WARM, "key": key,
                                                        "source": w.source})
            held[key] = f"warm start {w.source}"
    return notes


_STATE = {TrialState.COMPLETE: "finished", TrialState.RUNNING: "running",
          TrialState.WAITING: "queued"}
