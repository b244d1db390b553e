"""`Substrate`: the fabric a DDP job communicates over, as the cost model sees it.

Units (kept in the key names' spirit, spelled out here because they differ):
- `link_gbps`, `endpoint_gbps`: Gbit/s, one direction of one rank's link (network speeds).
- `encode_gbps`, `decode_gbps`: GB/s (10^9 bytes/s) of fp32 gradient (codec speeds, as
  `nfabric bench routes` measures them).
- `latency_us`: microseconds per message hop (the α of the α-β model).
- `latency_us_by_kind`: microseconds per latency round of one collective kind (replaces α for
  the kinds it names; `substrate/cost.py` says how many rounds each kind takes).
- `codec_call_us`: microseconds a route's reduce costs once per call, whatever its size
  (encode / combine / decode call overhead, the Python of the route's flow).

A substrate is a TOML file (`load_substrate` / `save_substrate`) or a dict inside a profile's
metadata (`Substrate.from_dict` / `to_dict`); both reject unknown keys and bad values with one
`InputError` line, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from nfabric_cli.atomic import atomic_write_text
from nfabric_cli.errors import InputError
from nfabric_cli.routes.plan import OP_KINDS
from nfabric_cli.routes.spec import ROUTE_NAMES
from nfabric_cli.textfiles import read_json, read_toml

TOPOLOGIES: tuple[str, ...] = ("sharded", "central")

#: Codec throughput in GB/s of fp32 gradient (for `reduce`: of fp32-equivalent contributions
#: combined, result packing included; for `decode`: unpacking the combined result to fp32),
#: and the fixed cost of one reduce call in microseconds, whatever its size. Measured on the
#: development host (2-core x86-64 VM shared with other jobs, load 2.5-3.5; native AVX2
#: kernels; one thread per rank) on 2026-11-30 with `nfabric replay`'s machinery: every route's
#: real reducer, sharded and central, at W = 2 on unshaped loopback, 1e3 to 4.2e6 elements.
#: Rates: bytes / (seconds - fixed) at 4,194,304 elements, rounded down to 2 digits (DDP
#: buckets are 1-25 MB); fixed costs: the affine fit's intercept over 1e3..1e5 elements
#: (about half on an idle host; x1.3 at W = 4 on these 2 cores). Decode (code routes) was
#: re-measured after the reduce path learned to decode straight from the packed combined
#: result (`nf_decode_codes`): `nfabric bench routes` "reduce decode" at W = 4, 1M-4M
#: elements, load 1-5: sign 9.7-13.1, int8 8.6-8.7, int4 10.2-10.5, ternary 9.8-10.3 GB/s;
#: the defaults are the lower ends, rounded down. fp32 has no codec; 16-bit routes reduce
#: inside the all-reduce. Codecs change: measure this host with `nfabric replay`.
DEFAULT_ENCODE_GBPS: dict[str, float] = {
    "bf16": 1.1, "fp16": 1.3, "int8": 5.0, "int4": 3.2, "ternary": 2.0, "sign": 5.2,
}
DEFAULT_REDUCE_GBPS: dict[str, float] = {
    "bf16": 10.0, "fp16": 10.0, "int8": 0.71, "int4": 0.77, "ternary": 0.69, "sign": 0.59,
}
DEFAULT_DECODE_GBPS: dict[str, float] = {
    "bf16": 5.7, "fp16": 1.4, "int8": 8.0, "int4": 10.0, "ternary": 9.0, "sign": 9.0,
}
DEFAULT_CODEC_CALL_US: dict[str, float] = {
    "bf16": 180.0, "fp16": 200.0, "int8": 790.0, "int4": 880.0, "ternary": 1100.0, "sign": 990.0,
}
CODEC_TABLES: tuple[str, ...] = ("encode_gbps", "reduce_gbps", "decode_gbps")
#: Every table-valued key (merged key by key by `build_substrate`).
TABLES: tuple[str, ...] = (*CODEC_TABLES, "codec_call_us", "latency_us_by_kind")


@dataclass(frozen=True)
class Substrate:
    """Link, latency, reducer topology, endpoint capacity and codec speed of one fabric.

    - ``topology``: the reducer every compressed route is costed through on this fabric
      (``sharded`` or ``central``); None: each route's own ``RouteSpec.reducer``.
    - ``endpoint_gbps``: ingress (and egress) capacity of the central reducer endpoint;
      None: the same as a rank's link (rank 0 is the endpoint).
    - ``shared_link``: every rank's traffic crosses one link of ``link_gbps`` (a single
      shaped interface, like validation's namespace); False: one full link per rank.
    - ``margin``: admit low-bit only if ``lowbit_time < fp32_time * (1 - margin)``.
    - ``include_codec``: False models codecs as free (offloaded, e.g. to a GPU kernel or the
      reducer endpoint, running at line rate): collectives only.
    - ``alpha_s`` / ``beta_s_per_byte``: fitted α-β constants; when set they replace
      ``latency_us`` / ``link_gbps`` in the model.
    - ``latency_us_by_kind``: µs per latency round of a collective kind (``all_to_all``,
      ``all_gather``, ``gather``, ``broadcast``, ``allreduce``); kinds not named pay α per hop.
    - ``codec_call_us``: µs a compressed (or 16-bit) route's reduce costs once per call. A
      route the substrate describes (named in any codec table or here) pays what is given
      here, 0 if nothing; a route it does not describe pays the host defaults (rates and
      `DEFAULT_CODEC_CALL_US`), so files written before this key keep their predictions.
    """

    link_gbps: float
    latency_us: float = 10.0
    topology: str | None = None
    endpoint_gbps: float | None = None
    world_size: int | None = None
    shared_link: bool = False
    margin: float = 0.1
    encode_gbps: dict[str, float] = field(default_factory=dict)
    reduce_gbps: dict[str, float] = field(default_factory=dict)
    decode_gbps: dict[str, float] = field(default_factory=dict)
    include_codec: bool = True
    alpha_s: float | None = None
    beta_s_per_byte: float | None = None
    codec_call_us: dict[str, float] = field(default_factory=dict)
    latency_us_by_kind: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _positive("link_gbps", self.link_gbps)
        _non_negative("latency_us", self.latency_us)
        if self.topology is not None and self.topology not in TOPOLOGIES:
            raise InputError(
                f"unknown topology {self.topology!r} (choose from {', '.join(TOPOLOGIES)})"
            )
        if self.endpoint_gbps is not None:
            _positive("endpoint_gbps", self.endpoint_gbps)
        if self.world_size is not None and (
            isinstance(self.world_size, bool)
            or not isinstance(self.world_size, int)
            or self.world_size < 1
        ):
            raise InputError(f"world_size must be an integer >= 1, got {self.world_size!r}")
        for flag in ("shared_link", "include_codec"):
            if not isinstance(getattr(self, flag), bool):
                raise InputError(f"{flag} must be true or false, got {getattr(self, flag)!r}")
        _non_negative("margin", self.margin)
        if self.margin >= 1.0:
            raise InputError(f"margin must be in [0, 1), got {self.margin}")
        for table in CODEC_TABLES:
            _table(table, getattr(self, table), ROUTE_NAMES, "route", "GB/s", _positive)
        if self.alpha_s is not None:
            _non_negative("alpha_s", self.alpha_s)
        if self.beta_s_per_byte is not None:
            _positive("beta_s_per_byte", self.beta_s_per_byte)
        codecs = tuple(r for r in ROUTE_NAMES if r != "fp32")
        _table("codec_call_us", self.codec_call_us, codecs, "route", "microseconds",
               _non_negative, excluded="fp32 has no codec (its per-call cost is in α)")
        _table("latency_us_by_kind", self.latency_us_by_kind, OP_KINDS, "collective kind",
               "microseconds", _non_negative)

    # -- the model's constants -------------------------------------------------------------

    @property
    def alpha(self) -> float:
        """Seconds per message hop."""
        return self.alpha_s if self.alpha_s is not None else self.latency_us * 1e-6

    @property
    def link_bytes_per_s(self) -> float:
        if self.beta_s_per_byte is not None:
            return 1.0 / self.beta_s_per_byte
        return self.link_gbps * 1e9 / 8

    @property
    def endpoint_bytes_per_s(self) -> float:
        if self.endpoint_gbps is None:
            return self.link_bytes_per_s
        return self.endpoint_gbps * 1e9 / 8

    def encode_bytes_per_s(self, route: str) -> float:
        """fp32 bytes per second the route's encoder consumes (inf for fp32: no codec)."""
        return _rate(self.encode_gbps, DEFAULT_ENCODE_GBPS, route)

    def reduce_bytes_per_s(self, route: str) -> float:
        """fp32-equivalent bytes of contributions per second the route's reducer combines."""
        return _rate(self.reduce_gbps, DEFAULT_REDUCE_GBPS, route)

    def decode_bytes_per_s(self, route: str) -> float:
        """fp32 bytes per second the route's decoder produces from the combined result."""
        return _rate(self.decode_gbps, DEFAULT_DECODE_GBPS, route)

    def codec_call_s(self, route: str) -> float:
        """Seconds a reduce on `route` costs once per call (0 for fp32; see class doc)."""
        if route == "fp32":
            return 0.0
        if route in self.codec_call_us:
            return self.codec_call_us[route] * 1e-6
        if any(route in getattr(self, table) for table in CODEC_TABLES):
            return 0.0  # the substrate describes this codec and gives it no fixed cost
        return DEFAULT_CODEC_CALL_US[route] * 1e-6

    def kind_latency_s(self, kind: str) -> float | None:
        """Seconds per latency round of collective `kind`, or None: α per hop applies."""
        us = self.latency_us_by_kind.get(kind)
        return None if us is None else us * 1e-6

    def with_link(self, link_gbps: float) -> Substrate:
        """The same fabric at another link speed (fitted β dropped: it belongs to one link)."""
        return replace(self, link_gbps=link_gbps, beta_s_per_byte=None)

    # -- dict / TOML -----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain dict with only the keys that are set (what a profile's metadata stores)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or value == {}:
                continue
            out[f.name] = dict(sorted(value.items())) if isinstance(value, dict) else value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "substrate") -> Substrate:
        """Build from a dict; unknown keys or bad values raise one `InputError` line."""
        if not isinstance(data, dict):
            raise InputError(f"{source}: expected a table of settings, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InputError(
                f"{source}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})"
            )
        if "link_gbps" not in data:
            raise InputError(f"{source}: link_gbps is required")
        try:
            return cls(**data)
        except InputError as exc:
            raise InputError(f"{source}: {exc}") from None

    def to_toml(self) -> str:
        lines = ["# nfabric substrate (see docs/capacity.md for units and meaning)"]
        tables: list[str] = []
        for key, value in self.to_dict().items():
            if isinstance(value, dict):
                tables.append(f"\n[{key}]")
                tables.extend(f"{route} = {_toml_value(rate)}" for route, rate in value.items())
            else:
                lines.append(f"{key} = {_toml_value(value)}")
        return "\n".join(lines + tables) + "\n"


