"""Training phases: named fractions [start, end) of a run that a profile routes differently.

A profile's phases tile [0, 1] without gaps; the last phase also contains 1.0, so the final
step of a run always has a phase.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

from nfabric_cli.errors import InputError


@dataclass(frozen=True)
class Phase:
    """One phase: ``name`` covers run fractions ``[start, end)`` (the last one ``[start, 1]``)."""

    name: str
    start: float
    end: float

    def contains(self, fraction: float, last: bool = False) -> bool:
        return self.start <= fraction < self.end or (last and fraction >= self.end)


def phase_names(count: int) -> list[str]:
    """Names for `count` phases: all | warmup, main | warmup, main, final | warmup, main1.., final."""
    if count < 1:
        raise InputError("a profile needs at least one phase")
    if count == 1:
        return ["all"]
    if count == 2:
        return ["warmup", "main"]
    if count == 3:
        return ["warmup", "main", "final"]
    return ["warmup", *[f"main{i}" for i in range(1, count - 1)], "final"]


def parse_phases(text: str | None) -> list[Phase]:
    """``"0.1,0.8"`` -> warmup [0, 0.1), main [0.1, 0.8), final [0.8, 1]; None or "" -> all."""
    if text is None or not text.strip():
        return [Phase("all", 0.0, 1.0)]
    try:
        bounds = [float(part) for part in text.split(",")]
    except ValueError:
        raise InputError(
            f"--phases {text!r}: expected comma-separated fractions like 0.1,0.8"
        ) from None
    if any(not 0.0 < b < 1.0 for b in bounds) or any(a >= b for a, b in pairwise(bounds)):
        raise InputError(
            f"--phases {text!r}: boundaries must be strictly increasing and inside (0, 1)"
        )
    edges = [0.0, *bounds, 1.0]
    names = phase_names(len(edges) - 1)
    return [Phase(n, s, e) for n, (s, e) in zip(names, pairwise(edges), strict=True)]


def check_tiling(phases: list[Phase]) -> None:
    """Raise InputError unless `phases` (sorted by start) tile [0, 1] with unique names."""
    if not phases:
        raise InputError("profile has no rows (no phases)")
    names = [p.name for p in phases]
    if len(set(names)) != len(names):
        raise InputError(f"phase names are not unique: {', '.join(names)}")
    if phases[0].start != 0.0 or phases[-1].end != 1.0:
        raise InputError(
            f"phases must cover [0, 1]; they cover [{phases[0].start:g}, {phases[-1].end:g}]"
        )
    for a, b in pairwise(phases):
        if a.end != b.start:
            raise InputError(
                f"phases {a.name!r} and {b.name!r} leave a gap or overlap "
                f"({a.name} ends at {a.end:g}, {b.name} starts at {b.start:g})"
            )
    for p in phases:
        if not p.start < p.end:
            raise InputError(f"phase {p.name!r} is empty: [{p.start:g}, {p.end:g})")


def phase_at(phases: list[Phase], step: int, total_steps: int) -> Phase:
    """The phase containing ``step / total_steps`` (the last phase includes 1.0 and beyond)."""
    if total_steps is None or total_steps < 1:
        raise InputError(f"total steps must be >= 1 to find a phase, got {total_steps}")
    if step < 0:
        raise InputError(f"step must be >= 0, got {step}")
    fraction = step / total_steps
    for i, phase in enumerate(phases):
        if phase.contains(fraction, last=i == len(phases) - 1):
            return phase
    raise InputError(f"no phase contains step {step} of {total_steps}")  # unreachable if tiled
