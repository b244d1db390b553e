"""The operating profile in memory: rows (region x phase -> route) plus metadata.

A profile is an ordered rule list per phase: within a phase, rules apply by ``priority`` and
the first rule whose region selector matches a parameter wins; the last rule is usually the
default ``*``. Profiles are data only: selectors are resolved against a model by
`nfabric_cli.binding.compile_profile`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from nfabric_cli.errors import InputError
from nfabric_cli.profile.phases import Phase, check_tiling
from nfabric_cli.profile.schema import SCHEMA_VERSION
from nfabric_cli.profile.thresholds import HealthThresholds
from nfabric_cli.routes.spec import DEFAULT_TAU, LOWBIT_ROUTES, RouteSpec

#: Every metadata key a profile carries (missing ones are filled with these defaults).
META_DEFAULTS: dict[str, Any] = {
    "schema_version": SCHEMA_VERSION,
    "profile_version": 1,
    "workload": None,
    "model_fingerprint": None,
    "world_size": None,
    "substrate": None,
    "health": {},
    "target": None,
    "provenance": {},
}
#: Metadata that says where a profile came from, not what it decides (`--ignore-provenance`).
PROVENANCE_KEYS: tuple[str, ...] = ("provenance", "profile_version", "schema_version")
TARGET_KEYS: tuple[str, ...] = ("metric", "reference", "tolerance", "higher_is_better")


@dataclass(frozen=True)
class ProfileRow:
    """One rule: in `phase`, parameters matching `region` take `route` with these options.

    The evidence columns (`traffic_fraction`, `metric_delta`, `trials`) are what calibration
    measured for this row; they are None in hand-written profiles.
    """

    region: str
    phase: str
    phase_start: float
    phase_end: float
    priority: int
    route: str
    tau: float | None = None
    chunk: int | None = None
    error_feedback: bool = False
    reducer: str = "sharded"
    traffic_fraction: float | None = None
    metric_delta: float | None = None
    trials: int | None = None
    rounding: str | None = None
    mode: str | None = None
    zeros: str | None = None  # sign's zero vote; None: "split" (spec.py, ZERO_VOTES)

    def spec(self) -> RouteSpec:
        """The route this row selects (raises InputError for an unknown route or option)."""
        return RouteSpec(
            name=self.route,
            tau=DEFAULT_TAU if self.tau is None else float(self.tau),
            chunk=self.chunk,
            error_feedback=bool(self.error_feedback),
            reducer=self.reducer,
            rounding=self.rounding or "nearest",
            mode=self.mode or "majority",
            zeros=self.zeros or "split",
        )

    @property
    def key(self) -> tuple[str, str]:
        return (self.region, self.phase)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


ROW_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(ProfileRow))


def route_row(region: str, phase: Phase, priority: int, route: str, *,
              tau: float | None = None, error_feedback: bool = False, reducer: str = "sharded",
              rounding: str | None = None, mode: str | None = None,
              zeros: str | None = None, any_lossy: bool = False,
              **evidence: Any) -> ProfileRow:
    """A row for `route` with each option set only where the route uses it, and defaults left
    unset (so profiles diff as they always did): `tau` for ternary, `rounding` for int8/int4
    when not nearest, `mode` and `zeros` for sign when not majority and split, error feedback
    and the reducer for the low-bit routes (with `any_lossy`, as `profile init` writes them:
    for every route but fp32). `evidence`: traffic_fraction, metric_delta, trials. The one
    rule hand-written
    (`binding/static.py`) and calibrated (`calibration/space.py`) rows share."""
    lowbit = route != "fp32" if any_lossy else route in LOWBIT_ROUTES
    return ProfileRow(
        region=region, phase=phase.name, phase_start=phase.start, phase_end=phase.end,
        priority=priority, route=route,
        tau=tau if route == "ternary" else None,
        error_feedback=bool(error_feedback) and lowbit,
        reducer=reducer if lowbit else "sharded",
        rounding=rounding if route in ("int8", "int4") and rounding not in (None, "nearest")
        else None,
        mode=mode if route == "sign" and mode not in (None, "majority") else None,
        zeros=zeros if route == "sign" and zeros not in (None, "split") else None,
        **evidence,
    )


@dataclass
class OperatingProfile:
    """Rows plus metadata (see META_DEFAULTS for the keys). Construct, then `validate()`."""

    rows: list[ProfileRow]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.meta = {**META_DEFAULTS, **self.meta}

    def sorted_rows(self) -> list[ProfileRow]:
        """Rows in canonical order: by phase start, then priority (how they are written)."""
        return sorted(self.rows, key=lambda r: (r.phase_start, r.priority, r.region))

    def phases(self) -> list[Phase]:
        seen: dict[str, Phase] = {}
        for row in self.sorted_rows():
            phase = Phase(row.phase, float(row.phase_start), float(row.phase_end))
            if seen.setdefault(row.phase, phase) != phase:
                raise InputError(
                    f"phase {row.phase!r} has rows with different bounds: "
                    f"[{seen[row.phase].start:g}, {seen[row.phase].end:g}) and "
                    f"[{phase.start:g}, {phase.end:g})"
                )
        return sorted(seen.values(), key=lambda p: p.start)

    def rules(self, phase: str) -> list[ProfileRow]:
        """The rules of `phase` in priority order (first match wins)."""
        return [r for r in self.sorted_rows() if r.phase == phase]

    def validate(self) -> OperatingProfile:
        """Raise InputError on an inconsistent profile; return self for chaining."""
        keys = [r.key for r in self.rows]
        dupes = sorted({k for k in keys if keys.count(k) > 1})
        if dupes:
            raise InputError(
                "duplicate (region, phase) rows: " + ", ".join(f"{r!r}@{p}" for r, p in dupes)
            )
        prios = [(r.phase, r.priority) for r in self.rows]
        clash = sorted({p for p in prios if prios.count(p) > 1})
        if clash:
            raise InputError(
                "rows share a priority within a phase (a parameter would be claimed twice): "
                + ", ".join(f"{ph} priority {pr}" for ph, pr in clash)
            )
        for row in self.rows:
            if not row.region.strip():
                raise InputError(f"empty region selector in phase {row.phase!r}")
            row.spec()
        check_tiling(self.phases())
        check_meta(self.meta)
        return self


def check_meta(meta: dict[str, Any]) -> None:
    """Raise InputError on a profile's metadata of the wrong shape: a profile's, or the copy
    a bindings file carries (`binding/store.py`). The monitor's thresholds too, checked where
    the file is read (show, compile, validate before any rank starts), not first in the ranks
    at attach."""
    for key in ("target", "health", "provenance", "substrate", "proven"):
        value = meta.get(key)
        if value is not None and not isinstance(value, dict):
            raise InputError(f"profile {key} must be a table of keys and values, got "
                             f"{type(value).__name__} {value!r:.60}")
    HealthThresholds.from_profile(meta)
    target = meta.get("target")
    if target is not None:
        missing = [k for k in TARGET_KEYS if k not in target]
        if missing:
            raise InputError(f"profile target is missing {', '.join(missing)}")
    ws = meta.get("world_size")
    if ws is not None and (not isinstance(ws, int) or isinstance(ws, bool) or ws < 1):
        raise InputError(f"profile world_size must be a positive integer, got {ws!r}")
