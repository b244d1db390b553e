"""α-β cost model: predicted time of a route's collectives and codec on a `Substrate`.

Per collective on W ranks, with α the per-hop latency, B a rank's link bandwidth (bytes/s)
and E the central endpoint's capacity (``n`` = the op's payload, see `routes/plan.py`):

| kind         | time                                 | why                                        |
|--------------|--------------------------------------|--------------------------------------------|
| `allreduce`  | 2(W-1)·α + 2(W-1)/W · n/B            | ring: reduce-scatter + all-gather           |
| `all_to_all` | (W-1)·α + (W-1)/W · n/B              | pairwise exchange of W-1 shards             |
| `all_gather` | (W-1)·α + (W-1) · n/B                | ring, every rank receives W-1 contributions |
| `gather`     | α + max(n/B, (W-1)·n/E)              | fan-in: the endpoint's ingress saturates    |
| `broadcast`  | α + max(n/B, (W-1)·n/E)              | the endpoint sends W-1 copies (no tree)     |

With ``shared_link`` every rank's bytes cross one link, so the bandwidth term is the bytes all
ranks send together divided by B (the latency terms are unchanged).

A kind named in the substrate's ``latency_us_by_kind`` takes max(rounds·L_kind, transfer)
instead of hops·α + transfer (transfer: the bandwidth and endpoint terms above), with the
rounds its gloo implementation takes:

| kind         | rounds  | measured (gloo, loopback, see docs/capacity.md)                  |
|--------------|---------|-------------------------------------------------------------------|
| `allreduce`  | 2(W-1)  | ring (per hop)                                                    |
| `all_gather` | W-1     | ring (per hop)                                                    |
| `all_to_all` | 1       | every pair's send and receive posted at once: one round per call  |
| `gather`     | 1       | per call                                                          |
| `broadcast`  | 1       | per call                                                          |

Measured on the development host (docs/capacity.md): from W = 2 to 4 a lone 64-byte
all_to_all grew as much as gather and broadcast did, not 3x more, as W-1 hops would have it.
L_kind is what a small collective of that kind costs in all (host wake-up, gloo dispatch,
TCP); on a link busy with the collective's own bytes those rounds overlap the transfer: the
262,656-element sign reduces on 50-100 Mbit/s links were over-predicted by 15-64 % with
latency + transfer, 5-46 % with the max. The overlap shows in `Cost` as the latency left
over, max(0, rounds·L_kind - transfer). A kind not in the table keeps α per hop, added.

Codec time of a compressed route on ``numel`` fp32 elements: a fixed cost per reduce call
(`Substrate.codec_call_s`: call overhead of encode, combine and decode, the route's Python
flow), then encode ``4·numel`` bytes at the route's encode rate, combine the received codes at
its reduce rate, decode ``4·numel`` bytes at its decode rate. The reducer combines ``numel``
contributions on each rank when sharded (W shards of numel/W) and ``W·numel`` on the central
endpoint (every contribution, while the other ranks wait). 16-bit routes reduce inside the
all-reduce (no combine step).

Buckets run their collectives one after another (the comm hook issues them in order on one
thread) and do not overlap with backward compute: a bucket's time is the sum of its parts. Its
parts are the route groups of `routes/groups.py`: every low-bit group pays its own codec
(two regions on sign in one bucket are one group; sign beside int8 pay two fixed codec
costs), while all sharded low-bit
groups of a bucket share one all-to-all and one all-gather (`routes/exchange.py`, plus one MAX
all-reduce for int8 / int4 scales); float routes and the central reducer pay their own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import astuple, dataclass, replace
from typing import NamedTuple

from nfabric_cli.routes.plan import CommOp
from nfabric_cli.routes.spec import FP32, RouteSpec
from nfabric_cli.substrate.model import Substrate

MAX_SEARCH_NUMEL = 1 << 40
MAX_SEARCH_WORLD = 1 << 16


@dataclass(frozen=True)
class Cost:
    """Predicted seconds split by cause, so a verdict can name what dominates.

    ``endpoint_s`` is only the excess of the endpoint's fan-in over the plain link time;
    ``call_s`` is the codec's fixed cost per reduce call (codec time, not latency), summed
    over the ``calls`` reduces that paid it;
    ``fanin_bytes`` is the payload one sender pushes into the endpoint.
    """

    latency_s: float = 0.0
    wire_s: float = 0.0
    endpoint_s: float = 0.0
    encode_s: float = 0.0
    reduce_s: float = 0.0
    decode_s: float = 0.0
    collectives: int = 0
    fanin_bytes: int = 0
    call_s: float = 0.0
    calls: int = 0

    @property
    def codec_s(self) -> float:
        return self.call_s + self.encode_s + self.reduce_s + self.decode_s

    @property
    def total_s(self) -> float:
        return self.latency_s + self.wire_s + self.endpoint_s + self.codec_s

    def __add__(self, other: Cost) -> Cost:
        return Cost(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


class Verdict(NamedTuple):
    """A bucket's capacity verdict: unpacks as (verdict, reason, fp32_time_s, lowbit_time_s).
    The times are the model's predictions (None where nothing was priced: no substrate)."""

    verdict: str  # "admit" | "fallback"
    reason: str
    fp32_time_s: float | None = None
    lowbit_time_s: float | None = None

    @property
    def admit(self) -> bool:
        return self.verdict == "admit"


