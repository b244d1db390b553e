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

from nfabric_cli.routes.spec import RouteSpec


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


def spec_numels(groups: Iterable[BucketGroup]) -> list[tuple[RouteSpec, int]]:
    """The (route, elements) pair of each reduce: what `substrate.cost.bucket_verdict` prices."""
    return [(g.spec, g.numel) for g in groups]
