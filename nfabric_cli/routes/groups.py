"""How the comm hook splits one DDP bucket into groups: one per route.

A group holds every parameter of the bucket on its route, whatever their regions: a low-bit
route keeps its vote agreement per region (each region's health check), but it does so per
element range of the reduce (`routes/tally.py`), so regions on one route share their codec
calls and collectives. (Grouped per region, a transformer whose LayerNorms lie between the
other regions' weights paid 13 exchange pieces per bucket for 1 route, about 0.3 ms each,
1.3x the same routes' step on one region at 20 and 200 Mbit/s.) Float routes (fp32, bf16,
fp16) go out as one all-reduce per route. A sharded low-bit group without error feedback is
reduced where it lies, one reduce per consecutive run of its parameters
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
    """The parameters of a bucket on one route: the positions of its parameters in the bucket
    (flat-buffer order), their element counts and their regions (the health scope each
    reports its agreement to)."""

    spec: RouteSpec
    index: tuple[int, ...]
    segments: tuple[int, ...]
    regions: tuple[str, ...]

    @property
    def numel(self) -> int:
        return sum(self.segments)

    @property
    def in_place(self) -> bool:
        """Whether the hook reduces this group where it lies in the bucket, one reduce per
        consecutive run of its parameters (sharded low-bit routes without error feedback,
        `routes/exchange.py`), rather than as one concatenated reduce."""
        return self.spec.lowbit and self.spec.reducer == "sharded" and not self.spec.error_feedback

    def numel_of(self, ks: tuple[int, ...]) -> int:
        """Elements of the reduce over positions `ks` (one of `reduces()`)."""
        return sum(self.segments[k] for k in ks)

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
            if n := self.numel_of(ks):
                segs = tuple(self.segments[k] for k in ks)
                total = total + route.wire_bytes(n, world_size, rank, segments=segs)
        return total


def bucket_groups(
    regions: Sequence[str], specs: Sequence[RouteSpec], numels: Sequence[int]
) -> list[BucketGroup]:
    """Group a bucket's parameters (given in flat-buffer order) the way the hook reduces them:
    one group per route, in order of first appearance."""
    found: dict[RouteSpec, list[int]] = {}
    for i, spec in enumerate(specs):
        found.setdefault(spec, []).append(i)
    return [_group(spec, idx, regions, numels) for spec, idx in found.items()]


def _group(spec: RouteSpec, idx: Sequence[int], regions: Sequence[str],
           numels: Sequence[int]) -> BucketGroup:
    return BucketGroup(spec, tuple(idx), tuple(int(numels[i]) for i in idx),
                       tuple(regions[i] for i in idx))


def whole_bucket(specs: Sequence[RouteSpec]) -> bool:
    """Whether the hook reduces a bucket as one all-reduce of its whole buffer (every
    parameter on plain fp32, as when the capacity gate refuses it): plain DDP's reduce."""
    return all(not s.lowbit and s.name == "fp32" for s in specs)


def bucket_reduces(
    regions: Sequence[str], specs: Sequence[RouteSpec], numels: Sequence[int]
) -> list[BucketGroup]:
    """The reduces the hook issues for a bucket: the whole buffer on fp32 (`whole_bucket`),
    else one per route (`bucket_groups`). Each float group is one all-reduce
    of its parameters laid end to end in bucket order, which fixes gloo's summation order."""
    if whole_bucket(specs):
        return [_group(FP32, range(len(numels)), regions, numels)]
    return bucket_groups(regions, specs, numels)


def spec_numels(groups: Iterable[BucketGroup]) -> list[tuple[RouteSpec, int]]:
    """The (route, elements) pair of each reduce the hook issues (`BucketGroup.reduces`: a
    codec call each): what `substrate.cost.bucket_verdict` prices."""
    return [(g.spec, g.numel_of(ks)) for g in groups for ks in g.reduces()]
