"""Which all-reduce the real run sums each parameter's gradient in, so that the simulator adds
the ranks' float gradients in gloo's order for it (`routes/ring.py`).

DDP reduces its first step in one bucket per dtype (registration order) and every later step
in the buckets it rebuilt in the order gradients became ready (`binding/buckets.py`). The hook
all-reduces a bucket whole when every parameter in it is on fp32, else one buffer per float
group (`routes/groups.py`, `bucket_reduces`); plain DDP, an all-fp32 run, all-reduces each
bucket whole. An element's summation order depends only on its offset in that buffer and the
buffer's length, so each parameter's ring pieces are computed once per (layout, plan), in
whichever process aggregates it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from torch import nn

from nfabric_cli.binding.buckets import first_step_buckets, plan_buckets, trace_ready_order
from nfabric_cli.binding.fingerprint import trainable_parameters
from nfabric_cli.calibration.aggregate import StepRoutes
from nfabric_cli.ranks.loop import RankRng
from nfabric_cli.routes import make_route
from nfabric_cli.routes.groups import bucket_reduces
from nfabric_cli.routes.ring import Piece, join_pieces, ring_pieces
from nfabric_cli.workloads.base import Workload

Buckets = tuple[tuple[int, ...], ...]  # parameter indices per bucket, in flat-buffer order


@dataclass(frozen=True)
class BucketLayouts:
    """DDP's buckets over the simulator's parameters: the first step's, then the rebuilt ones."""

    first: Buckets
    rebuilt: Buckets

    def at(self, step: int) -> Buckets:
        return self.first if step == 0 else self.rebuilt

    def named(self, names: list[str]) -> tuple[tuple[tuple[str, ...], ...], ...]:
        """(first, rebuilt) with each bucket's parameter names: what the gate keys and prices
        and the bytes count, as the hook sees each step's buckets."""
        return tuple(tuple(tuple(names[i] for i in bucket) for bucket in layout)
                     for layout in (self.first, self.rebuilt))


def ddp_layouts(
    workload: Workload,
    model: nn.Module,
    names: list[str],
    world_size: int,
    seed: int,
    bucket_cap_mb: float | None,
    find_unused_parameters: bool = False,
) -> BucketLayouts:
    """The buckets a real DDP run of `model` reduces (DDP's own assignment, `bucket_cap_mb` as
    passed to DDP). The rebuilt ones follow the ready order of one backward pass on rank 0's
    first batch, traced on a copy from rank 0's random stream (`RankRng`): the model's buffers
    and the global RNG stay untouched."""
    params = trainable_parameters(model)
    first = first_step_buckets(params, bucket_cap_mb, find_unused_parameters)
    if find_unused_parameters:  # DDP never rebuilds
        rebuilt = first
    else:
        twin = copy.deepcopy(model)
        with RankRng(seed).active():  # rank 0's first step draws from its stream from the seed
            batch = workload.train_batch(0, 0, world_size, seed)
            order = trace_ready_order(twin, lambda: workload.loss(twin, batch).backward())
        rebuilt = plan_buckets(params, bucket_cap_mb, ready_order=order)
    index = {n: i for i, n in enumerate(names)}
    return BucketLayouts(*(tuple(tuple(index[n] for n in bucket) for bucket in layout)
                           for layout in (first, rebuilt)))


class ReduceOrders:
    """Per step and plan, the ring pieces of each parameter (simulator order) in the buffer the
    real run all-reduces it in; None for a parameter on a low-bit route."""

    def __init__(self, layouts: BucketLayouts, numels: list[int], world_size: int) -> None:
        self.layouts, self.numels, self.world_size = layouts, list(numels), world_size
        self._pieces: dict[tuple[bool, StepRoutes], tuple[tuple[Piece, ...] | None, ...]] = {}
        self._groups: dict[tuple[bool, StepRoutes, tuple[int, ...]], tuple[Piece, ...]] = {}

    def pieces(self, step: int, plan: StepRoutes) -> tuple[tuple[Piece, ...] | None, ...]:
        key = (step > 0, plan)
        if key not in self._pieces:
            out: list[tuple[Piece, ...] | None] = [None] * len(self.numels)
            for bucket in self.layouts.at(step):
                numels = [self.numels[i] for i in bucket]
                groups = bucket_reduces([plan.regions[i] for i in bucket],
                                        [plan.specs[i] for i in bucket], numels)
                for group in groups:
                    if group.spec.lowbit:
                        continue
                    size = make_route(group.spec).wire_dtype.itemsize
                    offset = 0
                    for k, numel in zip(group.index, group.segments, strict=True):
                        out[bucket[k]] = ring_pieces(offset, numel, group.numel,
                                                     self.world_size, size)
                        offset += numel
            self._pieces[key] = tuple(out)
        return self._pieces[key]

    def group(self, step: int, plan: StepRoutes, index: tuple[int, ...]) -> tuple[Piece, ...]:
        """The pieces of parameters `index` laid end to end, as the simulator concatenates a
        float group's gradients."""
        key = (step > 0, plan, index)
        if key not in self._groups:
            per = self.pieces(step, plan)
            missing = [i for i in index if per[i] is None]
            if missing:
                raise ValueError(f"parameters {missing} are in no float reduce of this plan")
            self._groups[key] = join_pieces([per[i] for i in index],  # type: ignore[misc]
                                            [self.numels[i] for i in index])
        return self._groups[key]