class OpTerms(NamedTuple):
    """The α-β terms of one collective: hops, bytes on a rank's link, bytes via the endpoint."""

    hops: int
    link_bytes: float  # per rank; with a shared link, every rank's bytes together
    endpoint_bytes: float  # through the central endpoint (gather / broadcast), else 0


def op_terms(kind: str, nbytes: int, world_size: int, shared_link: bool = False) -> OpTerms:
    """Latency hops and bytes of one collective of `nbytes` (see the module doc's table)."""
    w, n = world_size, float(nbytes)
    if kind == "allreduce":
        hops, per_rank, all_ranks = 2 * (w - 1), 2 * (w - 1) / w * n, 2 * (w - 1) * n
    elif kind == "all_to_all":
        hops, per_rank, all_ranks = w - 1, (w - 1) / w * n, (w - 1) * n
    elif kind == "all_gather":
        hops, per_rank, all_ranks = w - 1, (w - 1) * n, w * (w - 1) * n
    elif kind in ("gather", "broadcast"):
        if shared_link:  # the endpoint's W-1 transfers cross the one link
            return OpTerms(1, (w - 1) * n, 0.0)
        return OpTerms(1, n, (w - 1) * n)
    else:
        raise ValueError(f"unknown collective kind {kind!r}")
    return OpTerms(hops, all_ranks if shared_link else per_rank, 0.0)


def latency_rounds(kind: str, world_size: int) -> int:
    """Latency rounds of one collective of `kind` on W ranks (the second table of the doc)."""
    if kind == "allreduce":
        return 2 * (world_size - 1)
    if kind == "all_gather":
        return world_size - 1
    if kind in ("all_to_all", "gather", "broadcast"):
        return 1
    raise ValueError(f"unknown collective kind {kind!r}")


def op_latency(kind: str, world_size: int, s: Substrate) -> float:
    """Latency seconds of one collective before any overlap: L_kind per round if the
    substrate names the kind, else α per hop."""
    per_round = s.kind_latency_s(kind)
    if per_round is not None:
        return per_round * latency_rounds(kind, world_size)
    return op_terms(kind, 0, world_size).hops * s.alpha


def op_cost(op: CommOp, world_size: int, s: Substrate) -> Cost:
    """Predicted time of one collective of `op.nbytes` on `world_size` ranks (see module doc)."""
    if world_size <= 1 or op.nbytes == 0:
        return Cost()
    t = op_terms(op.kind, op.nbytes, world_size, s.shared_link)
    link = t.link_bytes / s.link_bytes_per_s
    endpoint = max(0.0, t.endpoint_bytes / s.endpoint_bytes_per_s - link)
    fanin = op.nbytes if op.kind == "gather" else 0
    latency = op_latency(op.kind, world_size, s)
    if s.kind_latency_s(op.kind) is not None:  # rounds overlap the transfer (module doc)
        latency = max(0.0, latency - link - endpoint)
    return Cost(latency, link, endpoint, collectives=1, fanin_bytes=fanin)


def plan_cost(ops: Iterable[CommOp], world_size: int, s: Substrate) -> Cost:
    """Sum of `op_cost` over a route's plan (collectives run one after another)."""
    total = Cost()
    for op in ops:
        total = total + op_cost(op, world_size, s)
    return total


def codec_cost(spec: RouteSpec, numel: int, world_size: int, s: Substrate) -> Cost:
    """Fixed per-call, encode, reduce and decode time of `numel` fp32 elements on `spec`
    (zero for fp32)."""
    if spec.name == "fp32" or numel == 0 or not s.include_codec:
        return Cost()
    nbytes = 4.0 * numel
    if not spec.lowbit:  # bf16 / fp16: cast, all-reduce, cast back
        combined = 0.0
    elif effective_reducer(spec, s) == "central":
        combined = world_size * nbytes
    else:
        combined = nbytes
    return Cost(
        call_s=s.codec_call_s(spec.name),
        calls=1,
        encode_s=nbytes / s.encode_bytes_per_s(spec.name),
        reduce_s=combined / s.reduce_bytes_per_s(spec.name),
        decode_s=nbytes / s.decode_bytes_per_s(spec.name),
    )