def load_substrate(path: str | Path) -> Substrate:
    """Read a substrate TOML file; a missing, unparsable or invalid file is an `InputError`."""
    p = Path(path)
    return Substrate.from_dict(read_toml(p, "substrate file"), source=str(p))


def save_substrate(substrate: Substrate, path: str | Path) -> None:
    """Write `substrate` as TOML, atomically."""
    atomic_write_text(path, substrate.to_toml())


def as_substrate(value: Any, source: str = "substrate") -> Substrate | None:
    """A `Substrate` for pricing what actually runs: None/{} -> None, a dict is parsed.

    The topology is dropped: the runtime runs each route through the reducer its profile row
    names, so the gate and compile-profile must price that reducer, not a substrate-wide
    what-if (which `nfabric capacity --topology` still offers).
    """
    if value is None or value == {}:
        return None
    sub = Substrate.from_dict(value, source=source) if isinstance(value, dict) else value
    return replace(sub, topology=None) if sub.topology is not None else sub


def build_substrate(
    path: str | Path | None = None,
    base: dict[str, Any] | None = None,
    **overrides: Any,
) -> Substrate:
    """A substrate from a TOML file, else `base` (a profile's stored dict), plus overrides.

    Overrides set to None are ignored, so CLI flags can be passed straight through.
    Nothing to start from and no ``link_gbps`` override is an `InputError`.
    """
    if path is not None:
        data = load_substrate(path).to_dict()
        source = str(path)
    else:
        data = dict(base or {})
        source = "substrate"
    for key in TABLES:  # tables merge, so one route can be overridden
        if overrides.get(key):
            overrides[key] = {**data.get(key, {}), **overrides[key]}
    data.update({k: v for k, v in overrides.items() if v is not None})
    if "link_gbps" not in data:
        raise InputError("no substrate: pass --substrate PATH or --link-gbps GBIT_PER_S")
    return Substrate.from_dict(data, source=source)


