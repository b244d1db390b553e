"""Least-squares fits of the cost model's constants from replayed timings (pure functions).

- `fit_link`: α (seconds per hop) and β (seconds per byte on the link) from measured
  collectives, through the same α-β terms the model predicts with (`substrate.cost.op_terms`):
  t = hops·α + link_bytes·β, α from the latency-bound points, β from the bandwidth-bound
  ones (robust to jitter on small transfers); α is kept >= 0.
- `fit_codec`: GB/s per route and stage (encode, reduce, decode), t = bytes / rate through the
  origin (plain least squares: the large buckets that matter dominate), with the byte counts
  `substrate.cost.codec_cost` uses.
- `fit_endpoint`: the central endpoint's ingress from its gather times, t - α = (W-1)·n / E.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from nfabric_cli.errors import InputError
from nfabric_cli.substrate.cost import latency_rounds, op_terms

#: A gather informs the endpoint fit only if its bytes take this many hops' latency or more.
ENDPOINT_MIN_HOPS = 4.0
#: Alternating refinements of α and β (exact data converges in a few).
ROUNDS = 20
#: A stage whose time does not grow with its bytes is written at this rate: free per byte.
FREE_GBPS = 1e4
#: A reduce informs the per-kind latencies if its transfers take at most 1/this of the rest.
LATENCY_BOUND = 4.0


@dataclass(frozen=True)
class OpSample:
    """A collective of `nbytes` (payload, as in `routes/plan.py`) that took `seconds`."""

    kind: str
    nbytes: int
    world_size: int
    seconds: float


@dataclass(frozen=True)
class StageSample:
    """One replayed reduce of `numel` elements on `route` split into codec stages (seconds)."""

    route: str
    reducer: str
    lowbit: bool
    numel: int
    world_size: int
    encode_s: float
    reduce_s: float
    decode_s: float


@dataclass(frozen=True)
class ReduceSample:
    """One replayed reduce: measured seconds, its codec seconds as the fitted model prices
    them, and its collectives (each with its measured duration)."""

    world_size: int
    seconds: float
    codec_s: float
    ops: tuple[OpSample, ...]


@dataclass(frozen=True)
class CodecFit:
    """{"encode_gbps" | "reduce_gbps" | "decode_gbps": {route: GB/s}} and, where an affine
    fit was possible, each route's fixed microseconds per reduce call."""

    rates: dict[str, dict[str, float]]
    call_us: dict[str, float]


@dataclass(frozen=True)
class LinkFit:
    alpha_s: float
    beta_s_per_byte: float
    rms_rel_error: float  # root mean square of predicted/measured - 1 over the samples
    samples: int

    @property
    def link_gbps(self) -> float:
        return 8.0 / self.beta_s_per_byte / 1e9

    def predict(self, s: OpSample, shared_link: bool) -> float:
        t = op_terms(s.kind, s.nbytes, s.world_size, shared_link)
        return t.hops * self.alpha_s + t.link_bytes * self.beta_s_per_byte


