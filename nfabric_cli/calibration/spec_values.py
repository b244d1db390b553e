"""Reading a spec's TOML values: each helper checks one kind of value and raises an
`InputError` that names the key (`spec.py` assembles the spec from them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nfabric_cli.errors import InputError
from nfabric_cli.routes.spec import ROUTE_NAMES

_REGION_KEYS = {"name", "selector", "routes"}


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


def no_unknown(data: dict[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(data) - known)
    if unknown:
        place = f" in {where}" if where else ""
        raise InputError(
            f"unknown key(s){place}: {', '.join(unknown)} (known: {', '.join(sorted(known))})"
        )


def table(data: dict[str, Any], key: str, known: set[str] | None) -> dict[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise InputError(f"[{key}] must be a table")
    if known is not None:
        no_unknown(value, known, f"[{key}]")
    return value


def typed(value: Any, kind: type, key: str) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InputError(f"{key} must be {kind.__name__}, got {value!r}")
    return value


def region(raw: Any, i: int) -> Region:
    where = f"regions[{i}]"
    if not isinstance(raw, dict):
        raise InputError(f"{where} must be a table with name, selector, routes")
    no_unknown(raw, _REGION_KEYS, where)
    missing = [k for k in ("name", "selector", "routes") if k not in raw]
    if missing:
        raise InputError(f"{where} is missing {', '.join(missing)}")
    name = typed(raw["name"], str, f"{where}.name").strip()
    selector = typed(raw["selector"], str, f"{where}.selector").strip()
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


def value_range(value: Any, key: str) -> Range:
    if isinstance(value, list):
        if len(value) != 2:
            raise InputError(f"{key} must be a number or a [lo, hi] pair, got {value!r}")
        lo, hi = (typed(v, float, key) for v in value)
        if not lo <= hi:
            raise InputError(f"{key}: lo {lo:g} must not exceed hi {hi:g}")
        return Range(lo, hi)
    v = typed(value, float, key)
    return Range(v, v)


def boundaries(value: Any) -> tuple[Range, ...]:
    """`phases.boundaries`: a list of fractions or [lo, hi] ranges, one per phase change."""
    if not isinstance(value, list):
        raise InputError("phases.boundaries must be a list of fractions or [lo, hi] ranges, "
                         f"like [[0.05, 0.3]], got {value!r}")
    return tuple(value_range(b, f"phases.boundaries[{i}]") for i, b in enumerate(value))


def ints(value: Any, key: str) -> tuple[int, ...]:
    """A list of integers (an integer alone: a list of one), repeats dropped."""
    items = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(items, list):
        raise InputError(f"{key} must be a list of integers, got {value!r}")
    return tuple(dict.fromkeys(typed(v, int, key) for v in items))


def error_feedback(value: Any) -> tuple[bool, ...]:
    if isinstance(value, bool):
        return (value,)
    if isinstance(value, list) and value and all(isinstance(v, bool) for v in value):
        return tuple(dict.fromkeys(value))
    raise InputError(f"routes.error_feedback must be true, false or [false, true], got {value!r}")


def choices(value: Any, allowed: tuple[str, ...], key: str) -> tuple[str, ...]:
    """A fixed option (a string) or the options to search (a list), each one of `allowed`."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(v, str) for v in items):
        raise InputError(f"{key} must be a name or a list of names, got {value!r}")
    bad = [v for v in items if v not in allowed]
    if bad:
        raise InputError(f"{key}: unknown {bad[0]!r} (choose from {', '.join(allowed)})")
    return tuple(dict.fromkeys(items))