def codec_seconds(spec: RouteSpec, numel: int, world_size: int, s: Substrate) -> float:
    """Per-call + encode + reduce + decode seconds of `numel` fp32 elements on `spec` (0 for fp32)."""
    return codec_cost(spec, numel, world_size, s).codec_s


def effective_reducer(spec: RouteSpec, s: Substrate) -> str:
    """The reducer a compressed route runs through on `s` (the substrate's topology wins)."""
    return s.topology if s.topology is not None and spec.name != "fp32" else spec.reducer


def max_world_size(spec: RouteSpec) -> int:
    """Largest world size the route aggregates exactly (sign counts fit in a byte, etc.)."""
    from nfabric_cli.routes import make_route

    return make_route(spec).max_world_size


def route_plan(spec: RouteSpec, numel: int, world_size: int) -> list[CommOp]:
    """The collectives `spec` issues for `numel` elements (fp32 is DDP's one all-reduce)."""
    if spec.name == "fp32":
        return [CommOp("allreduce", 4 * numel)] if numel else []
    from nfabric_cli.routes import make_route  # lazy: codecs import torch.distributed

    return make_route(spec).plan(numel, world_size)


def route_cost(spec: RouteSpec, numel: int, world_size: int, s: Substrate) -> Cost:
    """Predicted cost of sending `numel` gradient elements through `spec` on `s`."""
    if spec.name != "fp32" and s.topology is not None:
        spec = replace(spec, reducer=s.topology)
    comm = plan_cost(route_plan(spec, numel, world_size), world_size, s)
    return comm + codec_cost(spec, numel, world_size, s)


def predict_fp32(numel: int, world_size: int, s: Substrate) -> float:
    """Seconds for DDP's default fp32 ring all-reduce of `numel` elements."""
    return route_cost(FP32, numel, world_size, s).total_s


def predict_route(spec: RouteSpec, numel: int, world_size: int, s: Substrate) -> float:
    """Seconds for `spec` (collectives + codec) on `numel` elements."""
    return route_cost(spec, numel, world_size, s).total_s


#: A bucket as the hook reduces it: one (route, elements) pair per reduce call (see
#: `routes/groups.py`); a mapping route -> elements is read as one reduce per route.
BucketGroups = Mapping[RouteSpec, int] | Iterable[tuple[RouteSpec, int]]


def as_groups(groups: BucketGroups) -> list[tuple[RouteSpec, int]]:
    """The reduces of a bucket as a list of (route, elements) pairs."""
    pairs = groups.items() if isinstance(groups, Mapping) else groups
    return [(spec, int(numel)) for spec, numel in pairs]


def bucket_cost(groups: BucketGroups, world_size: int, s: Substrate) -> Cost:
    """Cost of one DDP bucket reduced as `groups`: every group pays its own codec cost (with
    its fixed cost per call); the sharded low-bit groups share one set of collectives (one
    all-to-all, one all-gather, one MAX all-reduce if any agrees max scales: their bytes
    summed, the latency paid once, `routes/exchange.py`); the others pay their own."""
    total = Cost()
    shared: dict[str, int] = {}
    for spec, numel in as_groups(groups):
        if not numel:
            continue
        if spec.name != "fp32" and s.topology is not None:
            spec = replace(spec, reducer=s.topology)
        if spec.lowbit and spec.reducer == "sharded":
            for op in route_plan(spec, numel, world_size):
                shared[op.kind] = shared.get(op.kind, 0) + op.nbytes
            total = total + codec_cost(spec, numel, world_size, s)
        else:
            total = total + route_cost(spec, numel, world_size, s)
    return total + plan_cost([CommOp(k, n) for k, n in shared.items()], world_size, s)


def bucket_verdict(substrate: Substrate, groups: BucketGroups, world_size: int) -> Verdict:
    """Admit a bucket's routes only if predicted faster than fp32 by the substrate's margin.

    `groups` holds one (route, elements) pair per reduce the hook issues for the bucket
    (`routes.groups.bucket_groups`); the fp32 reference is one all-reduce of the whole bucket.
    The reason names the speed-up or, for a fallback, the dominant cost: latency, endpoint
    fan-in or codec.
    """
    pairs = as_groups(groups)
    numel = sum(n for _, n in pairs)
    fp32 = predict_fp32(numel, world_size, substrate)
    if all(spec.name == "fp32" for spec, n in pairs if n):
        return Verdict("admit", "fp32 only: nothing to gate", fp32, fp32)
    cost = bucket_cost(pairs, world_size, substrate)
    low = cost.total_s
    if world_size <= 1:
        return Verdict("fallback", "single rank: no communication to save", fp32, low)
    speedup = fp32 / low if low > 0 else float("inf")
    if low < fp32 * (1.0 - substrate.margin):
        return Verdict("admit", f"admit: {speedup:.1f}x faster", fp32, low)
    return Verdict("fallback", _fallback_reason(cost, fp32, speedup, world_size, substrate),
                   fp32, low)