def fit_link(samples: Iterable[OpSample], shared_link: bool) -> LinkFit:
    """α, β of t = hops·α + link_bytes·β, each from the points it dominates (see module doc).

    α is the median of (t - bytes·β) / hops over latency-bound points (bytes·β <= hops·α / 4;
    none: the smallest transfers), β the least-squares rate through the origin of
    (t - hops·α) over bandwidth-bound points (t - hops·α >= hops·α); the two are refined in
    turn from a start on the smallest transfers.
    A joint least-squares fit is not robust here: jitter of a few hundred microseconds on the
    latency-bound points (a loaded host) drags β by tens of percent."""
    rows = [s for s in samples if s.seconds > 0 and s.world_size > 1]
    if len(rows) < 2:
        raise InputError("need at least two timed collectives to fit the link")
    pts = [(*_terms(s, shared_link), s.seconds) for s in rows]  # (hops, bytes, t)
    if len({b / max(h, 1) for h, b, _ in pts}) == 1:
        raise InputError("the timed collectives all have one size: cannot separate α from β")
    smallest = min(b for _, b, _ in pts)
    alpha = statistics.median(t / h for h, b, t in pts if b <= 4 * smallest)
    beta = 0.0
    for _ in range(ROUNDS):
        bandwidth = [(b, t - h * alpha) for h, b, t in pts if t - h * alpha >= h * alpha]
        rate = rate_through_origin(bandwidth) if bandwidth else None
        if rate is None:
            raise InputError("the timings show no bandwidth term (every size latency-bound); "
                             "replay larger buckets or a slower link")
        beta = 1.0 / rate
        latency = [(h, b, t) for h, b, t in pts if 4 * b * beta <= h * alpha]
        latency = latency or [(h, b, t) for h, b, t in pts if b <= 4 * smallest]
        alpha = max(0.0, statistics.median((t - b * beta) / h for h, b, t in latency))
    rel = [(h * alpha + b * beta) / t - 1.0 for h, b, t in pts]
    rms = math.sqrt(sum(e * e for e in rel) / len(rel))
    return LinkFit(alpha, beta, rms, len(rows))


def fit_codec(samples: Iterable[StageSample], affine: bool = True) -> CodecFit:
    """Codec rates and fixed costs per route (see module doc); fp32 has no codec, 16-bit
    routes reduce inside the all-reduce, so they get no reduce rate. ``affine=False`` fits
    every stage through the origin (the model without fixed costs)."""
    acc: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for s in samples:
        if s.route == "fp32" or s.numel == 0:
            continue
        nbytes = 4.0 * s.numel
        stages = {"encode_gbps": (nbytes, s.encode_s), "decode_gbps": (nbytes, s.decode_s)}
        if s.lowbit:
            combined = s.world_size * nbytes if s.reducer == "central" else nbytes
            stages["reduce_gbps"] = (combined, s.reduce_s)
        for table, point in stages.items():
            acc.setdefault((table, s.route), []).append(point)
    rates: dict[str, dict[str, float]] = {"encode_gbps": {}, "reduce_gbps": {}, "decode_gbps": {}}
    call: dict[str, float] = {}
    for (table, route), points in sorted(acc.items()):
        if affine and len({x for x, _ in points}) > 1:
            fixed, rate = affine_rate(points)
            call[route] = call.get(route, 0.0) + fixed * 1e6
            rates[table][route] = min(FREE_GBPS, rate / 1e9)
            continue
        rate = rate_through_origin(points)
        if rate is not None:
            rates[table][route] = rate / 1e9
    return CodecFit(rates, call)