def codec_rates_from_bench(path: str | Path) -> dict[str, dict[str, float]]:
    """Codec tables (``encode_gbps`` / ``reduce_gbps`` / ``decode_gbps`` -> route -> GB/s)
    from `nfabric bench routes --json` output.

    Accepted shapes: ``{"routes": {"sign": {"encode_gbps": .., ...}}}`` (what `bench routes`
    writes), ``{"routes": [{"route": "sign", ...}]}``, the bare list or the bare mapping; a
    route label such as ``sign/sharded`` counts for its route name.
    """
    p = Path(path)
    data = read_json(p, "bench file")
    if isinstance(data, dict) and isinstance(data.get("routes"), (list, dict)):
        data = data["routes"]
    if isinstance(data, dict):
        data = [dict(v, route=k) for k, v in data.items() if isinstance(v, dict)]
    tables: dict[str, dict[str, float]] = {t: {} for t in CODEC_TABLES}
    for row in data if isinstance(data, list) else []:
        if not isinstance(row, dict) or row.get("route") in (None, "fp32"):
            continue
        name = str(row["route"]).split("/")[0].split("(")[0]
        for table in CODEC_TABLES:
            # decode: the reduce path's (the combined result), where the bench measured it
            key = "reduce_decode_gbps" if table == "decode_gbps" and "reduce_decode_gbps" in row \
                else table
            if key in row:
                tables[table][name] = row[key]
    if not any(tables.values()):
        raise InputError(f"{p}: no {' / '.join(CODEC_TABLES)} per route found")
    return tables


