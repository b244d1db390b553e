"""Calibration specs: what `nfabric calibrate` may choose, and the budget it may spend.

A spec is one TOML file per workload (`calibrate/<workload>.toml`); command-line flags
override its scalars. Regions are profile rows in priority order (the first selector that
matches a parameter wins, so the last region is usually ``*``); each lists the routes it may
take. Phase boundaries are fixed fractions or ``[lo, hi]`` ranges to search; so are the
ternary gate ``tau`` and ``error_feedback``. Every problem is an `InputError` naming the key.

Example::

    tolerance = 0.02
    steps = 120
    eval_every = 20
    [phases]
    boundaries = [[0.05, 0.3]]
    [[regions]]
    name = "head"
    selector = "head.*"
    routes = ["fp32", "int8", "sign"]
    [[regions]]
    name = "backbone"
    selector = "*"
    routes = ["fp32", "int8", "ternary", "sign"]
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from nfabric_cli.calibration.hyperband import HyperbandShape
from nfabric_cli.errors import InputError
from nfabric_cli.profile.phases import phase_names
from nfabric_cli.routes.spec import REDUCERS, ROUNDINGS, ROUTE_NAMES, SIGN_MODES
from nfabric_cli.runtime.health import HealthThresholds
from nfabric_cli.substrate.model import substrate_dict
from nfabric_cli.textfiles import read_toml

SAMPLERS: tuple[str, ...] = ("tpe", "nsga2", "random")
PRUNERS: tuple[str, ...] = ("hyperband", "median", "none")
MAX_WORLD_SIZE = 64
MAX_TRIALS = 10_000
MAX_STEPS = 1_000_000

_TOP_KEYS = {
    "workload", "world_size", "seed", "steps", "eval_every", "tolerance", "trials",
    "sampler", "pruner", "phases", "routes", "regions", "health", "substrate",
    "hyperband_min_resource", "hyperband_reduction_factor", "hyperband_brackets",
}
# budget and search strategy: they change which trials run, never a trial's result
NOT_IN_SEARCH_KEY: tuple[str, ...] = (
    "trials", "sampler", "pruner",
    "hyperband_min_resource", "hyperband_reduction_factor", "hyperband_brackets",
)
_REGION_KEYS = {"name", "selector", "routes"}
_PHASE_KEYS = {"boundaries"}
_ROUTE_KEYS = {"tau", "error_feedback", "reducer", "rounding", "sign_mode"}


@dataclass(frozen=True)
class Region:
    """One profile row per phase: parameters matching `selector` take one of `routes`."""

    name: str
    selector: str
    routes: tuple[str, ...]

    @property
    def cheapest(self) -> str:
        """The route with the fewest bytes on the wire (ROUTE_NAMES is ordered that way)."""
        return max(self.routes, key=ROUTE_NAMES.index)

    @property
    def gentlest_lowbit(self) -> str | None:
        """The least lossy route cheaper than fp32, if the region may take one."""
        cheaper = [r for r in self.routes if r != "fp32"]
        return min(cheaper, key=ROUTE_NAMES.index) if cheaper else None


@dataclass(frozen=True)
class Range:
    """A searched float in [lo, hi] (lo == hi: fixed)."""

    lo: float
    hi: float

    @property
    def fixed(self) -> bool:
        return self.lo == self.hi


@dataclass(frozen=True)
class CalibrationSpec:
    workload: str
    regions: tuple[Region, ...]
    boundaries: tuple[Range, ...] = ()
    tau: Range = Range(0.5, 0.5)
    error_feedback: tuple[bool, ...] = (False,)
    rounding: tuple[str, ...] = ("nearest",)  # int8/int4 rounding choices (searched if > 1)
    sign_mode: tuple[str, ...] = ("majority",)  # sign reducer output choices (searched if > 1)
    reducer: str = "sharded"
    world_size: int = 4
    seed: int = 0
    steps: int = 100
    eval_every: int = 20
    tolerance: float = 0.02
    trials: int = 20
    sampler: str = "tpe"
    pruner: str = "hyperband"
    # Hyperband's shape (see HyperbandShape); None: the default
    hyperband_min_resource: int | None = None
    hyperband_reduction_factor: int | None = None
    hyperband_brackets: int | None = None
    health: dict[str, Any] = field(default_factory=dict)
    substrate: dict[str, Any] = field(default_factory=dict)  # a Substrate's dict; {}: none

    @property
    def phases(self) -> tuple[str, ...]:
        return tuple(phase_names(len(self.boundaries) + 1))

    def checkpoints(self) -> tuple[int, ...]:
        """Steps after which a trial evaluates (the last one is always `steps`)."""
        marks = list(range(self.eval_every, self.steps, self.eval_every))
        return tuple([*marks, self.steps])

    def hyperband_shape(self) -> HyperbandShape:
        """The Hyperband pruner's shape: the spec's keys, else the default: the first cut
        halfway through a trial, reduction factor 2, every bracket that fits. Earlier cuts
        judge on checkpoints where cheap configurations that end out of tolerance still look
        best, and in studies of 8-16 trials pruned the winner (docs/calibration.md)."""
        n_marks = len(self.checkpoints())
        lowest = self.hyperband_min_resource or max(1, n_marks // 2)
        factor = self.hyperband_reduction_factor or 2
        most = HyperbandShape(lowest, factor, 1, n_marks).max_brackets
        return HyperbandShape(lowest, factor, self.hyperband_brackets or most, n_marks)

    def search_key(self) -> str:
        """Hash of everything that decides a trial's result: a resumed study must match it."""
        keep = asdict(self)
        for k in NOT_IN_SEARCH_KEY:
            keep.pop(k)
        # studies made before these keys existed keep their key while the keys are defaults
        for k, default in (("substrate", {}), ("rounding", ["nearest"]),
                           ("sign_mode", ["majority"])):
            if keep[k] == default or keep[k] == tuple(default):
                keep.pop(k)
        text = json.dumps(keep, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(asdict(self), default=str))

    def with_overrides(self, **kw: Any) -> CalibrationSpec:
        """Apply command-line overrides (None means "not given") and re-check the result."""
        given = {k: v for k, v in kw.items() if v is not None}
        return check_spec(replace(self, **given))


