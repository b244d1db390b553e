"""Every sharded low-bit reduce of a bucket in at most two collectives.

A bucket often holds several low-bit reduces: sign beside int8, one route's parameters split
by another route's (each consecutive run of them is reduced where it lies). Reduced one after
another, each paid its own collectives; here they share them:

1. every piece encodes its codes (int8 / int4 that shard first agree their chunk scales: one
   MAX all-reduce for all such pieces of the bucket together, since their codes need the
   agreed scale; sign / ternary, and int8 / int4 that gather codes, use their local scales,
   which ride with the codes: `CodeRoute.agreement`);
2. **one all-to-all** for the pieces that shard: to rank d, the d-th shard of each one's
   codes, followed by its local scales where the route sends them (`_put` lays them out);
   each rank combines its shard of each (the routes' `combine_packed`);
3. **one all-gather** of this rank's combined shards, followed by the whole codes (and
   scales) of the pieces that gather codes instead, which is fewer bytes where the combined
   result is wider than (W - 1) codes (`CodeRoute.gathers_codes`: every route at W = 2, whose
   all-to-all then drops out); every rank combines those pieces itself;
4. each piece decodes its full result straight into its own memory (`Piece.x`).

A `Rider` (the hook's step statistics, `runtime/agree.py`) may travel at the end of each
rank's all-gather row: a few bytes every rank adds and gets every rank's back, for the price
of no round of its own.

Every piece's result is bit for bit what its route's own `reduce` and `simulate` give (shards,
padding and scales per piece exactly as there, and every rank combines the same bytes in the
same order), so the simulator is unchanged and the byte accounting is the pieces' own plans
(`Route.plan`) added up; only the number of rounds drops. Ranks issue the same collectives in
the same order as long as they hand the same pieces in the same order, which the hook does
(`runtime/state.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from nfabric_cli.routes.base import CodeRoute, Noise, padded_payload_nbytes
from nfabric_cli.routes.chunks import ChunkLayout, check_segments, chunk_layout
from nfabric_cli.routes.comm import Comm, Pending, sum_in_rank_order
from nfabric_cli.routes.tally import Sink, Tally

#: Key of the sub-dict of a piece's `stats` that receives the agreement sums of a piece
#: combined whole on every rank (it gathers codes): complete on each rank, the same on all,
#: so they are not summed over ranks. A sharded piece adds its shard's sums to `stats` itself.
WHOLE = "whole"


class Rider(Protocol):
    """A small payload carried by an exchange's all-gather: `nbytes` known when the exchange
    starts, `payload()` asked for when the all-gather is issued, `land(rows)` given every
    rank's payload (W rows of `nbytes` bytes) once it has arrived."""

    nbytes: int

    def payload(self) -> torch.Tensor: ...

    def land(self, rows: torch.Tensor) -> None: ...


@dataclass
class Piece:
    """One sharded low-bit reduce: `x` (float32, contiguous, 1-D) is this rank's gradient in,
    the agreed result out, in place. `stats` collects the route's agreement sums: one scope's
    dict, or a `Tally` of the scopes its parameters report to."""

    route: CodeRoute
    x: torch.Tensor
    segments: tuple[int, ...]
    stats: Sink | None = None
    noise: Noise = None


@dataclass
class _Sizes:
    """A piece's wire layout: the code bytes it sends per peer (one shard of W, or all of them
    when it gathers codes), the scales it sends along, its combined shard's bytes."""

    layout: ChunkLayout
    gathered: bool  # every rank's whole codes go to every rank (`CodeRoute.gathers_codes`)
    codes: int  # code bytes per peer: a shard (sharded) or the padded codes (gathered)
    scale_bytes: int  # local scales sent along to every rank (mean-agreed routes), else 0
    result: int  # packed result bytes of one rank's shard (sharded), else 0

    @property
    def block(self) -> int:
        return self.codes + self.scale_bytes


