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
    [confirm]            # the winner must also hold on these seeds and lengths (choice.py)
    seeds = [1, 2]
    steps = [240]
    world_sizes = [2]    # and at these world sizes besides the search's
    candidates = 3
    repairs = 1          # when none holds: rounds raising one region of the cheapest to fp32
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from nfabric_cli.calibration.hyperband import HyperbandShape
from nfabric_cli.calibration.spec_values import (
    Range,
    Region,
    boundaries,
    choices,
    error_feedback,
    ints,
    no_unknown,
    region,
    table,
    typed,
    value_range,
)
from nfabric_cli.errors import InputError
from nfabric_cli.profile.phases import phase_names
from nfabric_cli.profile.thresholds import HealthThresholds
from nfabric_cli.routes.spec import REDUCERS, ROUNDINGS, SIGN_MODES
from nfabric_cli.substrate.model import substrate_dict
from nfabric_cli.textfiles import read_toml
from nfabric_cli.workloads.common import check_seed

SAMPLERS: tuple[str, ...] = ("tpe", "nsga2", "random")
PRUNERS: tuple[str, ...] = ("hyperband", "median", "none")
MAX_WORLD_SIZE = 64
MAX_TRIALS = 10_000
MAX_STEPS = 1_000_000

_TOP_KEYS = {
    "workload", "world_size", "seed", "steps", "eval_every", "tolerance", "trials",
    "sampler", "pruner", "phases", "routes", "regions", "health", "substrate",
    "hyperband_min_resource", "hyperband_reduction_factor", "hyperband_brackets", "confirm",
}
# budget, search strategy and confirmation: they change which trials run and which one wins,
# never a trial's result (a study confirmed later, or on more seeds, keeps its trials)
NOT_IN_SEARCH_KEY: tuple[str, ...] = (
    "trials", "sampler", "pruner",
    "hyperband_min_resource", "hyperband_reduction_factor", "hyperband_brackets",
    "confirm_seeds", "confirm_steps", "confirm_world_sizes", "confirm_candidates", "confirm_rule",
    "confirm_repairs", "confirm_validate_seeds",
)
_CONFIRM_KEYS = {"seeds", "steps", "world_sizes", "candidates", "rule", "repairs",
                 "validate_seeds"}
MAX_REPAIRS = 8
CONFIRM_RULES: tuple[str, ...] = ("worst", "bound", "validate")
MAX_CONFIRM_CELLS = 64
_PHASE_KEYS = {"boundaries"}
_ROUTE_KEYS = {"tau", "error_feedback", "reducer", "rounding", "sign_mode"}


class Cell(NamedTuple):
    """One confirmation run's setting (`choice.py`): seed, length, and the world size when it
    is not the search's own (None)."""

    seed: int
    steps: int
    world_size: int | None = None

    def ranks(self, home: int) -> int:
        """The world size it runs at, `home` being the search's."""
        return self.world_size or home


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
    # confirmation (choice.py): the leading candidates retrained on these seeds and lengths,
    # at the search's world size and these others
    confirm_seeds: tuple[int, ...] = ()
    confirm_steps: tuple[int, ...] = ()
    confirm_world_sizes: tuple[int, ...] = ()
    confirm_candidates: int = 3
    # "worst" cell; the 95 % prediction "bound" for one more seed; or "validate": every cell,
    # and the worst of `confirm_validate_seeds` more seeds at 95 % (`target.validation_bound`)
    confirm_rule: str = "worst"
    confirm_validate_seeds: int = 5
    # when no candidate holds: rounds of repairs (`repair.py`), each the cheapest failure with
    # one more region on fp32
    confirm_repairs: int = 1

    @property
    def phases(self) -> tuple[str, ...]:
        return tuple(phase_names(len(self.boundaries) + 1))

    def confirm_cells(self) -> list[Cell]:
        """The cells the leading candidates are retrained on (`choice.py`): the spec's grid
        (`grid_cells`), or none for a multi-objective (nsga2) study, which has a Pareto front,
        not a list of candidates, and is proven on the search's own cell alone. Every part of
        calibration that confirms asks this, so the rule lives here once."""
        return [] if self.sampler == "nsga2" else self.grid_cells()

    @property
    def every_cell_within(self) -> bool:
        """Whether the confirmation rule fails a candidate at its first cell outside tolerance
        (`worst`, `validate`), so it need not train the rest."""
        return self.confirm_rule != "bound"

    def confirm_ignored(self) -> bool:
        """Whether the spec sets a confirmation grid that this study will not train (nsga2)."""
        return self.sampler == "nsga2" and bool(self.grid_cells())

    def grid_cells(self) -> list[Cell]:
        """The `[confirm]` grid as written: every seed times every length at the search's
        world size, less the search's own cell, then the whole grid at each other world size
        of `confirm_world_sizes` (a cell's `world_size` None: the search's). A grid that is
        only other world sizes also confirms at the search's seed and length."""
        seeds = list(dict.fromkeys([self.seed, *self.confirm_seeds]))
        lengths = list(dict.fromkeys([self.steps, *self.confirm_steps]))
        others = [w for w in dict.fromkeys(self.confirm_world_sizes) if w != self.world_size]
        home = [Cell(s, n) for s in seeds for n in lengths if (s, n) != (self.seed, self.steps)]
        return home + [Cell(s, n, w) for w in others for s in seeds for n in lengths]

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