def _table(
    name: str, table: Any, keys: tuple[str, ...], noun: str, unit: str,
    check: Callable[[str, Any], None], excluded: str = "",
) -> None:
    """A table of known `noun`s to checked numbers; `excluded` says why a route is left out."""
    if not isinstance(table, dict):
        raise InputError(f"{name} must be a table of {noun} = {unit}, got {table!r}")
    for key, value in table.items():
        if key not in keys:
            if excluded and key in ROUTE_NAMES:
                raise InputError(f"{name}.{key}: {excluded}")
            raise InputError(f"{name}: unknown {noun} {key!r} (choose from {', '.join(keys)})")
        check(f"{name}.{key}", value)


def _rate(table: dict[str, float], defaults: dict[str, float], route: str) -> float:
    if route == "fp32":
        return math.inf
    return table.get(route, defaults[route]) * 1e9


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise InputError(f"{name} must be a number, got {value!r}")
    if math.isinf(value):
        raise InputError(f"{name} must be finite, got {value!r}")
    return float(value)


def _positive(name: str, value: Any) -> None:
    if _number(name, value) <= 0:
        raise InputError(f"{name} must be > 0, got {value!r}")


def _non_negative(name: str, value: Any) -> None:
    if _number(name, value) < 0:
        raise InputError(f"{name} must be >= 0, got {value!r}")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def substrate_dict(value: Any) -> dict[str, Any]:
    """The fabric the capacity gate prices: a substrate TOML path or an inline table, checked
    by `Substrate` (one-line errors); None or {}: no substrate (every bucket admitted)."""
    if value is None or value == {}:
        return {}
    if isinstance(value, (str, Path)):
        return load_substrate(value).to_dict()
    if isinstance(value, dict):
        return Substrate.from_dict(value, source="[substrate]").to_dict()
    raise InputError(f"substrate must be a path or a table, got {value!r}")