def affine_rate(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(c seconds, r bytes/s) of t = c + x / r minimising the relative error sum((pred/t - 1)^2),
    with c >= 0 and 1/r >= 0 (r = inf: no per-byte cost); points with t <= 0 are ignored."""
    pts = [(x, t) for x, t in points if t > 0]
    if not pts:
        return 0.0, math.inf
    # Weighted least squares with weights 1/t^2: sums of w, w·x, w·x², w·t, w·x·t.
    sw = sum(1 / t**2 for _, t in pts)
    sx = sum(x / t**2 for x, t in pts)
    sxx = sum(x * x / t**2 for x, t in pts)
    st = sum(1 / t for _, t in pts)
    sxt = sum(x / t for x, t in pts)
    det = sw * sxx - sx * sx
    if det > 0:
        c, slope = (st * sxx - sx * sxt) / det, (sw * sxt - sx * st) / det
        if c >= 0 and slope >= 0:
            return c, (1 / slope if slope > 0 else math.inf)
    through_origin = sxt / sxx if sxx > 0 else 0.0  # c = 0
    flat = st / sw  # slope = 0
    err_origin = sum((through_origin * x / t - 1) ** 2 for x, t in pts)
    err_flat = sum((flat / t - 1) ** 2 for _, t in pts)
    if through_origin > 0 and err_origin <= err_flat:
        return 0.0, 1 / through_origin
    return flat, math.inf


def fit_kind_latency(
    samples: Iterable[ReduceSample], link: LinkFit, shared_link: bool
) -> dict[str, float]:
    """Seconds per latency round per collective kind (see module doc; `allreduce` is α's).

    Per reduce, the latency budget is its measured seconds less its codec seconds (as
    fitted) and α per hop of any all-reduce it issues. Only latency-bound reduces count:
    transfers (link bytes·β) at most `1/LATENCY_BOUND` of the budget and codec at most all of
    it (none among a plan's reduces: the one closest to that), where a collective of a fitted kind takes its
    latency rounds with the transfer hidden in them (`substrate.cost.op_cost`), and a codec
    misfit on a large reduce cannot pass for latency. The budget is shared among the other
    collectives in proportion to their measured durations and divided by each one's rounds;
    per kind, the median over the reduces.
    """
    plans: dict[tuple[str, ...], list[tuple[float, float, ReduceSample]]] = {}
    for s in samples:
        terms = [op_terms(o.kind, o.nbytes, o.world_size, shared_link) for o in s.ops]
        wire = sum(t.link_bytes for t in terms) * link.beta_s_per_byte
        hops = sum(t.hops for o, t in zip(s.ops, terms, strict=True) if o.kind == "allreduce")
        budget = s.seconds - s.codec_s - hops * link.alpha_s
        rank = max(LATENCY_BOUND * wire, s.codec_s) / max(budget, 1e-12)  # <= 1: latency-bound
        plans.setdefault(tuple(o.kind for o in s.ops), []).append((rank, budget, s))
    bound = []
    for rows in plans.values():  # per collective plan (route and reducer), so each kind counts
        bound += [r for r in rows if r[0] <= 1.0] or [min(rows, key=lambda r: r[0])]
    per_kind: dict[str, list[float]] = {}
    for _, budget, s in bound:
        ops = [o for o in s.ops if o.kind != "allreduce"]
        total = sum(max(0.0, o.seconds) for o in ops)
        for o in ops:
            weight = max(0.0, o.seconds) / total if total > 0 else 1 / len(ops)
            rounds = latency_rounds(o.kind, o.world_size)
            per_kind.setdefault(o.kind, []).append(max(0.0, budget) * weight / rounds)
    return {kind: statistics.median(v) for kind, v in sorted(per_kind.items())}


def fit_endpoint(samples: Iterable[OpSample], link: LinkFit) -> float | None:
    """Endpoint ingress in bytes/s from the central reducer's gathers, t - α = (W-1)·n / E.

    Only gathers whose fan-in would take at least `ENDPOINT_MIN_HOPS` hops' latency at the
    fitted link speed count: below that the time is latency and noise, and says nothing about
    the endpoint. None when no gather is large enough."""
    points = []
    for s in samples:
        fanin = (s.world_size - 1) * float(s.nbytes)
        if s.kind == "gather" and fanin * link.beta_s_per_byte >= ENDPOINT_MIN_HOPS * link.alpha_s:
            points.append((fanin, s.seconds - link.alpha_s))
    return rate_through_origin(points) if points else None


def rate_through_origin(points: list[tuple[float, float]]) -> float | None:
    """Least-squares rate r of t = x / r over (x, t) points; None if it is not positive."""
    sxt = sum(x * t for x, t in points)
    sxx = sum(x * x for x, _ in points)
    if sxt <= 0 or sxx <= 0 or not math.isfinite(sxt):
        return None
    return sxx / sxt


def _terms(s: OpSample, shared_link: bool) -> tuple[float, float]:
    t = op_terms(s.kind, s.nbytes, s.world_size, shared_link)
    return float(t.hops), float(t.link_bytes)
