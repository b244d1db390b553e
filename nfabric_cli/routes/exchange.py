"""Every sharded low-bit reduce of a bucket in two collectives: one all-to-all, one all-gather.

A bucket often holds several low-bit reduces: two regions on sign, sign beside int8, one
region's parameters split by another's (each consecutive run of them is reduced where it
lies). Reduced one after another, each paid its own collectives; here they share them:

1. every piece encodes its codes (int8 / int4 first agree their chunk scales: one MAX
   all-reduce for all such pieces of the bucket together, since their codes need the agreed
   scale; sign / ternary use their local scales, which ride with the codes);
2. **one all-to-all**: to rank d, the d-th shard of every piece's codes, each followed by that
   piece's local scales where the route sends them (`_pack_send` lays them out);
3. each rank combines its shard of every piece (the routes' `combine_packed`) into one buffer;
4. **one all-gather** of those combined shards;
5. each piece decodes its full result straight into its own memory (`Piece.x`).

Every piece's result is bit for bit what its route's own `reduce` and `simulate` give (shards,
padding and scales per piece exactly as there), so the simulator and the byte accounting
(`Route.plan`, summed over pieces) are unchanged; only the number of rounds drops. A run of
ranks issues the same collectives in the same order as long as it hands the same pieces in
the same order, which the hook does (`runtime/state.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nfabric_cli.routes.base import CodeRoute, Noise, padded_payload_nbytes
from nfabric_cli.routes.chunks import ChunkLayout, check_segments, chunk_layout
from nfabric_cli.routes.comm import Comm, sum_in_rank_order


@dataclass
class Piece:
    """One sharded low-bit reduce: `x` (float32, contiguous, 1-D) is this rank's gradient in,
    the agreed result out, in place. `stats` collects the route's agreement sums."""

    route: CodeRoute
    x: torch.Tensor
    segments: tuple[int, ...]
    stats: dict | None = None
    noise: Noise = None


@dataclass
class _Sizes:
    """A piece's wire layout: codes padded to W shards, the scales it sends, its result shard."""

    layout: ChunkLayout
    shard: int  # code bytes per rank
    scale_bytes: int  # local scales sent along to every rank (mean-agreed routes), else 0
    result: int  # packed result bytes of one rank's shard

    @property
    def block(self) -> int:
        return self.shard + self.scale_bytes


