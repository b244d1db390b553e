"""The DDP bucket plan: which bucket each parameter's gradient lands in, and where.

We call DDP's own `torch.distributed._compute_bucket_assignment_by_size` with the limits DDP
uses, so the plan is DDP's, not a re-implementation. Two layouts exist:

- default DDP (`find_unused_parameters=False`): the first step uses one big bucket
  (`first_step_buckets`: registration order), then the reducer *rebuilds* buckets in the order gradients became ready, the first bucket capped at
  the first-bucket size and the rest at `bucket_cap_mb`. That rebuilt layout is the one every
  later step uses, so it is the plan. The ready order is taken from a traced backward pass
  (`trace_ready_order`) when one is given, else assumed to be the reverse of registration order
  (DDP's own assumption; within one module autograd may order weight and bias differently,
  which moves offsets but rarely bucket membership).
- `find_unused_parameters=True`: DDP never rebuilds; its initial assignment (registration
  order, buckets then reversed) is exact and is the plan.

Bindings are keyed by parameter name, so the runtime stays correct whichever layout DDP uses.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nfabric_cli.binding.fingerprint import TrainableParam
from nfabric_cli.errors import InputError

_MB = 1024 * 1024


@dataclass(frozen=True)
class BucketSlot:
    """Where one parameter's gradient lives: bucket index, element offset, length."""

    bucket: int
    offset: int
    numel: int


def cap_text(bucket_cap_mb: float | None) -> str:
    """A bucket cap as messages name it."""
    if bucket_cap_mb is None:
        return "DDP's default bucket cap (25 MB, 1 MB first bucket)"
    return f"bucket cap {bucket_cap_mb:g} MB"


def check_bucket_cap(bucket_cap_mb: float) -> None:
    """InputError (one line) unless the cap is a finite number of MB > 0."""
    if not 0 < bucket_cap_mb < math.inf:
        raise InputError(f"bucket cap must be a finite number > 0 MB, got {bucket_cap_mb}")


def bucket_caps(bucket_cap_mb: float | None) -> tuple[int, int]:
    """(first bucket bytes, bucket bytes) exactly as the installed DDP derives them.

    `None` means DDP's default (25 MB with a 1 MB first bucket). On torch versions whose DDP
    has `_BucketCapacityConfig`, an explicit `bucket_cap_mb` also caps the first bucket.
    """
    if bucket_cap_mb is not None:
        check_bucket_cap(bucket_cap_mb)
    try:
        from torch.nn.parallel.distributed import _BucketCapacityConfig
    except ImportError:  # older torch: a fixed small first bucket
        cap = int((25 if bucket_cap_mb is None else bucket_cap_mb) * _MB)
        return dist._DEFAULT_FIRST_BUCKET_BYTES, cap
    cfg = _BucketCapacityConfig.create(
        bucket_cap_mb=bucket_cap_mb, bucket_cap_mb_list=None, use_python_reducer=False
    )
    return cfg.first_bucket_bytes_cap, cfg.bucket_bytes_cap


def makes_sparse(module: nn.Module) -> bool:
    """Whether `module` gives its weight a sparse gradient (``sparse=True`` embeddings)."""
    return isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and bool(module.sparse)


def _expects_sparse(p: TrainableParam) -> bool:
    return makes_sparse(p.owners[0])


def plan_buckets(
    params: list[TrainableParam],
    bucket_cap_mb: float | None = None,
    find_unused_parameters: bool = False,
    ready_order: list[str] | None = None,
) -> list[list[str]]:
    """Parameter names per bucket, bucket 0 first, each bucket in its flat-buffer order."""
    if not params:
        return []
    if find_unused_parameters:
        return first_step_buckets(params, bucket_cap_mb, find_unused_parameters)
    first, cap = bucket_caps(bucket_cap_mb)
    tensors = [p.param for p in params]
    sparse = [_expects_sparse(p) for p in params]
    order = _ready_indices(params, ready_order)
    groups, _ = dist._compute_bucket_assignment_by_size(
        [tensors[i] for i in order], [first, cap], [sparse[i] for i in order], order
    )
    return [[params[i].name for i in group] for group in groups]


def first_step_buckets(
    params: list[TrainableParam],
    bucket_cap_mb: float | None = None,
    find_unused_parameters: bool = False,
) -> list[list[str]]:
    """DDP's initial assignment, which its first step reduces (as `plan_buckets`): without
    `find_unused_parameters`, one bucket per dtype in registration order (DDP disables initial
    bucketing, `compute_bucket_size_limits`), rebuilt after that step; with it, buckets capped
    as usual, kept for good."""
    if not params:
        return []
    first, cap = bucket_caps(bucket_cap_mb)
    if find_unused_parameters:
        limits = [first, cap] if first < cap else [cap]
    else:
        limits = [sys.maxsize]
    groups, _ = dist._compute_bucket_assignment_by_size(
        [p.param for p in params], limits, [_expects_sparse(p) for p in params]
    )
    # DDP hands the reducer the reversed list
    return [[params[i].name for i in group] for group in reversed(groups)]


def _ready_indices(params: list[TrainableParam], ready_order: list[str] | None) -> list[int]:
    """Indices in gradient-ready order: the traced names first, any others after them in
    reverse registration order (DDP's assumption when nothing better is known)."""
    index = {alias: i for i, p in enumerate(params) for alias in p.aliases}
    order: list[int] = []
    for name in ready_order or []:
        if name not in index:
            raise InputError(f"ready order names {name!r}, which is not a trainable parameter")
        if index[name] not in order:
            order.append(index[name])
    order += [i for i in reversed(range(len(params))) if i not in order]
    return order


def bucket_slots(buckets: list[list[str]], params: list[TrainableParam]) -> dict[str, BucketSlot]:
    """Bucket index, element offset and length of every parameter in `buckets`."""
    numel = {p.name: p.numel for p in params}
    slots: dict[str, BucketSlot] = {}
    for index, names in enumerate(buckets):
        offset = 0
        for name in names:
            slots[name] = BucketSlot(index, offset, numel[name])
            offset += numel[name]
    return slots


def trace_ready_order(model: nn.Module, run_backward: Callable[[], Any]) -> list[str]:
    """Names of trainable parameters in the order their gradients are accumulated during
    `run_backward()` (one forward + backward). Gradients it leaves behind are cleared."""
    names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    order: list[str] = []
    handles = [
        p.register_post_accumulate_grad_hook(lambda t: order.append(names[id(t)]))
        for p in model.parameters()
        if p.requires_grad
    ]
    try:
        with torch.enable_grad():
            run_backward()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    return order
