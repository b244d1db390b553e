"""The search space: one `Config` per trial (route per region x phase, tau, error feedback,
int rounding, sign reducer mode, phase boundaries), the Optuna parameters that encode it, and
the profile it becomes.

Parameter names are stable strings (`route.<region>.<phase>`, `boundary.<i>`, `tau`,
`error_feedback`, `rounding`, `sign_mode`) so a resumed study, an enqueued sweep trial and a fresh trial all speak the
same language. `Config.key()` is a canonical form: two configs with the same key train
identically, so a repeated suggestion reuses the stored result instead of training again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import optuna

from nfabric_cli.calibration.spec import CalibrationSpec
from nfabric_cli.calibration.spec_values import Range
from nfabric_cli.profile.operating import OperatingProfile, route_row
from nfabric_cli.profile.phases import Phase
from nfabric_cli.profile.target import within_tolerance
from nfabric_cli.routes.spec import LOWBIT_ROUTES

BOUNDARY_STEP = 0.01
TAU_STEP = 0.05


def grid_step(allowed: Range, step: float) -> float | None:
    """The step a searched float is sampled on: `step`, or none where its range is narrower."""
    return step if (allowed.hi - allowed.lo) >= step else None


def route_param(region: str, phase: str) -> str:
    return f"route.{region}.{phase}"


@dataclass(frozen=True)
class Config:
    """One point of the search space."""

    routes: tuple[tuple[str, ...], ...]  # [phase index][region index] -> route name
    boundaries: tuple[float, ...]
    tau: float
    error_feedback: bool
    rounding: str = "nearest"  # int8 / int4 rows
    sign_mode: str = "majority"  # sign rows

    def phases(self, spec: CalibrationSpec) -> list[Phase]:
        edges = [0.0, *self.boundaries, 1.0]
        return [Phase(n, edges[i], edges[i + 1]) for i, n in enumerate(spec.phases)]

    def uses(self, route: str) -> bool:
        return any(route in per_phase for per_phase in self.routes)

    def all_fp32(self) -> bool:
        return all(r == "fp32" for per_phase in self.routes for r in per_phase)

    def key(self) -> str:
        """Canonical JSON: options that cannot matter (tau without ternary, error feedback
        without a low-bit route) are dropped, so equal keys mean equal training."""
        lowbit = any(r in LOWBIT_ROUTES for p in self.routes for r in p)
        key: dict[str, Any] = {
            "routes": self.routes,
            "boundaries": self.boundaries,
            "tau": self.tau if self.uses("ternary") else None,
            "ef": self.error_feedback if lowbit else None,
        }
        # Defaults are left out, so keys stored before these options existed still match.
        if self.rounding != "nearest" and (self.uses("int8") or self.uses("int4")):
            key["rounding"] = self.rounding
        if self.sign_mode != "majority" and self.uses("sign"):
            key["sign_mode"] = self.sign_mode
        return json.dumps(key, sort_keys=True)

    def params(self, spec: CalibrationSpec) -> dict[str, Any]:
        """The Optuna parameters that encode this config (for `enqueue_trial`)."""
        out: dict[str, Any] = {}
        for p, phase in enumerate(spec.phases):
            for r, region in enumerate(spec.regions):
                out[route_param(region.name, phase)] = self.routes[p][r]
        for i, b in enumerate(spec.boundaries):
            if not b.fixed:
                out[f"boundary.{i}"] = self.boundaries[i]
        if not spec.tau.fixed:
            out["tau"] = self.tau
        if len(spec.error_feedback) > 1:
            out["error_feedback"] = self.error_feedback
        if len(spec.rounding) > 1:
            out["rounding"] = self.rounding
        if len(spec.sign_mode) > 1:
            out["sign_mode"] = self.sign_mode
        return out

    def labels(self, spec: CalibrationSpec) -> dict[str, str]:
        """`region@phase` -> route, for tables and JSON."""
        return {
            f"{region.name}@{phase}": self.routes[p][r]
            for p, phase in enumerate(spec.phases)
            for r, region in enumerate(spec.regions)
        }


def suggest(trial: optuna.trial.BaseTrial, spec: CalibrationSpec) -> Config:
    """Sample (or read back, for an enqueued trial) one config."""
    routes = tuple(
        tuple(
            trial.suggest_categorical(route_param(region.name, phase), list(region.routes))
            for region in spec.regions
        )
        for phase in spec.phases
    )
    bounds = []
    for i, b in enumerate(spec.boundaries):
        if b.fixed:
            bounds.append(b.lo)
        else:
            step = grid_step(b, BOUNDARY_STEP)
            bounds.append(round(trial.suggest_float(f"boundary.{i}", b.lo, b.hi, step=step), 6))
    tau = spec.tau.lo
    if not spec.tau.fixed:
        step = grid_step(spec.tau, TAU_STEP)
        tau = round(trial.suggest_float("tau", spec.tau.lo, spec.tau.hi, step=step), 6)
    ef = spec.error_feedback[0]
    if len(spec.error_feedback) > 1:
        ef = bool(trial.suggest_categorical("error_feedback", list(spec.error_feedback)))
    rounding, mode = spec.rounding[0], spec.sign_mode[0]
    if len(spec.rounding) > 1:
        rounding = str(trial.suggest_categorical("rounding", list(spec.rounding)))
    if len(spec.sign_mode) > 1:
        mode = str(trial.suggest_categorical("sign_mode", list(spec.sign_mode)))
    return Config(routes, tuple(bounds), tau, ef, rounding, mode)


def uniform_config(spec: CalibrationSpec, route_of: dict[str, str]) -> Config:
    """Every phase routes region `name` to `route_of[name]` (default fp32); options at their
    defaults (lowest boundaries, mid tau, the first error-feedback choice)."""
    per_phase = tuple(route_of.get(r.name, "fp32") for r in spec.regions)
    tau = round((spec.tau.lo + spec.tau.hi) / 2, 6) if not spec.tau.fixed else spec.tau.lo
    return Config(
        routes=tuple(per_phase for _ in spec.phases),
        boundaries=tuple(b.lo for b in spec.boundaries),
        tau=tau,
        error_feedback=spec.error_feedback[0],
        rounding=spec.rounding[0],
        sign_mode=spec.sign_mode[0],
    )


def fp32_config(spec: CalibrationSpec) -> Config:
    return uniform_config(spec, {})


def sweep_configs(spec: CalibrationSpec) -> dict[str, Config]:
    """Region name -> config with that region alone on its cheapest route (others fp32)."""
    return {
        r.name: uniform_config(spec, {r.name: r.cheapest})
        for r in spec.regions
        if r.cheapest != "fp32"
    }


def derived_configs(spec: CalibrationSpec, degradation: dict[str, float]) -> list[Config]:
    """Seeds from the sweep: regions within tolerance alone go to their cheapest route; the
    sensitive ones stay on fp32 (first seed) or take their gentlest low-bit route (second)."""
    safe = {n for n, d in degradation.items() if within_tolerance(d, spec.tolerance)}
    cheap = {r.name: r.cheapest for r in spec.regions if r.name in safe}
    gentle = dict(cheap)
    for r in spec.regions:
        if r.name not in safe and r.gentlest_lowbit is not None:
            gentle[r.name] = r.gentlest_lowbit
    seeds = []
    for route_of in (cheap, gentle):
        if route_of:
            config = uniform_config(spec, route_of)
            if config not in seeds:
                seeds.append(config)
    return seeds


def config_profile(
    spec: CalibrationSpec,
    config: Config,
    meta: dict[str, Any] | None = None,
    evidence: dict[tuple[str, str], dict[str, Any]] | None = None,
) -> OperatingProfile:
    """The operating profile of a config: one row per (region, phase), regions in priority
    order; `evidence[(region, phase)]` fills traffic_fraction / metric_delta / trials."""
    rows = []
    for p, phase in enumerate(config.phases(spec)):
        for priority, region in enumerate(spec.regions):
            route = config.routes[p][priority]
            ev = (evidence or {}).get((region.name, phase.name), {})
            rows.append(route_row(
                region.selector, phase, priority, route, tau=config.tau,
                error_feedback=config.error_feedback, reducer=spec.reducer,
                rounding=config.rounding, mode=config.sign_mode,
                traffic_fraction=ev.get("traffic_fraction"),
                metric_delta=ev.get("metric_delta"), trials=ev.get("trials")))
    return OperatingProfile(rows, dict(meta or {})).validate()


def routing_key(key: str) -> str:
    """A `Config.key` less its phase boundaries when every phase routes alike (such a boundary
    only moves where the health monitor resets its trip counts); any other string unchanged."""
    try:
        parsed = json.loads(key)
    except ValueError:
        return key
    routes = parsed.get("routes") if isinstance(parsed, dict) else None
    if not routes or any(r != routes[0] for r in routes):
        return key
    return json.dumps({**parsed, "boundaries": None}, sort_keys=True)
