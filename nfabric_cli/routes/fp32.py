"""`fp32`: the reference route, numerically plain DDP (no hook).

Scale by 1/W as DDP's reducer does (`ddp_mean_`), then all-reduce (sum) in place: exactly what
DDP does with no hook, so an all-fp32 profile trains bit-identically to plain DDP. The
simulated reduce adds the ranks in gloo's ring order (`ring.py`) over the buffer the real run
all-reduces (`pieces`), so it equals the collective bit for bit at any world size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from nfabric_cli.routes.base import Noise, Payload, Route, Segments, check_input
from nfabric_cli.routes.chunks import check_segments
from nfabric_cli.routes.comm import Comm
from nfabric_cli.routes.plan import CommOp
from nfabric_cli.routes.ring import Piece, ring_sum
from nfabric_cli.routes.tally import Sink


def ddp_mean_(buffer: torch.Tensor, world_size: int) -> torch.Tensor:
    """Scale a gradient bucket by 1/W in place, exactly as plain DDP does before its
    all-reduce: a product with the scalar 1/W (torch's reducer.cpp,
    `mark_variable_ready_dense`: `at::mul_out(bucket_view, grad, 1. / div_factor_)`), not
    `allreduce_hook`'s `div_(W)`, which rounds differently when 1/W is inexact (W = 3).
    (DDP divides instead where a gradient already is its bucket view: `gradient_as_bucket_view`
    with gradients kept between steps, not set to None; at W = 2 or 4 the two agree.)"""
    return buffer.mul_(1.0 / world_size)


class FloatRoute(Route):
    """All-reduce in a floating dtype (fp32 here; bf16/fp16 in `half.py`)."""

    name = "fp32"
    wire_dtype = torch.float32

    def plan(self, numel: int, world_size: int, segments: tuple[int, ...] | None = None) -> list[CommOp]:
        self.check_world(world_size)
        if world_size == 1 or numel == 0:
            return []
        return [CommOp("allreduce", numel * torch.finfo(self.wire_dtype).bits // 8)]

    def reduce(
        self,
        flat: torch.Tensor,
        comm: Comm,
        segments: tuple[int, ...] | None = None,
        stats: Sink | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        return self.reduce_async(flat, comm)()

    def reduce_async(self, flat: torch.Tensor, comm: Comm) -> Callable[[], torch.Tensor]:
        """`reduce` issued now; call the result to wait for the agreed mean."""
        x = check_input(flat)
        if self.wire_dtype == x.dtype:
            # In place, as DDP does: no extra copy of the bucket.
            return comm.allreduce_async(self._to_wire(x, comm.world_size, inplace=True)).wait
        pending = comm.allreduce_async(self._to_wire(x, comm.world_size))
        return lambda: pending.wait().to(x.dtype)

    def simulate(
        self,
        grads: Sequence[torch.Tensor],
        segments: tuple[int, ...] | None = None,
        stats: Sink | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
        pieces: Sequence[Piece] | None = None,
    ) -> torch.Tensor:
        """The reduce of every rank's `grads`, summed in gloo's ring order: `pieces` give each
        element's ring chunk in the buffer the real run all-reduces (default: `grads` are
        that whole buffer)."""
        xs = [check_input(g) for g in grads]
        w = len(xs)
        self.check_world(w)
        parts = [self._to_wire(x, w) for x in xs]
        return ring_sum(parts, pieces).to(xs[0].dtype)

    def _to_wire(self, x: torch.Tensor, world_size: int, inplace: bool = False) -> torch.Tensor:
        """x / W in the wire dtype: DDP's scaling for a full-precision buffer; for a narrower
        wire, divide before the cast (fp16 would overflow otherwise), as fp16_compress_hook."""
        if self.wire_dtype == x.dtype:
            return ddp_mean_(x if inplace else x.clone(), world_size)
        return x.div(world_size).to(self.wire_dtype)

    def encode(self, x: torch.Tensor, segments: Segments = None, noise: Noise = None) -> Payload:
        x = check_input(x)
        segs = check_segments(x.numel(), segments)
        codes = x.to(self.wire_dtype).contiguous().view(torch.uint8)
        return Payload(codes, torch.empty(0), x.numel(), segs)

    def decode(self, payload: Payload) -> torch.Tensor:
        return payload.codes.view(self.wire_dtype).float()


class Fp32Route(FloatRoute):
    name = "fp32"
    wire_dtype = torch.float32