def _sizes(p: Piece, w: int) -> _Sizes:
    n = p.x.numel()
    layout = chunk_layout(check_segments(n, p.segments), p.route.spec.effective_chunk)
    padded, result = p.route._sizes(n, w)
    scales = 4 * layout.nchunks if p.route.scale_agreement == "mean" else 0
    assert padded == padded_payload_nbytes(p.route.payload_nbytes(n), w)
    return _Sizes(layout, padded // w, scales, result // w)


def reduce_pieces(pieces: Sequence[Piece], comm: Comm, slot: object = None) -> None:
    """Reduce every piece with one all-to-all and one all-gather (plus one MAX all-reduce when
    a piece's route agrees max scales); results land in each piece's `x`. The wire buffers are
    `comm`'s scratch under `slot` (the hook keeps one per bucket), reused from step to step."""
    pieces = [p for p in pieces if p.x.numel()]
    w = comm.world_size
    if not pieces:
        return
    if w == 1:
        for p in pieces:
            p.route.check_world(1)
            p.x.copy_(p.route.simulate([p.x], p.segments, p.stats, [p.noise]))
        return
    for p in pieces:
        p.route.check_world(w)
        assert p.x.dtype == torch.float32 and p.x.is_contiguous(), "pieces are float32 views"
    sizes = [_sizes(p, w) for p in pieces]
    codes, scales = _encode(pieces, sizes, comm)
    dev = pieces[0].x.device
    block = sum(s.block for s in sizes)
    send = comm.scratch((slot, "send"), w * block, torch.uint8, dev).view(w, block)
    _pack_send(send, pieces, sizes, codes, scales)
    recv = comm.scratch((slot, "recv"), w * block, torch.uint8, dev)
    recv = comm.all_to_all(send.view(-1), out=recv).view(w, block)
    mine = comm.scratch((slot, "mine"), sum(s.result for s in sizes), torch.uint8, dev)
    off = roff = 0
    agreed = []
    for p, s, sc in zip(pieces, sizes, scales, strict=True):
        shards = [recv[r, off : off + s.shard] for r in range(w)]
        shard_elems = s.shard * p.route.elems_per_byte
        valid = max(0, min(shard_elems, p.x.numel() - comm.rank * shard_elems))
        mine[roff : roff + s.result] = p.route.combine_packed(shards, w, valid, p.stats)
        if s.scale_bytes:  # every rank's local scales, summed in rank order: the agreed mean
            rows = recv[:, off + s.shard : off + s.block].contiguous().view(torch.float32)
            sc = sum_in_rank_order(rows.unbind(0)) / w
        agreed.append(sc)
        off, roff = off + s.block, roff + s.result
    results = comm.scratch((slot, "results"), w * mine.numel(), torch.uint8, dev)
    results = comm.all_gather(mine, out=results).view(w, -1)
    roff = 0
    for p, s, sc in zip(pieces, sizes, agreed, strict=True):
        packed = results[:, roff : roff + s.result]
        packed = packed.reshape(-1) if len(pieces) == 1 else packed.contiguous().view(-1)
        out = p.route._decode_result(packed, p.x.numel(), w, sc, s.layout, out=p.x)
        if out.data_ptr() != p.x.data_ptr():  # the torch path decodes into new memory
            p.x.copy_(out)
        roff += s.result


def _encode(
    pieces: Sequence[Piece], sizes: Sequence[_Sizes], comm: Comm
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each piece's packed codes, and its scales: the agreed MAX for max-agreed routes (one
    all-reduce for all of them), the local ones for mean-agreed routes (agreed after the
    all-to-all that carries them)."""
    codes: list[torch.Tensor | None] = [None] * len(pieces)
    scales: list[torch.Tensor | None] = [None] * len(pieces)
    maxed = [i for i, p in enumerate(pieces) if p.route.scale_agreement == "max"]
    for i, p in enumerate(pieces):
        if i not in maxed:  # codes from the local scales, in one visit where the codec can
            payload = p.route.encode(p.x, p.segments, p.noise)
            codes[i], scales[i] = payload.codes, payload.scales
    if maxed:
        local = [pieces[i].route.local_scales(pieces[i].x, sizes[i].layout) for i in maxed]
        flat = comm.allreduce(torch.cat(local), op=dist.ReduceOp.MAX)
        for i, agreed in zip(maxed, flat.split([t.numel() for t in local]), strict=True):
            p = pieces[i]
            scales[i] = agreed
            codes[i] = p.route.encode_codes(p.x, sizes[i].layout, agreed, p.noise)
    return codes, scales  # type: ignore[return-value]


def _pack_send(
    send: torch.Tensor, pieces: Sequence[Piece], sizes: Sequence[_Sizes],
    codes: Sequence[torch.Tensor], scales: Sequence[torch.Tensor],
) -> None:
    """Fill the all-to-all's send buffer, (W, block): row d holds, per piece, shard d of its
    codes (padded with the route's zero code) and then, for mean-agreed routes, all its local
    scales."""
    w, off = send.shape[0], 0
    for p, s, c, sc in zip(pieces, sizes, codes, scales, strict=True):
        dst = send[:, off : off + s.shard]
        full, rest = divmod(c.numel(), s.shard)
        dst[:full] = c[: full * s.shard].view(full, s.shard)
        if full < w:
            dst[full, :rest] = c[full * s.shard :]
            dst[full, rest:] = p.route.pad_byte
            dst[full + 1 :] = p.route.pad_byte
        if s.scale_bytes:
            send[:, off + s.shard : off + s.block] = sc.contiguous().view(torch.uint8)
        off += s.block