def _sizes(p: Piece, w: int) -> _Sizes:
    n, route = p.x.numel(), p.route
    layout = chunk_layout(check_segments(n, p.segments), route.spec.effective_chunk)
    scales = 4 * layout.nchunks if route.agreement(w) != "max" else 0
    if route.gathers_codes(w):
        return _Sizes(layout, True, padded_payload_nbytes(route.payload_nbytes(n), 1), scales, 0)
    padded, result = route._sizes(n, w)
    return _Sizes(layout, False, padded // w, scales, result // w)


def reduce_pieces(pieces: Sequence[Piece], comm: Comm, slot: object = None) -> None:
    """Reduce every piece with at most one all-to-all and one all-gather (plus one MAX
    all-reduce when a piece's route agrees max scales); results land in each piece's `x`."""
    ex = Exchange(pieces, comm, slot)
    ex.start()
    ex.middle()
    ex.finish()


class Exchange:
    """`reduce_pieces` in three stages, so a caller can work between them while the wire
    does: `start` encodes and issues the first collective, `middle` combines what it
    brought and issues the all-gather, `finish` waits for it and decodes. Each stage issues
    its collectives in a fixed order, and a caller that calls the stages of its exchanges in
    a fixed order keeps every rank's collective order identical (`runtime/bucket.py`). The
    wire buffers are `comm`'s scratch under `slot` (the hook keeps one per bucket of a step),
    reused from step to step: a slot's exchange must finish before the slot is used again.
    A `rider` travels only where there is an all-gather (pieces to reduce, W > 1); elsewhere
    `self.rider` is None and the caller sends it another way."""

    def __init__(self, pieces: Sequence[Piece], comm: Comm, slot: object = None,
                 rider: Rider | None = None) -> None:
        self.pieces = [p for p in pieces if p.x.numel()]
        self.comm, self.slot = comm, slot
        self.rider = rider if self.pieces and comm.world_size > 1 else None
        w = comm.world_size
        for p in self.pieces:
            p.route.check_world(w)
            assert p.x.dtype == torch.float32 and p.x.is_contiguous(), "pieces are float32 views"
        self.sizes = [_sizes(p, w) for p in self.pieces] if w > 1 else []
        self.sharded = [i for i, s in enumerate(self.sizes) if not s.gathered]
        self._codes: list[torch.Tensor] = []
        self._scales: list[torch.Tensor] = []
        self._mine: torch.Tensor | None = None  # this rank's part of the all-gather ...
        self._results: torch.Tensor | None = None  # ... and every rank's
        self._wire: Pending | None = None  # the collective in flight
        self._rider_at = 0  # byte offset of the rider in each all-gather row

    def start(self) -> None:
        """Encode every piece (int scales agreed first, in one blocking MAX all-reduce) and
        issue the all-to-all of the sharded pieces, or, with none, the all-gather."""
        if not self.pieces:
            return
        comm, w = self.comm, self.comm.world_size
        if w == 1:
            for p in self.pieces:
                p.x.copy_(p.route.simulate([p.x], p.segments, p.stats, [p.noise]))
            return
        dev = self.pieces[0].x.device
        # this rank's all-gather contribution: the sharded pieces' combined shards, then the
        # gathering pieces' codes and scales (encoded in place where the route can)
        total = sum(s.result or s.block for s in self.sizes)
        self._rider_at = total  # the rider, if any, ends each row
        total += self.rider.nbytes if self.rider is not None else 0
        self._mine, self._results = comm.gather_buffers((self.slot, "gather"), total,
                                                        torch.uint8, dev)
        dests, off = [], sum(self.sizes[i].result for i in self.sharded)
        for s in self.sizes:
            dests.append(self._mine[off : off + s.codes] if s.gathered else None)
            off += s.block if s.gathered else 0
        self._codes, self._scales = _encode(self.pieces, self.sizes, comm, dests)
        if self.sharded:
            self._wire = self._all_to_all()
        else:
            self._wire = self._all_gather()

    def middle(self) -> None:
        """Combine this rank's shards of the sharded pieces and issue the all-gather."""
        if not self.sharded or self._mine is None:
            return
        recv = self._wire.wait().view(self.comm.world_size, -1)
        w, rank, off, roff = self.comm.world_size, self.comm.rank, 0, 0
        for i in self.sharded:
            p, s = self.pieces[i], self.sizes[i]
            shards = [recv[r, off : off + s.codes] for r in range(w)]
            shard_elems = s.codes * p.route.elems_per_byte
            valid = max(0, min(shard_elems, p.x.numel() - rank * shard_elems))
            whole = Tally.of(p.stats, p.x.numel())
            tally = whole.window(rank * shard_elems, valid) if whole is not None else None
            self._mine[roff : roff + s.result] = p.route.combine_packed(shards, w, valid, tally)
            if s.scale_bytes:
                self._scales[i] = _agreed(p.route, recv, off + s.codes, s, w)
            # every rank has every chunk's agreed scale: the whole piece's silent chunks, once
            # (asked first so that a route with none adds no empty WHOLE dict to its scope)
            if whole is not None and p.route.silent_margin(w) is not None:
                p.route.exclude_silent(whole.sub(WHOLE), self._scales[i], s.layout, w)
            off, roff = off + s.block, roff + s.result
        self._wire = self._all_gather()

    def finish(self) -> None:
        """Wait for the all-gather and decode every piece into its own memory."""
        if self._wire is None:
            return
        w = self.comm.world_size
        results, self._wire = self._wire.wait().view(w, -1), None
        if self.rider is not None:
            self.rider.land(results[:, self._rider_at :])
        off = 0
        for i in self.sharded:
            p, s = self.pieces[i], self.sizes[i]
            packed = results[:, off : off + s.result]
            packed = packed.reshape(-1) if len(self.pieces) == 1 else packed.contiguous().view(-1)
            _decode(p, s, packed, self._scales[i], w)
            off += s.result
        for p, s, sc in zip(self.pieces, self.sizes, self._scales, strict=True):
            if not s.gathered:
                continue
            shards = [results[r, off : off + s.codes] for r in range(w)]
            # every rank combines every element, so every rank holds the whole agreement
            tally = Tally.of(p.stats, p.x.numel())
            stats = tally.sub(WHOLE) if tally is not None else None
            agreed = _agreed(p.route, results, off + s.codes, s, w) if s.scale_bytes else sc
            out = p.route.combine_decode(shards, w, agreed, s.layout, p.x, stats)
            p.route.exclude_silent(stats, agreed, s.layout, w)
            if out.data_ptr() != p.x.data_ptr():  # the torch path decodes into new memory
                p.x.copy_(out)
            off += s.block

    def _all_to_all(self) -> Pending:
        """To rank d, shard d of each sharded piece's codes and its local scales (`_put`)."""
        comm, w = self.comm, self.comm.world_size
        dev = self.pieces[0].x.device
        block = sum(self.sizes[i].block for i in self.sharded)
        send = comm.scratch((self.slot, "send"), w * block, torch.uint8, dev).view(w, block)
        off = 0
        for i in self.sharded:
            s = self.sizes[i]
            _put(send[:, off : off + s.block], self._codes[i], self._scales[i], s,
                 self.pieces[i].route.pad_byte)
            off += s.block
        recv = comm.scratch((self.slot, "recv"), w * block, torch.uint8, dev)
        return comm.all_to_all_async(send.view(-1), out=recv)

    def _all_gather(self) -> Pending:
        """Lay the gathering pieces' codes and scales after the combined shards in `mine`,
        and issue its all-gather."""
        mine, off = self._mine, sum(self.sizes[i].result for i in self.sharded)
        for p, s, c, sc in zip(self.pieces, self.sizes, self._codes, self._scales, strict=True):
            if s.gathered:
                _put(mine[off : off + s.block].view(1, s.block), c, sc, s, p.route.pad_byte)
                off += s.block
        if self.rider is not None:
            mine[self._rider_at :] = self.rider.payload()
        return self.comm.all_gather_async(mine, out=self._results)


def _put(dst: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, s: _Sizes, pad: int) -> None:
    """Lay one piece's codes over the rows of `dst` (R, block), `s.codes` bytes per row, the
    rest padded with the route's zero code, each row followed by all its local scales (if
    it sends them): R = W shards, or one row of whole codes."""
    rows = dst.shape[0]
    full, rest = divmod(codes.numel(), s.codes)
    if codes.data_ptr() != dst.data_ptr():  # (not encoded in place: `_encode`'s `dests`)
        dst[:full, : s.codes] = codes[: full * s.codes].view(full, s.codes)
    if full < rows:
        dst[full, :rest] = codes[full * s.codes :]
        dst[full, rest : s.codes] = pad
        dst[full + 1 :, : s.codes] = pad
    if s.scale_bytes:
        dst[:, s.codes : s.block] = scales.contiguous().view(torch.uint8)


def _agreed(route: CodeRoute, rows: torch.Tensor, at: int, s: _Sizes, w: int) -> torch.Tensor:
    """The scales a piece decodes on, from the W ranks' local scales found at byte `at` of
    each row: all of them, a row per rank ("local"), or their mean summed in rank order (as
    every rank and the simulator sum them)."""
    local = rows[:, at : at + s.scale_bytes].contiguous().view(torch.float32)
    return local if route.agreement(w) == "local" else sum_in_rank_order(local.unbind(0)) / w


def _decode(p: Piece, s: _Sizes, packed: torch.Tensor, scales: torch.Tensor, w: int) -> None:
    out = p.route._decode_result(packed, p.x.numel(), w, scales, s.layout, out=p.x)
    if out.data_ptr() != p.x.data_ptr():  # the torch path decodes into new memory
        p.x.copy_(out)


def _encode(
    pieces: Sequence[Piece], sizes: Sequence[_Sizes], comm: Comm,
    dests: Sequence[torch.Tensor | None],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each piece's packed codes, and its scales: the agreed MAX for max-agreed routes (one
    all-reduce for all of them), else the local ones (they travel with the codes). A piece
    with a `dests` buffer (its place on the wire) is encoded there where its route can."""
    codes: list[torch.Tensor | None] = [None] * len(pieces)
    scales: list[torch.Tensor | None] = [None] * len(pieces)
    w = comm.world_size
    maxed = [i for i, p in enumerate(pieces) if p.route.agreement(w) == "max"]
    for i, p in enumerate(pieces):
        if i not in maxed:  # codes from the local scales, in one visit where the codec can
            payload = p.route.encode(p.x, p.segments, p.noise, dests[i])
            codes[i], scales[i] = payload.codes, payload.scales
    if maxed:
        local = [pieces[i].route.local_scales(pieces[i].x, sizes[i].layout) for i in maxed]
        flat = comm.allreduce(torch.cat(local), op=dist.ReduceOp.MAX)
        for i, agreed in zip(maxed, flat.split([t.numel() for t in local]), strict=True):
            p = pieces[i]
            scales[i] = agreed
            codes[i] = p.route.encode_codes(p.x, sizes[i].layout, agreed, p.noise, dests[i])
    return codes, scales  # type: ignore[return-value]
