"""`ReplayPlan`: what every replay rank runs, as plain JSON-able data.

From a loaded trace: each distinct group (after a `--topology` what-if on the compressed
routes), an fp32 all-reduce "twin" of the same size right after it (so the low-bit and fp32
times of one bucket are measured side by side), a small sweep of fp32 all-reduce sizes
that spans the latency- and bandwidth-bound regimes of the link for the α-β fit, and per
distinct compressed route a sweep of `CODEC_SWEEP_POINTS` sizes (random data) from
`CODEC_SWEEP_MIN` elements up to its largest recorded group, for the affine codec fit and the
per-kind latencies (the recorded groups themselves are then predicted, not fitted).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from nfabric_cli.errors import InputError
from nfabric_cli.replay.trace import Trace
from nfabric_cli.routes.spec import FP32, RouteSpec
from nfabric_cli.substrate.model import TOPOLOGIES

#: Assumed loopback speed when no link is shaped; only sizes the sweep, never the fit.
LOOPBACK_GUESS_MBIT = 8000.0
#: The sweep's largest all-reduce takes about this long at the nominal link speed.
SWEEP_MAX_S = 0.2
SWEEP_MAX_NUMEL = 1 << 22
SWEEP_SIZES = (1, 256, 1024, 4096, 16384, 65536, 262144, 1 << 20, 1 << 22)

#: Codec sweep: this many sizes, log-spaced from `CODEC_SWEEP_MIN` elements up to the route's
#: largest recorded group (at least `CODEC_SWEEP_SPAN` times more, at most `SWEEP_MAX_NUMEL`).
CODEC_SWEEP_POINTS = 4
CODEC_SWEEP_MIN = 1000
CODEC_SWEEP_SPAN = 100

ROLE_TRACE, ROLE_TWIN, ROLE_SWEEP, ROLE_CODEC = "trace", "twin", "sweep", "codec"


@dataclass
class ReplayCase:
    """One measurement: `spec` reduced over `numel` elements (`segments`), `repeats` times.

    ``payloads`` are sample paths relative to the trace directory (cycled over ranks; random
    data of the recorded size where none is left). ``recorded_s`` is the trace's own median,
    kept only when the case is what the run executed (same world size and reducer)."""

    role: str
    spec: dict[str, Any]
    numel: int
    segments: list[int]
    payloads: list[str] = field(default_factory=list)
    recorded_s: float | None = None
    twin_of: int | None = None  # index of the case this fp32 all-reduce is the twin of

    @property
    def route(self) -> RouteSpec:
        return RouteSpec.from_dict(self.spec)

    def payload_for(self, rank: int) -> str | None:
        """The sample replay rank `rank` reads: the recorded ones, cycled over the ranks."""
        return self.payloads[rank % len(self.payloads)] if self.payloads else None


@dataclass
class ReplayPlan:
    trace_dir: str
    world_size: int
    repeats: int
    cases: list[ReplayCase]
    topology: str | None = None
    link_mbit: float | None = None
    warmup: int = 1
    timeout_s: float = 600.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReplayPlan:
        cases = [ReplayCase(**c) for c in data["cases"]]
        return cls(**{**data, "cases": cases})


def build_plan(
    trace: Trace,
    world_size: int | None = None,
    topology: str | None = None,
    repeats: int = 5,
    link_mbit: float | None = None,
) -> ReplayPlan:
    """The replay of `trace` at `world_size` ranks (default: the recorded one); see module doc.

    Raises `InputError` for a world size below 2 or above a route's exact-aggregation limit,
    an unknown topology, a non-positive link speed or fewer than one repeat."""
    from nfabric_cli.routes import make_route

    w = trace.world_size if world_size is None else world_size
    if w < 2:
        raise InputError(f"world size must be >= 2 to replay collectives, got {w}")
    if topology is not None and topology not in TOPOLOGIES:
        raise InputError(f"unknown topology {topology!r} (choose from {', '.join(TOPOLOGIES)})")
    if repeats < 1:
        raise InputError(f"--repeats must be >= 1, got {repeats}")
    if link_mbit is not None and (not math.isfinite(link_mbit) or link_mbit <= 0):
        raise InputError(f"--link-mbit must be > 0, got {link_mbit:g}")
    cases: list[ReplayCase] = []
    index: dict[tuple, int] = {}
    for g in trace.groups:
        spec = replace(g.spec, reducer=topology) if topology and g.spec.lowbit else g.spec
        limit = make_route(spec).max_world_size
        if w > limit:
            raise InputError(f"route {spec.label()} aggregates exactly only up to {limit} ranks; "
                             f"got world size {w}")
        same = w == trace.world_size and spec == g.spec
        key = (spec, g.numel, g.segments)
        if key in index:  # two recorded groups became one after the what-if
            cases[index[key]].payloads.extend(g.payloads)
            continue
        index[key] = len(cases)
        cases.append(ReplayCase(ROLE_TRACE, spec.to_dict(), g.numel, list(g.segments),
                                list(g.payloads), g.recorded_s if same else None))
        if spec != FP32:
            cases.append(ReplayCase(ROLE_TWIN, FP32.to_dict(), g.numel, [g.numel],
                                    twin_of=index[key]))
    largest: dict[RouteSpec, int] = {}
    for c in cases:
        if c.role == ROLE_TRACE and c.route != FP32:
            largest[c.route] = max(largest.get(c.route, 0), c.numel)
    for spec, numel in sorted(largest.items(), key=lambda kv: kv[0].label()):
        for n in codec_sweep_sizes(spec, w, link_mbit, numel):
            cases.append(ReplayCase(ROLE_CODEC, spec.to_dict(), n, [n]))
    for n in sweep_sizes(w, link_mbit):
        cases.append(ReplayCase(ROLE_SWEEP, FP32.to_dict(), n, [n]))
    return ReplayPlan(str(trace.directory.resolve()), w, repeats, cases, topology, link_mbit)


def sweep_sizes(world_size: int, link_mbit: float | None) -> list[int]:
    """fp32 all-reduce sizes (elements) from one element up to about `SWEEP_MAX_S` at the
    nominal link (every rank's all-reduce bytes cross one shared link)."""
    rate = (link_mbit or LOOPBACK_GUESS_MBIT) * 1e6 / 8
    biggest = min(SWEEP_MAX_NUMEL, SWEEP_MAX_S * rate / (8 * (world_size - 1)))
    return [n for n in SWEEP_SIZES if n <= max(biggest, SWEEP_SIZES[2])]


def codec_sweep_sizes(
    spec: RouteSpec, world_size: int, link_mbit: float | None, largest: int
) -> list[int]:
    """Sizes (elements) of a compressed route's codec sweep: log-spaced from `CODEC_SWEEP_MIN`
    to `largest` (see the constants), the top one cut to about `SWEEP_MAX_S` on the link."""
    from nfabric_cli.substrate.cost import route_cost
    from nfabric_cli.substrate.model import Substrate

    link = Substrate(link_gbps=(link_mbit or LOOPBACK_GUESS_MBIT) / 1e3, latency_us=0.0,
                     shared_link=True, include_codec=False)
    hi = min(SWEEP_MAX_NUMEL, max(largest, CODEC_SWEEP_MIN * CODEC_SWEEP_SPAN))
    while hi > CODEC_SWEEP_MIN and route_cost(spec, hi, world_size, link).total_s > SWEEP_MAX_S:
        hi //= 2
    if hi <= CODEC_SWEEP_MIN:
        return [CODEC_SWEEP_MIN]
    step = (hi / CODEC_SWEEP_MIN) ** (1 / (CODEC_SWEEP_POINTS - 1))
    return [round(CODEC_SWEEP_MIN * step**i) for i in range(CODEC_SWEEP_POINTS)]


def estimated_seconds(plan: ReplayPlan) -> float:
    """Rough wall time of the collectives at the nominal link (sizes the launcher's timeout)."""
    rate = (plan.link_mbit or LOOPBACK_GUESS_MBIT) * 1e6 / 8
    w = plan.world_size
    per_round = sum(1e-3 + 8 * (w - 1) * c.numel / rate for c in plan.cases)
    return per_round * (plan.repeats + plan.warmup)
