"""How the comm hook splits one DDP bucket into groups: one per (region, route).

A low-bit route keeps statistics per region (sign agreement feeds that region's health
check), so two regions on the same low-bit route are two groups, each with its own codec
calls. Float routes (fp32, bf16, fp16) carry no per-region statistics and go out as one
all-reduce per route over every region (region ""). A sharded low-bit group without error
feedback is reduced where it lies, one reduce per consecutive run of its parameters
(`BucketGroup.reduces`); all of a bucket's sharded low-bit reduces share one all-to-all and one
all-gather (`routes/exchange.py`). The hook (`runtime/state.py`), the simulated traffic
(`calibration/traffic.py`), compile-time bytes and verdicts (`binding/`) and the capacity
report all group with `bucket_groups`, so the cost model prices what runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from nfabric_cli.routes.plan import WireBytes
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

    @property
    def in_place(self) -> bool:
        """Whether the hook reduces this group where it lies in the bucket, one reduce per
        consecutive run of its parameters (sharded low-bit routes without error feedback,
        `routes/exchange.py`), rather than as one concatenated reduce."""
        return self.spec.lowbit and self.spec.reducer == "sharded" and not self.spec.error_feedback

    def reduces(self) -> list[tuple[int, ...]]:
        """Positions (into `index`) of the parameters of each reduce the hook issues."""
        if not self.in_place:
            return [tuple(range(len(self.index)))]
        runs: list[list[int]] = []
        for k, i in enumerate(self.index):
            if runs and self.index[runs[-1][-1]] == i - 1:
                runs[-1].append(k)
            else:
                runs.append([k])
        return [tuple(r) for r in runs]

    def wire_bytes(self, world_size: int, rank: int = 1, dtype: torch.dtype | None = None) -> WireBytes:
        """Exact bytes rank `rank` sends and receives for this group: its reduces' together."""
        from nfabric_cli.routes import make_route  # lazy: the codecs import torch.distributed

        route = make_route(self.spec, dtype)
        total = WireBytes()
        for ks in self.reduces():
            segs = tuple(self.segments[k] for k in ks)
            if sum(segs):
                total = total + route.wire_bytes(sum(segs), world_size, rank, segments=segs)
        return total


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
