"""`Bindings`: a profile resolved against one model: parameter -> route per phase, the DDP
bucket plan, per-bucket capacity verdicts and the modelled traffic. The runtime obeys it.

Everything is keyed by parameter name (the first name of a tied tensor), so bindings stay
valid when DDP rebuilds its buckets after the first step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from nfabric_cli.errors import InputError
from nfabric_cli.profile.phases import Phase, phase_at
from nfabric_cli.routes import make_route
from nfabric_cli.routes.groups import BucketGroup, bucket_groups
from nfabric_cli.routes.spec import FP32, RouteSpec


@dataclass
class ParamBinding:
    """One trainable parameter: where DDP puts its gradient and which route it takes when."""

    name: str
    shape: tuple[int, ...]
    numel: int
    dtype: str
    bucket: int
    offset: int  # elements from the start of the bucket's flat buffer
    routes: dict[str, RouteSpec]  # phase name -> route
    regions: dict[str, str]  # phase name -> the selector (profile row) that routed it
    aliases: tuple[str, ...] = ()  # every name of a tied tensor, first name first


@dataclass
class BucketPlan:
    """One DDP bucket: its parameters in flat-buffer order and, per phase, the capacity
    verdict ("admit" | "fallback") with its reason and the modelled bytes per rank per step."""

    index: int
    params: list[str]
    numel: int
    verdicts: dict[str, str]
    reasons: dict[str, str]
    wire_bytes: dict[str, int] = field(default_factory=dict)  # phase -> bytes (sent + received)
    fp32_bytes: int = 0  # the same bucket all-reduced in fp32, at the bindings' world size


@dataclass
class Bindings:
    phases: list[Phase]
    params: dict[str, ParamBinding]  # model order
    buckets: list[BucketPlan]
    world_size: int
    bucket_cap_mb: float | None  # pass to DDP as is (None: DDP's default, 1 MB first bucket)
    total_steps: int | None
    fingerprint: str
    meta: dict[str, Any] = field(default_factory=dict)  # the profile's metadata
    find_unused_parameters: bool = False
    bucket_order: str = "reverse-registration"  # or "traced": how the ready order was known
    #: the world size a bindings file was compiled for, when loaded for another (its bytes and
    #: verdicts then worked out again: `load_bindings_or_profile`); not stored
    compiled_world_size: int | None = None

    # -- lookups ---------------------------------------------------------------------------
    def phase(self, name: str) -> Phase:
        for p in self.phases:
            if p.name == name:
                return p
        raise InputError(f"unknown phase {name!r} (phases: {', '.join(self.phase_names())})")

    def phase_names(self) -> list[str]:
        return [p.name for p in self.phases]

    def param(self, name: str) -> ParamBinding:
        """The binding of a parameter by any of its names (tied aliases included)."""
        found = self.params.get(name)
        if found is None:
            found = next((b for b in self.params.values() if name in b.aliases), None)
        if found is None:
            raise InputError(f"no binding for parameter {name!r} (frozen, or not in this model)")
        return found

    def route_for(self, param: str, phase_name: str) -> RouteSpec:
        self.phase(phase_name)
        return self.param(param).routes[phase_name]

    def lowbit_in(self, names: tuple[str, ...] | list[str], phase_name: str) -> bool:
        """Whether the profile routes any of `names` low-bit in the phase."""
        return any(self.params[n].routes[phase_name].lowbit for n in names)

    def planned_buckets(self) -> tuple[tuple[str, ...], ...]:
        """The planned buckets' parameter names, in flat-buffer order (a forecast: the real
        run's are `calibration.reduces.ddp_layouts`)."""
        return tuple(tuple(b.params) for b in self.buckets)

    def lowbit_buckets(self, phase_name: str, buckets: Sequence[tuple[str, ...]] | None = None
                       ) -> list[tuple[tuple[str, ...], str]]:
        """The gate keys (names, phase) of the buckets (default: the planned ones) the phase
        routes anything low-bit in: what the model gate must refuse for a step to go out as
        plain DDP's."""
        return [(tuple(names), phase_name) for names in (buckets or self.planned_buckets())
                if self.lowbit_in(names, phase_name)]

    def phase_at(self, step: int, total_steps: int | None = None) -> Phase:
        """The phase containing step / total_steps (the last phase includes 1.0)."""
        total = total_steps if total_steps is not None else self.total_steps
        if total is None:
            raise InputError("total steps unknown: pass total_steps or compile with --total-steps")
        return phase_at(self.phases, step, total)

    def bucket_groups(self, bucket: int, phase_name: str) -> list[BucketGroup]:
        """The reduces the hook issues for one bucket in one phase, one group per route,
        with this phase's routes (what the capacity model prices)."""
        names = self.buckets[bucket].params
        return bucket_groups(
            [self.params[n].regions[phase_name] for n in names],
            [self.params[n].routes[phase_name] for n in names],
            [self.params[n].numel for n in names],
        )

    # -- traffic ---------------------------------------------------------------------------
    def bucket_bytes(
        self, bucket: int, phase_name: str, world_size: int | None = None
    ) -> tuple[int, int]:
        """(bytes with this phase's routes, bytes all-fp32) one rank moves per step for a bucket:
        one reduce per group as the hook sends them, against one fp32 all-reduce."""
        w = self.world_size if world_size is None else world_size
        groups = self.bucket_groups(bucket, phase_name)
        dtype = self.bucket_dtype(bucket)
        low = sum(g.wire_bytes(w, dtype=dtype).total for g in groups)
        return low, modelled_bytes(FP32, (self.buckets[bucket].numel,), w, dtype)

    def bucket_dtype(self, bucket: int) -> torch.dtype:
        """The dtype of a bucket's gradients (DDP buckets by dtype): what full precision is."""
        name = self.params[self.buckets[bucket].params[0]].dtype
        return getattr(torch, name, torch.float32)

    def bytes_per_step(self, phase_name: str, world_size: int | None = None) -> tuple[int, int]:
        """(modelled bytes, all-fp32 bytes) one rank sends plus receives per step in a phase."""
        self.phase(phase_name)
        pairs = [self.bucket_bytes(b, phase_name, world_size) for b in range(len(self.buckets))]
        return sum(p[0] for p in pairs), sum(p[1] for p in pairs)

    def traffic_fraction(self, phase_name: str) -> float:
        """Modelled bytes of this phase over all-fp32 bytes. A single rank moves nothing, so
        for a one-rank binding the fraction is modelled at two ranks."""
        low, ref = self.bytes_per_step(phase_name, max(self.world_size, 2))
        return low / ref if ref else 1.0

    # -- report ----------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """The facts `compile-profile` prints: per phase, traffic fraction vs all-fp32, bytes
        per rank per step, parameters and elements per route, bucket verdict counts."""
        phases = []
        for p in self.phases:
            low, ref = self.bytes_per_step(p.name)
            per_route: dict[str, dict[str, int]] = {}
            for b in self.params.values():
                entry = per_route.setdefault(b.routes[p.name].label(), {"params": 0, "numel": 0})
                entry["params"] += 1
                entry["numel"] += b.numel
            verdicts = [b.verdicts.get(p.name, "admit") for b in self.buckets]
            phases.append(
                {
                    "phase": p.name,
                    "start": p.start,
                    "end": p.end,
                    "traffic_fraction": self.traffic_fraction(p.name),
                    "bytes_per_step": low,
                    "fp32_bytes_per_step": ref,
                    "routes": dict(sorted(per_route.items())),
                    "buckets_admitted": verdicts.count("admit"),
                    "buckets_fallback": verdicts.count("fallback"),
                }
            )
        return {
            "fingerprint": self.fingerprint,
            "workload": self.meta.get("workload"),
            "world_size": self.world_size,
            "bucket_cap_mb": self.bucket_cap_mb,
            "bucket_order": self.bucket_order,
            "params": len(self.params),
            "numel": sum(b.numel for b in self.params.values()),
            "buckets": len(self.buckets),
            "phases": phases,
        }


def modelled_bytes(spec: RouteSpec, segments: tuple[int, ...], world_size: int,
                   dtype: torch.dtype | None = None) -> int:
    """Bytes one (non-root) rank sends plus receives for one reduce of `segments` on `spec`
    (gradients of `dtype`: what the full-precision route sends)."""
    numel = sum(segments)
    if not numel:
        return 0
    return make_route(spec, dtype).wire_bytes(numel, world_size, segments=segments).total