def load_spec(path: str | Path, workload: str) -> CalibrationSpec:
    """Parse and check a spec file for `workload` (InputError, one line, on any problem)."""
    p = Path(path)
    data = read_toml(p, "calibration spec")
    if isinstance(data.get("substrate"), str):  # a path, relative to the spec file
        data["substrate"] = str(p.parent / data["substrate"])
    try:
        return parse_spec(data, workload)
    except InputError as exc:
        raise InputError(f"calibration spec {p}: {exc}") from None


def resolve_spec(
    workload: str, head_selector: str, default_steps: int, path: str | Path | None = None
) -> CalibrationSpec:
    """`path` if given; else `calibrate/<workload>.toml` in the current directory or beside the
    package (a source checkout); else `default_spec` (head vs the rest, one phase)."""
    if path is not None:
        return load_spec(path, workload)
    name = f"{workload}.toml"
    for folder in (Path("calibrate"), Path(__file__).resolve().parents[2] / "calibrate"):
        if (folder / name).is_file():
            return load_spec(folder / name, workload)
    return default_spec(workload, head_selector, default_steps)


def default_spec(workload: str, head_selector: str, steps: int) -> CalibrationSpec:
    """A spec for a workload without a file: head vs everything else, one phase."""
    routes = ("fp32", "bf16", "int8", "ternary", "sign")
    regions = (Region("head", head_selector, routes), Region("rest", "*", routes))
    return check_spec(CalibrationSpec(workload, regions, steps=steps, eval_every=max(1, steps // 5)))


def parse_spec(data: dict[str, Any], workload: str) -> CalibrationSpec:
    """A spec from parsed TOML (see the module docstring for the keys)."""
    _no_unknown(data, _TOP_KEYS, "")
    named = data.get("workload")
    if named is not None and named != workload:
        raise InputError(f"spec is for workload {named!r}, not {workload!r}")
    regions_raw = data.get("regions")
    if not isinstance(regions_raw, list) or not regions_raw:
        raise InputError("needs at least one [[regions]] table (name, selector, routes)")
    regions = tuple(_region(r, i) for i, r in enumerate(regions_raw))
    phases = _table(data, "phases", _PHASE_KEYS)
    routes = _table(data, "routes", _ROUTE_KEYS)
    health = _table(data, "health", None)
    HealthThresholds.from_dict(health)  # unknown or out-of-range thresholds fail here
    kw: dict[str, Any] = {}
    for key, kind in (("world_size", int), ("seed", int), ("steps", int), ("eval_every", int),
                      ("trials", int), ("tolerance", float), ("sampler", str), ("pruner", str),
                      ("hyperband_min_resource", int), ("hyperband_reduction_factor", int),
                      ("hyperband_brackets", int)):
        if key in data:
            kw[key] = _typed(data[key], kind, key)
    spec = CalibrationSpec(
        workload=workload,
        regions=regions,
        boundaries=tuple(_boundary(b, i) for i, b in enumerate(phases.get("boundaries", []))),
        tau=_range(routes.get("tau", 0.5), "routes.tau"),
        error_feedback=_ef(routes.get("error_feedback", False)),
        rounding=_choices(routes.get("rounding", "nearest"), ROUNDINGS, "routes.rounding"),
        sign_mode=_choices(routes.get("sign_mode", "majority"), SIGN_MODES, "routes.sign_mode"),
        reducer=_typed(routes.get("reducer", "sharded"), str, "routes.reducer"),
        health=dict(health),
        substrate=substrate_dict(data.get("substrate")),
        **kw,
    )
    if "eval_every" not in data and "steps" in data:
        spec = replace(spec, eval_every=max(1, spec.steps // 5))
    return check_spec(spec)


def check_spec(spec: CalibrationSpec) -> CalibrationSpec:
    """Range checks shared by the file and the command-line overrides."""
    if not 2 <= spec.world_size <= MAX_WORLD_SIZE:
        raise InputError(f"world size must be in [2, {MAX_WORLD_SIZE}], got {spec.world_size}")
    if not 1 <= spec.steps <= MAX_STEPS:
        raise InputError(f"steps must be in [1, {MAX_STEPS}], got {spec.steps}")
    if not 1 <= spec.trials <= MAX_TRIALS:
        raise InputError(f"trials must be in [1, {MAX_TRIALS}], got {spec.trials}")
    if not 1 <= spec.eval_every <= spec.steps:
        raise InputError(f"eval_every must be in [1, steps={spec.steps}], got {spec.eval_every}")
    if not (math.isfinite(spec.tolerance) and 0 < spec.tolerance <= 1):
        raise InputError(f"tolerance must be in (0, 1], got {spec.tolerance}")
    if spec.seed < 0:
        raise InputError(f"seed must be >= 0, got {spec.seed}")
    if spec.sampler not in SAMPLERS:
        raise InputError(f"unknown sampler {spec.sampler!r} (choose from {', '.join(SAMPLERS)})")
    if spec.pruner not in PRUNERS:
        raise InputError(f"unknown pruner {spec.pruner!r} (choose from {', '.join(PRUNERS)})")
    n_marks = len(spec.checkpoints())
    if spec.hyperband_min_resource is not None and not 1 <= spec.hyperband_min_resource <= n_marks:
        raise InputError(f"hyperband_min_resource must be in [1, {n_marks}] (checkpoints per "
                         f"trial), got {spec.hyperband_min_resource}")
    if spec.hyperband_reduction_factor is not None and spec.hyperband_reduction_factor < 2:
        raise InputError(
            f"hyperband_reduction_factor must be an int >= 2, got {spec.hyperband_reduction_factor}"
        )
    shape = spec.hyperband_shape()
    if spec.hyperband_brackets is not None and not 1 <= spec.hyperband_brackets <= shape.max_brackets:
        raise InputError(
            f"hyperband_brackets must be in [1, {shape.max_brackets}] for min_resource "
            f"{shape.min_resource}, reduction factor {shape.reduction_factor} and {n_marks} "
            f"checkpoints, got {spec.hyperband_brackets}"
        )
    if spec.reducer not in REDUCERS:
        raise InputError(f"unknown reducer {spec.reducer!r} (choose from {', '.join(REDUCERS)})")
    if not (0 <= spec.tau.lo <= spec.tau.hi < 1):
        raise InputError(f"routes.tau must lie in [0, 1), got [{spec.tau.lo}, {spec.tau.hi}]")
    names = [r.name for r in spec.regions]
    selectors = [r.selector for r in spec.regions]
    for label, values in (("name", names), ("selector", selectors)):
        dupes = sorted({v for v in values if values.count(v) > 1})
        if dupes:
            raise InputError(f"regions share a {label}: {', '.join(dupes)}")
    previous = 0.0
    for i, b in enumerate(spec.boundaries):
        if not (previous < b.lo <= b.hi < 1):
            raise InputError(
                f"phases.boundaries[{i}] = [{b.lo:g}, {b.hi:g}] must lie in ({previous:g}, 1) "
                "and after the previous boundary"
            )
        previous = b.hi
    return spec


def run_spec(workload: Any, path: str | Path | None = None, *, steps: int | None = None,
             sampler: str | None = None, pruner: str | None = None,
             substrate: Any = None, **overrides: Any) -> CalibrationSpec:
    """The spec `nfabric calibrate` runs: the workload's (`resolve_spec`) with the command
    line's overrides (None: not given). A new `steps` keeps the spec's number of checkpoints;
    `substrate` is a TOML path or table. Refuses a pruner with the multi-objective sampler."""
    base = resolve_spec(workload.name, workload.head_selector, workload.default_steps, path)
    if pruner is not None and (sampler or base.sampler) == "nsga2" and pruner != "none":
        raise InputError("--sampler nsga2 runs a multi-objective study, which Optuna cannot "
                         "prune: use --pruner none")
    every = None if steps is None else max(1, round(base.eval_every * steps / base.steps))
    return base.with_overrides(steps=steps, sampler=sampler, pruner=pruner, eval_every=every,
                               substrate=None if substrate is None else substrate_dict(substrate),
                               **overrides)


# -- parsing helpers --------------------------------------------------------------------------
def _no_unknown(data: dict[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        place = f" in {where}" if where else ""
        raise InputError(
            f"unknown key(s){place}: {', '.join(unknown)} (known: {', '.join(sorted(known))})"
        )


def _table(data: dict[str, Any], key: str, known: set[str] | None) -> dict[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise InputError(f"[{key}] must be a table")
    if known is not None:
        _no_unknown(value, known, f"[{key}]")
    return value


def _typed(value: Any, kind: type, key: str) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InputError(f"{key} must be {kind.__name__}, got {value!r}")
    return value


def _region(raw: Any, i: int) -> Region:
    where = f"regions[{i}]"
    if not isinstance(raw, dict):
        raise InputError(f"{where} must be a table with name, selector, routes")
    _no_unknown(raw, _REGION_KEYS, where)
    missing = [k for k in ("name", "selector", "routes") if k not in raw]
    if missing:
        raise InputError(f"{where} is missing {', '.join(missing)}")
    name = _typed(raw["name"], str, f"{where}.name").strip()
    selector = _typed(raw["selector"], str, f"{where}.selector").strip()
    if not name or not selector:
        raise InputError(f"{where}: name and selector must not be empty")
    routes = raw["routes"]
    if not isinstance(routes, list) or not routes or not all(isinstance(r, str) for r in routes):
        raise InputError(f"{where}.routes must be a non-empty list of route names")
    unknown = [r for r in routes if r not in ROUTE_NAMES]
    if unknown:
        raise InputError(
            f"{where} ({name}): unknown route {unknown[0]!r} (choose from {', '.join(ROUTE_NAMES)})"
        )
    if len(set(routes)) != len(routes):
        raise InputError(f"{where} ({name}): a route is listed twice")
    return Region(name, selector, tuple(routes))


def _range(value: Any, key: str) -> Range:
    if isinstance(value, list):
        if len(value) != 2:
            raise InputError(f"{key} must be a number or a [lo, hi] pair, got {value!r}")
        lo, hi = (_typed(v, float, key) for v in value)
        if not lo <= hi:
            raise InputError(f"{key}: lo {lo:g} must not exceed hi {hi:g}")
        return Range(lo, hi)
    v = _typed(value, float, key)
    return Range(v, v)


def _boundary(value: Any, i: int) -> Range:
    return _range(value, f"phases.boundaries[{i}]")


def _ef(value: Any) -> tuple[bool, ...]:
    if isinstance(value, bool):
        return (value,)
    if isinstance(value, list) and value and all(isinstance(v, bool) for v in value):
        return tuple(dict.fromkeys(value))
    raise InputError(f"routes.error_feedback must be true, false or [false, true], got {value!r}")


def _choices(value: Any, allowed: tuple[str, ...], key: str) -> tuple[str, ...]:
    """A fixed option (a string) or the options to search (a list), each one of `allowed`."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(v, str) for v in items):
        raise InputError(f"{key} must be a name or a list of names, got {value!r}")
    bad = [v for v in items if v not in allowed]
    if bad:
        raise InputError(f"{key}: unknown {bad[0]!r} (choose from {', '.join(allowed)})")
    return tuple(dict.fromkeys(items))
