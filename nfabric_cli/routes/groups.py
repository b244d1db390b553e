"""How the comm hook splits one DDP bucket into reduces: one per (region, route) group.

A low-bit route keeps statistics per region (sign agreement feeds that region's health
check), so two regions on the same low-bit route are two reduces: two fixed codec costs and
two sets of collectives. Float routes (fp32, bf16, fp16) carry no per-region statistics and go
out as one reduce per route over every region (region ""). The hook (`runtime/state.py`), the
simulated traffic (`calibration/traffic.py`), compile-time bytes and verdicts (`binding/`) and
the capacity report all group with `bucket_groups`, so the cost model prices what runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from nfabric_cli.routes.spec import FP32, RouteSpec


@dataclass(frozen=True)
class BucketGroup:
    """One reduce of a bucket: its route, its region ("" for a float route), the positions of
    its parameters in the bucket (flat-buffer order) and their element counts."""

    region: str
    spec: RouteSpec
    index: tuple[int, ...]
    segments: tuple[int, ...]

    @property
    def numel(self) -> int:
        return sum(self.segments)


def bucket_groups(
    regions: Sequence[str], specs: Sequence[RouteSpec], numels: Sequence[int]
) -> list[BucketGroup]:
    """Group a bucket's parameters (given in flat-buffer order) the way the hook reduces them:
    key (region if the route is low-bit else "", route), groups in order of first appearance."""
    found: dict[tuple[str, RouteSpec], list[int]] = {}
    for i, (region, spec) in enumerate(zip(regions, specs, strict=True)):
        found.setdefault((region if spec.lowbit else "", spec), []).append(i)
    return [
        BucketGroup(region, spec, tuple(idx), tuple(int(numels[i]) for i in idx))
        for (region, spec), idx in found.items()
    ]


def whole_bucket(specs: Sequence[RouteSpec]) -> bool:
    """Whether the hook reduces a bucket as one all-reduce of its whole buffer (every
    parameter on plain fp32, as when the capacity gate refuses it): plain DDP's reduce."""
    return all(not s.lowbit and s.name == "fp32" for s in specs)


def bucket_reduces(
    regions: Sequence[str], specs: Sequence[RouteSpec], numels: Sequence[int]
) -> list[BucketGroup]:
    """The reduces the hook issues for a bucket: the whole buffer on fp32 (`whole_bucket`),
    else one per (region, route) group (`bucket_groups`). Each float group is one all-reduce
    of its parameters laid end to end in bucket order, which fixes gloo's summation order."""
    if whole_bucket(specs):
        return [BucketGroup("", FP32, tuple(range(len(numels))), tuple(int(n) for n in numels))]
    return bucket_groups(regions, specs, numels)


def spec_numels(groups: Iterable[BucketGroup]) -> list[tuple[RouteSpec, int]]:
    """The (route, elements) pair of each reduce: what `substrate.cost.bucket_verdict` prices."""
    return [(g.spec, g.numel) for g in groups]
