"""`fp32`: the reference route, numerically PyTorch's `allreduce_hook`.

Divide by the world size, then all-reduce (sum) in place: exactly what DDP does with no hook,
so an all-fp32 profile trains bit-identically to plain DDP.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from nfabric_cli.routes.base import Noise, Payload, Route, Segments, check_input
from nfabric_cli.routes.chunks import check_segments
from nfabric_cli.routes.comm import Comm, sum_in_rank_order
from nfabric_cli.routes.plan import CommOp


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
        stats: dict[str, float] | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        return self.reduce_async(flat, comm)()

    def reduce_async(self, flat: torch.Tensor, comm: Comm) -> Callable[[], torch.Tensor]:
        """`reduce` issued now; call the result to wait for the agreed mean."""
        x = check_input(flat)
        if self.wire_dtype == x.dtype:
            # In place, as allreduce_hook does: no extra copy of the bucket.
            x.div_(comm.world_size)
            return comm.allreduce_async(x).wait
        pending = comm.allreduce_async(x.div(comm.world_size).to(self.wire_dtype))
        return lambda: pending.wait().to(x.dtype)

    def simulate(
        self,
        grads: Sequence[torch.Tensor],
        segments: tuple[int, ...] | None = None,
        stats: dict[str, float] | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> torch.Tensor:
        xs = [check_input(g) for g in grads]
        w = len(xs)
        self.check_world(w)
        parts = [x.div(w).to(self.wire_dtype) for x in xs]
        return sum_in_rank_order(parts).to(xs[0].dtype)

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
