"""Semantic diff of two profiles, keyed on (region, phase), for humans and for CI.

Row changes are listed field by field; metadata changes are flattened to dotted keys
(``target.tolerance``). Provenance (where a profile came from: seed, versions, git revision,
profile and schema version) is listed apart so CI can ignore it; calibration evidence
(`traffic_fraction`, `metric_delta`, `trials`, and what confirmation measured on each cell)
can be ignored too.

Route options of a route both rows share, and the health thresholds, compare as the runtime
takes them and print so: an option or threshold left unset shows the value it stands for (its
default, or for a calibrated profile that predates a threshold the value that keeps the rule it
was proven with), not "-"; an unset value and that value written out are no change.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from nfabric_cli.profile.operating import PROVENANCE_KEYS, ROW_FIELDS, OperatingProfile
from nfabric_cli.profile.thresholds import HealthThresholds
from nfabric_cli.routes.spec import RouteSpec

EVIDENCE_FIELDS: tuple[str, ...] = ("traffic_fraction", "metric_delta", "trials")
#: What confirmation measured (`meta.proven`): evidence too. Its seeds, lengths, world size and
#: rule, the range a profile claims, are metadata.
EVIDENCE_META: tuple[str, ...] = ("proven.cells", "proven.worst_degradation", "proven.bound95",
                                  "proven.validate_bound95")
LONG_LIST = 8  # longer lists print as their length in tables (the JSON keeps them whole)
_COMPARED = tuple(f for f in ROW_FIELDS if f not in ("region", "phase"))
#: Route options of the same route, compared as it takes them: an unset `tau` and tau = 0.5
#: (its default) are the same route, not a change for CI to fail on.
_OPTIONS = tuple(f.name for f in fields(RouteSpec) if f.name != "name")


@dataclass(frozen=True)
class RowChange:
    """A row added (a is None), removed (b is None) or one field changed."""

    region: str
    phase: str
    field: str  # "row" for added/removed rows
    a: Any
    b: Any
    kind: str  # "added" | "removed" | "changed"


@dataclass(frozen=True)
class MetaChange:
    key: str
    a: Any
    b: Any


@dataclass
class ProfileDiff:
    changes: list[RowChange] = field(default_factory=list)
    metadata: list[MetaChange] = field(default_factory=list)
    provenance: list[MetaChange] = field(default_factory=list)
    ignore_provenance: bool = False

    @property
    def equal(self) -> bool:
        quiet_provenance = self.ignore_provenance or not self.provenance
        return not self.changes and not self.metadata and quiet_provenance

    def to_dict(self) -> dict[str, Any]:
        return {
            "equal": self.equal,
            "changes": [asdict(c) for c in self.changes],
            "metadata": [asdict(m) for m in self.metadata],
            "provenance": [asdict(m) for m in self.provenance],
            "provenance_ignored": self.ignore_provenance,
        }

    def to_markdown(self) -> str:
        """A pull-request comment: one table of row changes, one of metadata changes."""
        if self.equal:
            note = " (provenance differs, ignored)" if self.provenance else ""
            return f"**nfabric profile diff:** no changes{note}.\n"
        out = ["**nfabric profile diff**", ""]
        if self.changes:
            out += ["| region | phase | field | A | B |", "|---|---|---|---|---|"]
            out += [
                f"| `{c.region}` | {c.phase} | {c.kind if c.field == 'row' else c.field} "
                f"| {_md(c.a)} | {_md(c.b)} |"
                for c in self.changes
            ]
            out.append("")
        for title, items in (("metadata", self.metadata), ("provenance", self.provenance)):
            if items and not (title == "provenance" and self.ignore_provenance):
                out += [f"| {title} | A | B |", "|---|---|---|"]
                out += [f"| `{m.key}` | {_md(m.a)} | {_md(m.b)} |" for m in items]
                out.append("")
        return "\n".join(out)


def format_value(value: Any) -> str:
    """Compact text for a cell: None -> '-', floats with %g, dicts as k=v (non-null only)."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, dict):
        text = ", ".join(f"{k}={format_value(v)}" for k, v in value.items() if v is not None)
        return text or "-"
    if isinstance(value, list) and len(value) > LONG_LIST:  # e.g. a model's parameter list
        return f"[{len(value)} items]"
    return str(value)


def _md(value: Any) -> str:
    return format_value(value).replace("|", "\\|")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def flatten(meta: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"target": {"tolerance": 0.01}} -> {"target.tolerance": 0.01} (lists kept whole).

    An empty dict contributes no key, so ``health: {}`` and an absent ``health`` are equal.
    """
    flat: dict[str, Any] = {}
    for key in sorted(meta):
        value = meta[key]
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def diff_profiles(
    a: OperatingProfile,
    b: OperatingProfile,
    ignore_provenance: bool = False,
    ignore_evidence: bool = False,
) -> ProfileDiff:
    """Compare two profiles; `ProfileDiff.equal` is what CI gates on."""
    diff = ProfileDiff(ignore_provenance=ignore_provenance)
    rows_a = {r.key: r for r in a.rows}
    rows_b = {r.key: r for r in b.rows}
    keys = sorted(
        set(rows_a) | set(rows_b),
        key=lambda k: ((rows_a.get(k) or rows_b[k]).phase_start, k[1], k[0]),
    )
    compared = [f for f in _COMPARED if not (ignore_evidence and f in EVIDENCE_FIELDS)]
    for region, phase in keys:
        ra, rb = rows_a.get((region, phase)), rows_b.get((region, phase))
        if ra is None or rb is None:
            row = (rb or ra).to_dict()  # type: ignore[union-attr]
            body = {k: row[k] for k in compared}
            kind = "added" if ra is None else "removed"
            old, new = (None, body) if ra is None else (body, None)
            diff.changes.append(RowChange(region, phase, "row", old, new, kind))
            continue
        spec_a, spec_b = ra.spec(), rb.spec()
        for name in compared:
            va, vb = getattr(ra, name), getattr(rb, name)
            if name in _OPTIONS and ra.route == rb.route:  # (another route: as written)
                va, vb = getattr(spec_a, name), getattr(spec_b, name)
            if not _same(va, vb):
                diff.changes.append(RowChange(region, phase, name, va, vb, "changed"))
    flat_a, flat_b = flatten(_as_taken(a.meta)), flatten(_as_taken(b.meta))
    for key in sorted(set(flat_a) | set(flat_b)):
        va, vb = flat_a.get(key), flat_b.get(key)
        if _same(va, vb) or (ignore_evidence and key.startswith(EVIDENCE_META)):
            continue
        target = diff.provenance if key.split(".")[0] in PROVENANCE_KEYS else diff.metadata
        target.append(MetaChange(key, va, vb))
    return diff


def _as_taken(meta: dict[str, Any]) -> dict[str, Any]:
    """`meta` with its health thresholds as the monitor takes them (every one, defaults and
    predated values filled in: `HealthThresholds.from_profile`)."""
    return {**meta, "health": HealthThresholds.from_profile(meta).to_dict()}
