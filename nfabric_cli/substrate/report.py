"""Capacity report: per-bucket verdicts, totals and crossovers for one phase of a bucket plan.

Input is plain data (bucket index -> the bucket's reduces, one `BucketGroup` per route as
the hook issues them), so this module does not depend on the binding layer;
`nfabric capacity` extracts it from `Bindings.bucket_groups`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from nfabric_cli.routes.groups import BucketGroup, spec_numels
from nfabric_cli.routes.plan import plan_wire_bytes
from nfabric_cli.routes.spec import FP32, RouteSpec
from nfabric_cli.substrate.cost import (
    bucket_verdict,
    central_saturation_world_size,
    crossover_bucket_numel,
    endpoint_ingress_bound_world_size,
    max_world_size,
    route_plan,
)
from nfabric_cli.substrate.model import Substrate

#: One DDP bucket as the cost model sees it: (bucket index, its reduces in issue order).
BucketRoutes = tuple[int, Sequence[BucketGroup]]


@dataclass(frozen=True)
class StepTimes:
    """Predicted communication seconds of one step: all fp32, as written, after the gate."""

    fp32_s: float
    profile_s: float
    gated_s: float


def wire_bytes(spec: RouteSpec, numel: int, world_size: int) -> int:
    """Bytes a non-endpoint rank sends plus receives for `numel` elements on `spec`."""
    return plan_wire_bytes(route_plan(spec, numel, world_size), world_size, rank=1).total


def capacity_report(
    buckets: list[BucketRoutes], world_size: int, substrate: Substrate
) -> dict[str, Any]:
    """The `nfabric capacity --json` document: buckets, totals, crossover."""
    rows = []
    for index, groups in buckets:
        v = bucket_verdict(substrate, spec_numels(groups), world_size)
        numel = sum(g.numel for g in groups)
        reduces = [  # one per reduce the hook issues (what the verdict prices)
            {"regions": sorted({g.regions[k] for k in ks}), "route": g.spec.label(),
             "numel": n, "bytes": wire_bytes(g.spec, n, world_size)}
            for g in groups for ks in g.reduces()
            if (n := g.numel_of(ks))
        ]
        routes: dict[str, dict[str, int]] = {}
        for r in reduces:  # bytes per route: its groups' reduces together
            entry = routes.setdefault(r["route"], {"numel": 0, "bytes": 0})
            entry["numel"] += r["numel"]
            entry["bytes"] += r["bytes"]
        rows.append(
            {
                "index": index,
                "numel": numel,
                "bytes": sum(r["bytes"] for r in reduces),
                "fp32_bytes": wire_bytes(FP32, numel, world_size),
                "routes": routes,
                "groups": reduces,
                "fp32_time_s": v.fp32_time_s,
                "lowbit_time_s": v.lowbit_time_s,
                "verdict": v.verdict,
                "reason": v.reason,
            }
        )
    times = _step_times(rows)
    admitted = sum(r["verdict"] == "admit" for r in rows)
    totals = {
        "numel": sum(r["numel"] for r in rows),
        "bytes": sum(r["bytes"] for r in rows),
        "fp32_bytes": sum(r["fp32_bytes"] for r in rows),
        "fp32_time_s": times.fp32_s,
        "profile_time_s": times.profile_s,
        "gated_time_s": times.gated_s,
        "speedup": times.fp32_s / times.gated_s if times.gated_s > 0 else None,
        "admitted": admitted,
        "fallback": len(rows) - admitted,
    }
    return {"buckets": rows, "totals": totals, "crossover": crossovers(buckets, world_size,
                                                                        substrate)}


def crossovers(
    buckets: list[BucketRoutes], world_size: int, substrate: Substrate
) -> dict[str, Any]:
    """Per compressed route: the bucket size below which it loses, and (for the largest
    bucket) the world size at which a central reducer stops paying."""
    specs = sorted({g.spec for _, gs in buckets for g in gs if g.numel and g.spec.name != "fp32"},
                   key=RouteSpec.label)
    largest = max((sum(g.numel for g in gs) for _, gs in buckets), default=0)
    central = sorted({replace(s, reducer="central") for s in specs if s.lowbit},
                     key=RouteSpec.label)
    return {
        "bucket_numel": {
            s.label(): crossover_bucket_numel(s, world_size, substrate) for s in specs
        },
        "central_saturation_numel": largest,
        "central_saturation_world_size": {
            s.label(): central_saturation_world_size(s, largest, substrate)
            for s in central
            if largest
        },
        "route_world_size_limit": {s.label(): max_world_size(s) for s in central},
        "endpoint_ingress_bound_world_size": endpoint_ingress_bound_world_size(substrate),
    }


def _step_times(rows: list[dict[str, Any]]) -> StepTimes:
    fp32 = sum(r["fp32_time_s"] for r in rows)
    profile = sum(r["lowbit_time_s"] for r in rows)
    gated = sum(r["lowbit_time_s"] if r["verdict"] == "admit" else r["fp32_time_s"]
                for r in rows)
    return StepTimes(fp32, profile, gated)


def link_sweep(
    buckets: list[BucketRoutes], world_size: int, substrate: Substrate, links_gbps: list[float]
) -> list[StepTimes]:
    """Step times at each link speed (same latency, codec and endpoint settings)."""
    out = []
    for link in links_gbps:
        s = substrate.with_link(link)
        rows = []
        for _, groups in buckets:
            v = bucket_verdict(s, spec_numels(groups), world_size)
            rows.append({"fp32_time_s": v.fp32_time_s, "lowbit_time_s": v.lowbit_time_s,
                         "verdict": v.verdict})
        out.append(_step_times(rows))
    return out


def longest_phase(bindings: Any, phase: str | None = None) -> str:
    """The named phase, or by default the longest one (the phase that dominates the run)."""
    if phase is None:
        return max(bindings.phases, key=lambda p: p.end - p.start).name
    return bindings.phase(phase).name


def bindings_report(
    bindings: Any, substrate: Substrate, world_size: int | None = None, phase: str | None = None
) -> tuple[dict[str, Any], list[tuple[int, list[BucketGroup]]]]:
    """`nfabric capacity`'s report on bindings: the phase (default: the longest), the world
    size (given, else the substrate's, else the bindings'), the substrate, and per bucket the
    predicted fp32 and low-bit times with the gate's verdict (`capacity_report`). Also returns
    the buckets' groups, for a link sweep of the same buckets."""
    from nfabric_cli.errors import InputError

    w = world_size or substrate.world_size or bindings.world_size
    if not w:
        raise InputError("world size unknown: pass --world-size N")
    name = longest_phase(bindings, phase)
    buckets = [(b.index, bindings.bucket_groups(b.index, name)) for b in bindings.buckets]
    report = {"phase": name, "world_size": w, "substrate": substrate.to_dict()}
    report.update(capacity_report(buckets, w, substrate))
    return report, buckets
