"""Bytes a simulated step puts on the wire, counted the way the DDP hook sends them.

The hook reduces each bucket as one fp32 all-reduce when every parameter in it is on fp32,
and otherwise as one collective per route group (`routes/groups.py`).
We replay that grouping over DDP's buckets with the routes in force at each step (after health
fallbacks and the capacity gate), so a trial's traffic fraction counts both. The buckets are the
real run's where the caller knows them (`reduces.ddp_layouts`: one per dtype at the first step,
the rebuilt ones after), else the bindings' plan. Bytes are one non-root rank's sent +
received, against the same buckets all-reduced in fp32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import combinations

from nfabric_cli.binding.bindings import Bindings
from nfabric_cli.routes import FP32, make_route
from nfabric_cli.routes.groups import bucket_groups, spec_numels, whole_bucket
from nfabric_cli.routes.spec import RouteSpec
from nfabric_cli.runtime.gate import CapacityGate

Row = tuple[str, str]  # (region selector, phase)
BucketNames = Sequence[tuple[str, ...]]  # each bucket's parameter names, in flat-buffer order


@dataclass
class StepBytes:
    """One step's bytes in total and per profile row (row: bytes, row: fp32 share)."""

    sent: int
    fp32: int
    rows: dict[Row, tuple[float, float]]


@dataclass
class TrafficTally:
    """Running sums over the steps of a simulated run."""

    sent: int = 0
    fp32: int = 0
    rows: dict[Row, list[float]] = field(default_factory=dict)

    def add(self, step: StepBytes) -> None:
        self.sent += step.sent
        self.fp32 += step.fp32
        for row, (b, ref) in step.rows.items():
            cell = self.rows.setdefault(row, [0.0, 0.0])
            cell[0] += b
            cell[1] += ref

    def fraction(self) -> float:
        return self.sent / self.fp32 if self.fp32 else 1.0

    def row_fractions(self) -> dict[Row, float]:
        return {row: (b / ref if ref else 1.0) for row, (b, ref) in sorted(self.rows.items())}


def step_bytes(
    bindings: Bindings, world_size: int, phase: str, effective: Callable[[str], RouteSpec],
    buckets: BucketNames | None = None,
) -> StepBytes:
    """Bytes of one step in `phase` over `buckets` (default: the bindings' plan), each
    parameter on `effective(name)` (see module doc)."""
    fp32 = make_route(FP32)
    sent = total_ref = 0
    rows: dict[Row, list[float]] = {}

    def credit(row: Row, b: float, ref: float) -> None:
        cell = rows.setdefault(row, [0.0, 0.0])
        cell[0] += b
        cell[1] += ref

    for names in buckets or bindings.planned_buckets():
        numels = [bindings.params[n].numel for n in names]
        numel = sum(numels)
        regions = [bindings.params[n].regions[phase] for n in names]
        specs = [effective(n) for n in names]
        ref = fp32.wire_bytes(numel, world_size).total
        total_ref += ref
        share = [ref * n / numel if numel else 0.0 for n in numels]
        if whole_bucket(specs):
            sent += ref
            for region, s in zip(regions, share, strict=True):
                credit((region, phase), s, s)
            continue
        for group in bucket_groups(regions, specs, numels):
            idx = group.index
            b = group.wire_bytes(world_size).total
            sent += b
            group_ref = sum(share[i] for i in idx)
            for i in idx:  # a float group spans regions: split its bytes by elements
                frac = share[i] / group_ref if group_ref else 0.0
                credit((regions[i], phase), b * frac, share[i])
    return StepBytes(sent, total_ref, {k: (v[0], v[1]) for k, v in rows.items()})


def gated(
    bindings: Bindings, phase: str, effective: Callable[[str], RouteSpec], gate: CapacityGate | None,
    buckets: BucketNames | None = None,
) -> Callable[[str], RouteSpec]:
    """`effective` after the capacity gate: every parameter of a bucket (of `buckets`, default
    the bindings' plan) the gate refuses runs on fp32, as in the hook (same `CapacityGate`,
    same key: the bucket's names and phase; same price: one reduce per route group)."""
    if gate is None or gate.substrate is None or not gate.enabled:
        return effective
    refused: set[str] = set()
    for names in buckets or bindings.planned_buckets():
        specs = [effective(n) for n in names]
        if not any(s.lowbit for s in specs):
            continue
        groups = bucket_groups([bindings.params[n].regions[phase] for n in names], specs,
                               [bindings.params[n].numel for n in names])
        if not gate.verdict((tuple(names), phase), spec_numels(groups)).admit:
            refused.update(names)
    if not refused:
        return effective
    return lambda name: FP32 if name in refused else effective(name)


def traffic_lower_bound(
    bindings: Bindings, world_size: int, steps: int, gate: CapacityGate | None = None,
    layouts: tuple[BucketNames, BucketNames] | None = None,
) -> float:
    """The least traffic fraction any run of these bindings can measure: per phase, the
    cheapest of every way the health monitor could hold its low-bit regions on fp32 (each
    after the capacity `gate`, which decides from the routes left). `layouts`: DDP's first
    and rebuilt buckets, as the simulator counts them (default: the plan at every step)."""
    first, rebuilt = layouts or (None, None)
    sent = ref = 0.0
    for phase in bindings.phases:
        n = sum(1 for s in range(steps) if bindings.phase_at(s, steps).name == phase.name)
        at_first = int(n > 0 and bindings.phase_at(0, steps).name == phase.name)
        lowbit = sorted({b.regions[phase.name] for b in bindings.params.values()
                         if b.routes[phase.name].lowbit})
        for count, buckets in ((at_first, first), (n - at_first, rebuilt)):
            if count == 0:
                continue
            options = [
                step_bytes(bindings, world_size, phase.name,
                           gated(bindings, phase.name, held_on_fp32(bindings, phase.name, held),
                                 gate, buckets), buckets)
                for k in range(len(lowbit) + 1)
                for held in combinations(lowbit, k)
            ]
            sent += count * min(o.sent for o in options)
            ref += count * options[0].fp32
    return sent / ref if ref else 1.0


def held_on_fp32(bindings: Bindings, phase: str, held: tuple[str, ...]) -> Callable[[str], RouteSpec]:
    """Parameter -> route in `phase` when the regions in `held` are forced to fp32."""

    def effective(name: str) -> RouteSpec:
        b = bindings.params[name]
        return FP32 if b.regions[phase] in held and b.routes[phase].lowbit else b.routes[phase]

    return effective
