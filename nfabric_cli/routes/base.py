"""The `Route` interface and the shared flow of code-based (low-bit) routes.

A route composes three small parts (GRACE's split): a codec (`encode` / `decode`), an
optional error-feedback memory (`memory.py`, applied by the caller per parameter name), and a
collective plan (`plan`). The same codec functions run in the real collective (`reduce`) and in
the single-process simulator (`simulate`); for code-based routes the two agree bit for bit.

Low-bit reduction, for every code route:
1. each rank computes per-chunk scales (`chunks.py`) and agrees them with the other ranks
   (`agreement`: exact MAX for int8/int4, in an all-reduce of its own since their codes need
   the agreed scale; a mean summed in rank order for sign/ternary, whose codes use the local
   scales; or not at all for int8/int4 at W = 2, where each rank's codes are decoded on its
   own scales, sent with them);
2. each rank packs integer codes into bytes;
3. the codes are combined exactly as integers, either `sharded` (all-to-all of packed shards,
   each rank combines its shard, all-gather of packed results; sign/ternary's local scales
   ride in the same all-to-all, so they cost two collectives, int8/int4 three) or `central`
   (gather to rank 0, combine, broadcast back); where every rank gathers every rank's codes
   (`gathers_codes`) each combines them all, and int8/int4 there decode each rank's codes on
   its own scales and average them instead (`IntRoute.combine_decode`);
4. every rank decodes the combined integers with the agreed scales; the native kernels decode
   straight from the packed result (`_decode_result`) into the rank's own input memory,
   without an int64 copy of it. The sharded combine packs its result in the same pass
   (`combine_packed`); the sign majority vote is bit-sliced, 64 votes per word operation.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nfabric_cli.errors import InputError
from nfabric_cli.routes import kernels
from nfabric_cli.routes.chunks import ChunkLayout, check_segments, chunk_layout, silent_per_range
from nfabric_cli.routes.comm import Comm, sum_in_rank_order
from nfabric_cli.routes.packing import bits_for_levels, pack_uint, unpack_uint
from nfabric_cli.routes.plan import CommOp, WireBytes, plan_wire_bytes
from nfabric_cli.routes.spec import RouteSpec
from nfabric_cli.routes.tally import Sink, Tally

#: Element counts of the parameters a flat gradient holds, in order (None: one parameter).
Segments = tuple[int, ...] | None


@dataclass(frozen=True)
class ZeroVote:
    """How this rank's sign codes vote an exact zero this step: up (a 1 bit) or down."""

    up: bool


#: A rank's per-step codec noise: stochastic rounding's uniform draws themselves, or a
#: generator to draw them; sign's vote for exact zeros; or None.
Noise = torch.Generator | torch.Tensor | ZeroVote | None


def zero_vote(rank: int, step: int) -> ZeroVote:
    """Sign's vote for an exact zero under ``zeros = "split"``: up where rank + step is even.
    A 1-bit code has no zero, and a vote every rank cast the same way (down, before) moved
    every element without a gradient (an embedding row not in the batch, a dead unit's
    weights, a padding row) by the chunk's scale every step: without error feedback it
    drifted without bound. Split, half the ranks vote each way at an even world size, so such
    an element ties and gets exactly 0; at an odd one the majority alternates step by step,
    so it oscillates instead of drifting. A rank with a zero among others' gradients casts an
    unbiased vote either way."""
    return ZeroVote((rank + step) % 2 == 0)


def codec_noise(
    spec: RouteSpec, seed: int, step: int, rank: int, names: Sequence[str], numels: Sequence[int]
) -> Noise:
    """What the codec of `spec` draws on for a group of parameters on `rank` at `step`: sign's
    zero vote (`zero_vote`), stochastic rounding's uniform noise, else None. Each parameter's
    share of the noise is drawn from its own generator, seeded from (seed, step, rank, name),
    so the noise an element gets does not depend on how DDP buckets or the simulator groups
    parameters. The hook, error feedback's roundtrip and the calibration simulator draw the
    same noise; the global RNG is left alone."""
    if spec.name == "sign":
        return zero_vote(rank, step) if spec.zeros == "split" else None
    if spec.rounding != "stochastic" or spec.name not in ("int8", "int4"):
        return None
    parts = []
    for name, n in zip(names, numels, strict=True):
        key = hashlib.blake2b(f"{seed}/{step}/{rank}/{name}".encode(), digest_size=8).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)
        parts.append(torch.rand(n, generator=gen))
    return torch.cat(parts) if len(parts) != 1 else parts[0]