#: What a workload without a spec file is confirmed on (`default_spec`): two more seeds, and
#: two ranks, `validate`'s default, beside the search's four.
DEFAULT_CONFIRM_SEEDS, DEFAULT_CONFIRM_WORLD_SIZES = (1, 2), (2,)


def default_spec(workload: str, head_selector: str, steps: int) -> CalibrationSpec:
    """A spec for a workload without a file: head vs everything else, one phase, and the
    leading candidates confirmed on seeds 1 and 2 and at two ranks (a winner picked on one
    seed is picked *for* passing there: issue 15). `--confirm-seeds none
    --confirm-world-sizes none` turns it off."""
    routes = ("fp32", "bf16", "int8", "ternary", "sign")
    regions = (Region("head", head_selector, routes), Region("rest", "*", routes))
    return check_spec(CalibrationSpec(workload, regions, steps=steps, eval_every=max(1, steps // 5),
                                      confirm_seeds=DEFAULT_CONFIRM_SEEDS,
                                      confirm_world_sizes=DEFAULT_CONFIRM_WORLD_SIZES))


def parse_spec(data: dict[str, Any], workload: str) -> CalibrationSpec:
    """A spec from parsed TOML (see the module docstring for the keys)."""
    no_unknown(data, _TOP_KEYS, "")
    named = data.get("workload")
    if named is not None and named != workload:
        raise InputError(f"spec is for workload {named!r}, not {workload!r}")
    regions_raw = data.get("regions")
    if not isinstance(regions_raw, list) or not regions_raw:
        raise InputError("needs at least one [[regions]] table (name, selector, routes)")
    regions = tuple(region(r, i) for i, r in enumerate(regions_raw))
    phases = table(data, "phases", _PHASE_KEYS)
    routes = table(data, "routes", _ROUTE_KEYS)
    health = table(data, "health", None)
    HealthThresholds.from_dict(health)  # unknown or out-of-range thresholds fail here
    confirm = table(data, "confirm", _CONFIRM_KEYS)
    kw: dict[str, Any] = {}
    for key, kind in (("world_size", int), ("seed", int), ("steps", int), ("eval_every", int),
                      ("trials", int), ("tolerance", float), ("sampler", str), ("pruner", str),
                      ("hyperband_min_resource", int), ("hyperband_reduction_factor", int),
                      ("hyperband_brackets", int)):
        if key in data:
            kw[key] = typed(data[key], kind, key)
    spec = CalibrationSpec(
        workload=workload,
        regions=regions,
        boundaries=boundaries(phases.get("boundaries", [])),
        tau=value_range(routes.get("tau", 0.5), "routes.tau"),
        error_feedback=error_feedback(routes.get("error_feedback", False)),
        rounding=choices(routes.get("rounding", "nearest"), ROUNDINGS, "routes.rounding"),
        sign_mode=choices(routes.get("sign_mode", "majority"), SIGN_MODES, "routes.sign_mode"),
        reducer=typed(routes.get("reducer", "sharded"), str, "routes.reducer"),
        health=dict(health),
        substrate=substrate_dict(data.get("substrate")),
        confirm_seeds=ints(confirm.get("seeds", []), "confirm.seeds"),
        confirm_steps=ints(confirm.get("steps", []), "confirm.steps"),
        confirm_world_sizes=ints(confirm.get("world_sizes", []), "confirm.world_sizes"),
        confirm_candidates=typed(confirm.get("candidates", 3), int, "confirm.candidates"),
        confirm_rule=typed(confirm.get("rule", "worst"), str, "confirm.rule"),
        confirm_repairs=typed(confirm.get("repairs", 1), int, "confirm.repairs"),
        confirm_validate_seeds=typed(confirm.get("validate_seeds", 5), int,
                                     "confirm.validate_seeds"),
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
    check_seed(spec.seed, "seed")
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
    for s in spec.confirm_seeds:
        check_seed(s, "confirm.seeds")
    if any(not 1 <= n <= MAX_STEPS for n in spec.confirm_steps):
        raise InputError(f"confirm.steps must each be in [1, {MAX_STEPS}], got "
                         f"{list(spec.confirm_steps)}")
    if any(not 2 <= w <= MAX_WORLD_SIZE for w in spec.confirm_world_sizes):
        raise InputError(f"confirm.world_sizes must each be in [2, {MAX_WORLD_SIZE}], got "
                         f"{list(spec.confirm_world_sizes)}")
    if spec.confirm_rule not in CONFIRM_RULES:
        raise InputError(f"confirm.rule: one of {', '.join(CONFIRM_RULES)}, got "
                         f"{spec.confirm_rule!r}")
    if not 1 <= spec.confirm_validate_seeds <= 100:
        raise InputError(f"confirm.validate_seeds must be in [1, 100], got "
                         f"{spec.confirm_validate_seeds}")
    if not 1 <= spec.confirm_candidates <= 100:
        raise InputError(f"confirm.candidates must be in [1, 100], got {spec.confirm_candidates}")
    if not 0 <= spec.confirm_repairs <= MAX_REPAIRS:
        raise InputError(f"confirm.repairs must be in [0, {MAX_REPAIRS}], got "
                         f"{spec.confirm_repairs}")
    cells = len(spec.grid_cells())
    if cells > MAX_CONFIRM_CELLS:
        raise InputError(f"confirm: {cells} cells (seeds x lengths x world sizes) is more than "
                         f"{MAX_CONFIRM_CELLS}")
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