def _fallback_reason(cost: Cost, fp32: float, speedup: float, w: int, s: Substrate) -> str:
    needed = 1.0 / (1.0 - s.margin)
    if speedup > 1.0:
        return f"below margin: {speedup:.2f}x faster, {needed:.2f}x needed"
    parts = {
        "latency": cost.latency_s,
        "endpoint": cost.endpoint_s,
        "codec": cost.codec_s,
        "wire": cost.wire_s,
    }
    cause = max(parts, key=lambda k: parts[k])
    tail = f" ({speedup:.2f}x)"
    if cause == "latency":
        return f"latency-bound: {cost.collectives} collectives vs 1" + tail
    if cause == "endpoint":
        rate = s.endpoint_bytes_per_s / 1e9
        return (
            f"endpoint saturated: {w - 1}x{human_bytes(cost.fanin_bytes)} "
            f"into {rate:.3g} GB/s" + tail
        )
    if cause == "codec":
        stages = {"encode": cost.encode_s, "reduce": cost.reduce_s, "decode": cost.decode_s}
        stage = max(stages, key=lambda k: stages[k])
        if cost.call_s > stages[stage]:
            fixed = (f"{cost.call_s * 1e3:.3g} ms fixed over {cost.calls} calls" if cost.calls > 1
                     else f"{cost.call_s * 1e3:.3g} ms fixed per call")
            return (
                f"codec call overhead: codec {cost.codec_s * 1e3:.3g} ms ({fixed}) "
                f"vs fp32 {fp32 * 1e3:.3g} ms" + tail
            )
        return (
            f"{stage} slower than link: codec {cost.codec_s * 1e3:.3g} ms "
            f"({stage} {stages[stage] * 1e3:.3g} ms) vs fp32 {fp32 * 1e3:.3g} ms" + tail
        )
    return f"wire-bound: {cost.wire_s * 1e3:.3g} ms on the link vs fp32 {fp32 * 1e3:.3g} ms" + tail


def crossover_bucket_numel(
    spec: RouteSpec, world_size: int, s: Substrate, hi: int = MAX_SEARCH_NUMEL
) -> int | None:
    """Smallest bucket (elements, all on `spec`) that `spec` is admitted for; None: none up to `hi`.

    Below it low-bit loses (latency and codec overheads dominate). Found by doubling then
    bisection, which assumes admission is monotone in bucket size (the model is affine in it).
    """

    def admitted(n: int) -> bool:
        return bucket_verdict(s, {spec: n}, world_size).verdict == "admit"

    return first_true(admitted, 1, hi)


def central_saturation_world_size(
    spec: RouteSpec, numel: int, s: Substrate, hi: int = MAX_SEARCH_WORLD
) -> int | None:
    """Smallest world size at which `spec` through the central reducer stops beating fp32.

    The endpoint receives (W-1) contributions and reduces W of them while fp32's ring cost
    per rank stays nearly flat, so past this point the fan-in reducer no longer pays for a
    `numel`-element bucket. 2 means it never pays; None means it still pays at the largest
    world size searched (`hi`, or the route's own limit).
    """
    central = replace(s, topology="central")

    def loses(w: int) -> bool:
        return bucket_verdict(central, {spec: numel}, w).verdict == "fallback"

    return first_true(loses, 2, min(hi, max_world_size(spec)))


def endpoint_ingress_bound_world_size(s: Substrate) -> int:
    """Smallest W at which the endpoint's fan-in ((W-1)·n/E) outlasts one link's time (n/B)."""
    return int(s.endpoint_bytes_per_s / s.link_bytes_per_s) + 2


def first_true(pred: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """Smallest integer in [lo, hi] where `pred` holds, assuming it stays true once true."""
    if pred(lo):
        return lo
    prev, probe = lo, lo * 2
    while probe < hi and not pred(probe):
        prev, probe = probe, probe * 2
    if probe >= hi:
        if not pred(hi):
            return None
        probe = hi
    while probe - prev > 1:  # pred(prev) false, pred(probe) true
        mid = (prev + probe) // 2
        if pred(mid):
            probe = mid
        else:
            prev = mid
    return probe


def human_bytes(n: float) -> str:
    """524288 -> '524 KB' (powers of 1000, as link speeds are)."""
    if abs(n) < 1000:
        return f"{int(n)} B"
    for unit in ("KB", "MB", "GB"):
        n /= 1000
        if abs(n) < 1000 or unit == "GB":
            break
    return f"{n:.3g} {unit}"