def check_input(x: torch.Tensor) -> torch.Tensor:
    """Routes take a contiguous 1-D floating tensor; say clearly what is wrong otherwise."""
    if not isinstance(x, torch.Tensor):
        raise InputError(f"route input must be a tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise InputError(f"route input must be a floating-point tensor, got {x.dtype}")
    if not x.is_contiguous():
        raise InputError("route input must be contiguous (got a strided view); call .contiguous()")
    return x.reshape(-1)


@dataclass
class Payload:
    """What one rank puts on the wire: packed codes and the per-chunk scales."""

    codes: torch.Tensor  # uint8, packed
    scales: torch.Tensor  # float32, one per chunk (empty for float routes)
    numel: int
    segments: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + 4 * self.scales.numel()


class Route:
    """One way a gradient slice crosses the fabric. Subclasses: float and code routes.

    Contract for a new route (`CodeRoute` implements the flow of the low-bit ones, so a
    low-bit route usually only fills in its codes, see there):

    - **Implement** `plan` (the collectives it issues, for exact byte accounting), `reduce`
      (the real collective: this rank's flat gradient in, the mean every rank agrees on out),
      `simulate` (the same result for N ranks' gradients in one process), and `encode` /
      `decode` (the local roundtrip error feedback subtracts).
    - **Agreement.** `reduce` must return bit-identical tensors on every rank, and equal to
      `simulate` on the same gradients bit for bit. The simulator, calibration and the update
      guard rely on this (`tests/calibration/test_simulate.py`). A result depends only on its
      own chunk: chunks never span the parameters given as `segments`.
    - **Collectives.** Issue them only through `comm`, in the same order on every rank, and
      synchronously. The hook calls `reduce` on one thread at a time, group after group.
    - **Thread safety.** One instance may serve several groups of a step. Keep no per-call
      state on `self`; per-step results go into the `stats` dict passed in (e.g. the sign
      vote's `agree_sum` / `agree_n`).
    - **Raises.** `check_world` raises `InputError` for a world size the route cannot aggregate
      exactly (`max_world_size`); bad input tensors raise `InputError` (`check_input`).
      Nothing else is expected to raise: the hook turns an exception into a failed step on
      every rank.
    - **Register** it in `routes/__init__.py` (`make_route`) and `routes/spec.py`
      (`ROUTE_NAMES`), so profiles can name it.
    """

    name = "route"
    max_world_size = 1 << 20

    def __init__(self, spec: RouteSpec) -> None:
        self.spec = spec

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec.label()})"

    # -- contract --------------------------------------------------------------------------
    def plan(self, numel: int, world_size: int, segments: tuple[int, ...] | None = None) -> list[CommOp]:
        raise NotImplementedError

    def wire_bytes(
        self, numel: int, world_size: int, rank: int = 1, segments: tuple[int, ...] | None = None
    ) -> WireBytes:
        """Exact bytes rank `rank` sends and receives to aggregate `numel` elements."""
        return plan_wire_bytes(self.plan(numel, world_size, segments), world_size, rank)

    def reduce(
        self,
        flat: torch.Tensor,
        comm: Comm,
        segments: tuple[int, ...] | None = None,
        stats: Sink | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Real collective: this rank's gradient in, the agreed mean out (may reuse `flat`)."""
        raise NotImplementedError

    def simulate(
        self,
        grads: Sequence[torch.Tensor],
        segments: tuple[int, ...] | None = None,
        stats: Sink | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> torch.Tensor:
        """Single-process simulation: N workers' gradients in, what every rank receives out."""
        raise NotImplementedError

    def encode(self, x: torch.Tensor, segments: Segments = None, noise: Noise = None) -> Payload:
        raise NotImplementedError

    def decode(self, payload: Payload) -> torch.Tensor:
        raise NotImplementedError

    def roundtrip(
        self, x: torch.Tensor, segments: Segments = None, noise: Noise = None
    ) -> torch.Tensor:
        """decode(encode(x)) with local scales: what error feedback subtracts. `noise`: the
        rank's codec noise as sent (`codec_noise`): stochastic rounding's uniform draws or a
        generator to draw them from (None: the global generator), sign's zero vote."""
        return self.decode(self.encode(x, segments, noise))

    def check_world(self, world_size: int) -> None:
        if world_size < 1:
            raise InputError(f"world size must be >= 1, got {world_size}")
        if world_size > self.max_world_size:
            raise InputError(
                f"route {self.name} aggregates exactly only up to {self.max_world_size} ranks; "
                f"got world size {world_size}"
            )


def padded_payload_nbytes(nbytes: int, world_size: int) -> int:
    """Pad so each of the W shards is a whole number of 8-byte groups (any result width fits)."""
    unit = 8 * world_size
    return -(-nbytes // unit) * unit


class CodeRoute(Route):
    """Shared flow of the low-bit routes; subclasses define codes and how they combine."""

    elems_per_byte = 1  # payload packing density
    pad_byte = 0  # a byte that encodes "zero" codes, used to pad payloads to whole shards
    scale_agreement = "max"  # "max" (exact all-reduce MAX) or "mean" (rank-ordered mean)

    # -- subclass hooks ---------------------------------------------------------------------
    def agreement(self, world_size: int) -> str:
        """How the ranks agree chunk scales at `world_size`: "max" (an all-reduce before the
        codes), "mean" (local scales ride with the codes, their rank-ordered mean decodes the
        combined codes) or "local" (they ride with the codes, each rank's codes decode on its
        own: `IntRoute`)."""
        return self.scale_agreement

    def local_scales(self, x: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
        raise NotImplementedError

    def encode_codes(
        self, x: torch.Tensor, layout: ChunkLayout, scales: torch.Tensor, gen: torch.Generator | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The packed codes of `x` under agreed `scales`; where the route can, written into
        `out` (uint8, at least the payload's bytes: the exchange's wire buffer), else new."""
        raise NotImplementedError

    def combine(
        self, shards: Sequence[torch.Tensor], world_size: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Packed payload shards from every rank -> (combined int64 values, per-element
        agreement in [0, 1] for the health monitor, or None where a route has no such signal)."""
        raise NotImplementedError

    def result_range(self, world_size: int) -> tuple[int, int]:
        """Inclusive range of combined values, for packing the result."""
        raise NotImplementedError

    def result_map(self, world_size: int) -> tuple[int, int]:
        """(mul, lo): a code c of the packed result stands for the combined value mul * c + lo."""
        return 1, self.result_range(world_size)[0]

    def decode_values(
        self, values: torch.Tensor, scales: torch.Tensor, layout: ChunkLayout, world_size: int
    ) -> torch.Tensor:
        """Combined values -> the decoded mean, natively (`decode_mode`) or in torch
        (`_decode_values_torch`): the same float ops, so the same bits."""
        k = kernels.native(values)
        if k is not None:
            return k.decode_values(values, layout, *self.decode_mode(scales, world_size))
        return self._decode_values_torch(values, scales, layout, world_size)

    def _decode_values_torch(
        self, values: torch.Tensor, scales: torch.Tensor, layout: ChunkLayout, world_size: int
    ) -> torch.Tensor:
        raise NotImplementedError

    def native_combine(self, world_size: int) -> tuple[str, int | torch.Tensor] | None:
        """How the native kernels combine this route's codes (`combine_packed`): the raw code
        kind they sum (a `kernels.SUM_KINDS` key) and the combined value of a sum c, either
        `c + offset` (an int) or `values[c]` (a tensor per possible sum: the sign vote). None:
        `combine` then `_pack_result`, in torch."""
        return None

    def decode_mode(self, scales: torch.Tensor, world_size: int) -> tuple[torch.Tensor, int, float]:
        """How the native kernels decode combined values v: (scales s, mode, d), mode 0 `v * s`,
        1 `(v / d) * s`, 2 `((2v - d) / d) * s`; the same float ops as `decode_values`."""
        raise NotImplementedError

    def default_noise(self, rank: int) -> Noise:
        """The noise `reduce` and `simulate` give rank `rank` when the caller passes none (the
        hook and the calibration simulator always pass `codec_noise`): None, except sign's
        zero vote of step 0."""
        return None

    def local_decode(self, payload: Payload, layout: ChunkLayout) -> torch.Tensor:
        raise NotImplementedError

    def silent_margin(self, world_size: int) -> int | None:
        """The vote margin |2c - W| of an element that is exactly zero on every rank, for a
        route whose combine has a vote agreement (sign); None: no agreement."""
        return None

    def exclude_silent(self, tally: Tally | None, scales: torch.Tensor, layout: ChunkLayout,
                       world_size: int) -> None:
        """Leave the elements of chunks whose agreed scale is 0 out of the vote agreement.
        They decode to exactly 0 whatever the votes say, and are exactly zero on every rank
        (but for a mean |g| that underflows float32), so each voted the zero vote: under the
        split vote a tie, which read as a collapse where such chunks were most of a scope (a
        zero-initialised residual branch, whose every weight has no gradient at step 0, tripped
        vision's backbone to fp32 for 15 steps). Every path that tallies agreement calls this
        with the scales it decodes on (`Exchange`, `reduce`, `simulate`), so the simulator and
        the hook agree bit for bit. No host read."""
        margin = self.silent_margin(world_size)
        if tally is None or margin is None:
            return
        tally.remove(silent_per_range(layout, scales, tally.ends), margin, world_size)

    # -- sizes -------------------------------------------------------------------------------
    def payload_nbytes(self, numel: int) -> int:
        return -(-numel // self.elems_per_byte)

    def result_bits(self, world_size: int) -> int:
        lo, hi = self.result_range(world_size)
        return bits_for_levels(hi - lo + 1)

    def _sizes(self, numel: int, world_size: int) -> tuple[int, int]:
        """(padded payload bytes, full result bytes)."""
        padded = padded_payload_nbytes(self.payload_nbytes(numel), world_size)
        result = padded * self.elems_per_byte * self.result_bits(world_size) // 8
        return padded, result

    def gathers_codes(self, world_size: int) -> bool:
        """Whether a sharded reduce moves fewer bytes by all-gathering every rank's codes and
        combining them on each rank, than by the all-to-all of code shards and all-gather of
        combined shards: (W-1)·c < (W-1)/W·(c + r) bits per element, c the code width and
        r the result's, i.e. (W-1)·c < r. True at W = 2 for every route (the sum of two
        codes is wider than one), and for ternary also at W = 3 (1.6-bit codes, 4-bit sums).
        One collective less, too (`exchange.py`)."""
        return (self.spec.reducer == "sharded"
                and (world_size - 1) * 8 < self.result_bits(world_size) * self.elems_per_byte)

    def plan(self, numel: int, world_size: int, segments: tuple[int, ...] | None = None) -> list[CommOp]:
        self.check_world(world_size)
        if world_size == 1 or numel == 0:
            return []
        layout = chunk_layout(check_segments(numel, segments), self.spec.effective_chunk)
        scales = 4 * layout.nchunks
        padded, result = self._sizes(numel, world_size)
        # max-agreed scales need a round of their own (the codes use them); local scales ride
        # with the codes (`exchange.py`), or are all-gathered (central)
        local = self.agreement(world_size) != "max"
        agree = [] if local else [CommOp("allreduce", scales)]
        if self.gathers_codes(world_size):
            code_bytes = padded_payload_nbytes(self.payload_nbytes(numel), 1)
            return [*agree, CommOp("all_gather", code_bytes + (scales if local else 0))]
        if self.spec.reducer == "sharded":
            if local:
                padded += world_size * scales
            return [*agree, CommOp("all_to_all", padded), CommOp("all_gather", result // world_size)]
        if local:
            agree = [CommOp("all_gather", scales)]
        return [*agree, CommOp("gather", padded), CommOp("broadcast", result)]

    # -- local codec ---------------------------------------------------------------------------
    def encode(
        self, x: torch.Tensor, segments: Segments = None, noise: Noise = None,
        out: torch.Tensor | None = None,
    ) -> Payload:
        """Codes on the local scales; written into `out` (uint8) where the route can."""
        x = check_input(x).float()
        segs = check_segments(x.numel(), segments)
        layout = chunk_layout(segs, self.spec.effective_chunk)
        scales = self.local_scales(x, layout)
        return Payload(self.encode_codes(x, layout, scales, noise, out), scales, x.numel(), segs)

    def decode(self, payload: Payload) -> torch.Tensor:
        layout = chunk_layout(payload.segments, self.spec.effective_chunk)
        return self.local_decode(payload, layout)

    # -- aggregation -----------------------------------------------------------------------------
    def _pack_result(self, values: torch.Tensor, world_size: int) -> torch.Tensor:
        lo, _ = self.result_range(world_size)
        return pack_uint(values - lo, self.result_bits(world_size))

    def _unpack_result(self, packed: torch.Tensor, numel: int, world_size: int) -> torch.Tensor:
        mul, lo = self.result_map(world_size)
        values = unpack_uint(packed, numel, self.result_bits(world_size)).to(torch.int64)
        return (values * mul if mul != 1 else values).add_(lo)  # unpack's copy: ours to modify

    def _decode_result(
        self, packed: torch.Tensor, numel: int, world_size: int, scales: torch.Tensor,
        layout: ChunkLayout, out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The packed combined result -> what every rank returns. Natively straight from the
        codes (unpacking to int64 first cost 10-30x the decode: two fresh 8-byte-per-element
        tensors, mostly page faults), into `out` when given (the rank's own input: memory
        that is already mapped); else unpacked and `decode_values`. Same bits either way."""
        k = kernels.native(packed)
        if k is None:
            values = self._unpack_result(packed, numel, world_size)
            return self.decode_values(values, scales, layout, world_size)
        mul, lo = self.result_map(world_size)
        s, mode, d = self.decode_mode(scales, world_size)
        return k.decode_codes(packed, self.result_bits(world_size), layout, s, mode, d, mul, lo,
                              out=out)

    def combine_packed(
        self, shards: Sequence[torch.Tensor], world_size: int, valid: int,
        stats: Sink | None,
    ) -> torch.Tensor:
        """The shards' combined result, packed as it travels back (`_pack_result`), with the
        agreement of the first `valid` elements added to `stats`. Natively in one pass over the
        shards (`native_combine`), else `combine`, `_record_agreement` and `_pack_result`: the
        same bytes and the same agreement sums either way."""
        k = kernels.native(shards[0])
        how = self.native_combine(world_size) if k is not None else None
        tally = Tally.of(stats, valid)
        if how is None:
            values, agree = self.combine(shards, world_size)
            self._record_agreement(agree, world_size, tally)
            return self._pack_result(values, world_size)
        kind, bits, offset, table = self._result_codes(world_size)
        if table is None:  # only a vote (a table of codes per count) has an agreement
            return k.combine_pack(shards, kind, bits, offset=offset)
        return k.combine_pack(shards, kind, bits, table=table, tally=tally)

    def combine_decode(
        self, shards: Sequence[torch.Tensor], world_size: int, scales: torch.Tensor,
        layout: ChunkLayout, out: torch.Tensor, stats: Sink | None,
    ) -> torch.Tensor:
        """Every rank's whole codes combined and decoded into `out` (`layout.numel` elements),
        with their agreement added to `stats`: `combine_packed` then `_decode_result`, bit for
        bit, natively in one pass without the packed result (a reduce that gathered codes
        needs no result to send)."""
        k = kernels.native(shards[0])
        how = self.native_combine(world_size) if k is not None else None
        n = layout.numel
        if how is None:
            packed = self.combine_packed(shards, world_size, n, stats)
            return self._decode_result(packed, n, world_size, scales, layout, out=out)
        kind, value = how
        s, mode, d = self.decode_mode(scales, world_size)
        table = value if isinstance(value, torch.Tensor) else None
        # only a vote (a table of values per count) has an agreement, as in combine_packed
        k.combine_decode(shards, kind, layout, s, mode, d, out,
                         offset=0 if table is not None else value, values=table,
                         tally=Tally.of(stats, n) if table is not None else None)
        return out

    @functools.lru_cache(maxsize=64)  # noqa: B019 - routes are cached, stateless singletons
    def _result_codes(self, world_size: int) -> tuple[str, int, int, torch.Tensor | None]:
        """`native_combine` as the kernel takes it, once per world size: (code kind, result
        bits, offset from a sum to its result code, or the int32 code of every sum)."""
        kind, value = self.native_combine(world_size)
        mul, lo = self.result_map(world_size)
        bits = self.result_bits(world_size)
        if isinstance(value, torch.Tensor):  # a code per possible sum
            table = torch.div(value.to(torch.int64) - lo, mul, rounding_mode="floor")
            return kind, bits, 0, table.to(torch.int32)
        assert mul == 1, "an offset result needs codes of unit step"
        return kind, bits, value - lo, None

    def _pad(self, codes: torch.Tensor, padded: int) -> torch.Tensor:
        if codes.numel() == padded:
            return codes
        out = torch.full((padded,), self.pad_byte, dtype=torch.uint8, device=codes.device)
        out[: codes.numel()] = codes
        return out

    @staticmethod
    def _record_agreement(agree: torch.Tensor | None, w: int, tally: Tally | None) -> None:
        """Add the vote margins |2c - W| (integers, so sums are exact in any grouping or
        order) and W per element, per range of `tally`: agree_sum / agree_n is the mean
        agreement |2c - W| / W."""
        if tally is not None and agree is not None:
            tally.add(tally.split(agree, w), w)

    def reduce(
        self,
        flat: torch.Tensor,
        comm: Comm,
        segments: tuple[int, ...] | None = None,
        stats: Sink | None = None,
        generator: Noise = None,
    ) -> torch.Tensor:
        x = check_input(flat).float()
        w, n = comm.world_size, x.numel()
        self.check_world(w)
        if generator is None:
            generator = self.default_noise(comm.rank)
        if w == 1 or n == 0:
            return self.simulate([x], segments, stats, [generator])
        if self.spec.reducer == "sharded":  # a bucket of one piece (`exchange.py`)
            from nfabric_cli.routes.exchange import Piece, reduce_pieces

            reduce_pieces([Piece(self, x, check_segments(n, segments), stats, generator)], comm)
            return x
        layout = chunk_layout(check_segments(n, segments), self.spec.effective_chunk)
        _, result_nbytes = self._sizes(n, w)
        if self.agreement(w) == "mean":  # codes from the local scales, in one visit
            payload = self.encode(x, segments, generator)
            local, codes = payload.scales, payload.codes
            agreed = sum_in_rank_order(comm.all_gather(local).view(w, -1).unbind(0)) / w
        else:
            local = self.local_scales(x, layout)
            agreed = comm.allreduce(local.clone(), op=torch.distributed.ReduceOp.MAX)
            codes = self.encode_codes(x, layout, agreed, generator)
        parts = comm.gather(self._pad(codes, self._sizes(n, w)[0]))
        packed = torch.empty(result_nbytes, dtype=torch.uint8, device=x.device)
        if parts is not None:  # rank 0 alone tallies the agreement
            packed = self.combine_packed(parts, w, n, stats)
            self.exclude_silent(Tally.of(stats, n), agreed, layout, w)
        comm.broadcast(packed)
        # decoded into the input's own memory (the contract lets reduce reuse `flat`)
        return self._decode_result(packed, n, w, agreed, layout, out=x)

    def simulate(
        self,
        grads: Sequence[torch.Tensor],
        segments: tuple[int, ...] | None = None,
        stats: Sink | None = None,
        generators: Sequence[Noise] | None = None,
    ) -> torch.Tensor:
        xs = [check_input(g).float() for g in grads]
        w, n = len(xs), xs[0].numel()
        self.check_world(w)
        if n == 0:
            return torch.zeros(0, device=xs[0].device)
        gens = [self.default_noise(r) if g is None else g
                for r, g in enumerate(generators if generators is not None else [None] * w)]
        segs = check_segments(n, segments)
        layout = chunk_layout(segs, self.spec.effective_chunk)
        if self.agreement(w) == "local":  # every rank's codes on its own scales, as gathered
            payloads = [self.encode(x, segs, g) for x, g in zip(xs, gens, strict=True)]
            scales = torch.stack([p.scales for p in payloads])
            return self.combine_decode([p.codes for p in payloads], w, scales, layout,
                                       torch.empty(n, device=xs[0].device), stats)
        local = [self.local_scales(x, layout) for x in xs]
        if self.agreement(w) == "max":
            agreed = local[0].clone()
            for s in local[1:]:
                torch.maximum(agreed, s, out=agreed)
            code_scales = [agreed] * w
        else:
            agreed = sum_in_rank_order(local) / w
            code_scales = local
        padded, _ = self._sizes(n, w)
        codes = [
            self._pad(self.encode_codes(x, layout, s, g), padded)
            for x, s, g in zip(xs, code_scales, gens, strict=True)
        ]
        values, agree = self.combine(codes, w)
        tally = Tally.of(stats, n)
        self._record_agreement(agree, w, tally)
        self.exclude_silent(tally, agreed, layout, w)
        return self.decode_values(values[:n], agreed, layout, w)
