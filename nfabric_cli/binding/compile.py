"""compile_profile: resolve a profile's selectors against a real model instance.

Every trainable parameter gets exactly one route per phase (first matching rule by priority;
tied tensors once, frozen parameters none), or compilation fails naming what is wrong: a
selector that matches nothing, parameters left unrouted, or a model that is not the one the
profile was made for (`matching.py`: wrapper prefixes, `torch.compile` and dtype casts are
not differences). The result carries DDP's bucket plan, a capacity verdict per bucket
and phase, and the modelled bytes.
"""

from __future__ import annotations

import operator
from typing import Any

from torch import nn

from nfabric_cli.binding.bindings import Bindings, BucketPlan, ParamBinding
from nfabric_cli.binding.buckets import bucket_slots, plan_buckets
from nfabric_cli.binding.fingerprint import TrainableParam, fingerprint_of, trainable_parameters
from nfabric_cli.binding.matching import match_model
from nfabric_cli.binding.selectors import check_selector, selector_matches
from nfabric_cli.errors import InputError
from nfabric_cli.profile.operating import OperatingProfile
from nfabric_cli.routes.groups import spec_numels
from nfabric_cli.routes.spec import RouteSpec

NO_SUBSTRATE_REASON = "no substrate: admitted as written"


def name_some(names: list[str], limit: int = 5) -> str:
    """'a, b, c' or 'a, b, c, d, e and 7 more' for error messages."""
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


def resolve_routes(
    profile: OperatingProfile, params: list[TrainableParam]
) -> dict[str, dict[str, tuple[RouteSpec, str]]]:
    """param name -> phase -> (route, region): the first rule that matches, per phase."""
    resolved: dict[str, dict[str, tuple[RouteSpec, str]]] = {p.name: {} for p in params}
    dead: dict[str, list[str]] = {}  # selector -> phases where it matches nothing
    unrouted: dict[str, list[str]] = {}
    for phase in profile.phases():
        rules = profile.rules(phase.name)
        for rule in rules:
            check_selector(rule.region)
            if not any(selector_matches(rule.region, p) for p in params):
                dead.setdefault(rule.region, []).append(phase.name)
        for p in params:
            rule = next((r for r in rules if selector_matches(r.region, p)), None)
            if rule is None:
                unrouted.setdefault(phase.name, []).append(p.name)
            else:
                resolved[p.name][phase.name] = (rule.spec(), rule.region)
    if dead:
        named = [f"{sel!r} ({', '.join(phases)})" for sel, phases in dead.items()]
        raise InputError(
            f"selector {name_some(named)} matches no trainable parameter of this model"
        )
    if unrouted:
        phase_name, names = next(iter(unrouted.items()))
        raise InputError(
            f"{len(names)} parameter(s) left unrouted in phase {phase_name!r}: {name_some(names)} "
            "(add a default rule '*')"
        )
    return resolved


def shadowed_rules(profile: OperatingProfile, bindings: Bindings) -> dict[str, list[str]]:
    """selector -> phases where its rule claims no parameter of `bindings` (compiled from
    `profile`: a selector that matches nothing failed there, so every parameter it matches is
    an earlier rule's): a rule that does nothing, most likely one in the wrong order. The
    default rule `*` closing a phase is not counted (it may have nothing left)."""
    claimed = {(region, phase) for b in bindings.params.values()
               for phase, region in b.regions.items()}
    shadowed: dict[str, list[str]] = {}
    for phase in profile.phases():
        rules = profile.rules(phase.name)
        for i, rule in enumerate(rules):
            default = rule.region == "*" and i == len(rules) - 1
            if not default and (rule.region, phase.name) not in claimed:
                shadowed.setdefault(rule.region, []).append(phase.name)
    return shadowed


def plan_layout(
    bindings: Bindings,
    params: list[TrainableParam],
    bucket_cap_mb: float | None,
    find_unused_parameters: bool = False,
    ready_order: list[str] | None = None,
) -> None:
    """(Re)plan DDP's buckets for `bindings`: bucket and offset of every parameter, empty
    verdicts (call `fill_buckets` next). Routes are untouched: they are keyed by name."""
    layout = plan_buckets(params, bucket_cap_mb, find_unused_parameters, ready_order)
    slots = bucket_slots(layout, params)
    for name, binding in bindings.params.items():
        binding.bucket, binding.offset = slots[name].bucket, slots[name].offset
    bindings.buckets = [
        BucketPlan(i, names, sum(slots[n].numel for n in names), {}, {})
        for i, names in enumerate(layout)
    ]
    bindings.bucket_cap_mb = bucket_cap_mb
    bindings.find_unused_parameters = find_unused_parameters
    bindings.bucket_order = "traced" if ready_order else "reverse-registration"


def fill_buckets(bindings: Bindings, substrate: Any) -> None:
    """Fill each bucket's modelled bytes and capacity verdict with its reason, per phase."""
    sub = _as_substrate(substrate)
    for bucket in bindings.buckets:
        for phase in bindings.phases:
            low, ref = bindings.bucket_bytes(bucket.index, phase.name)
            bucket.wire_bytes[phase.name], bucket.fp32_bytes = low, ref
            if sub is None:
                verdict, reason = "admit", NO_SUBSTRATE_REASON
            else:
                from nfabric_cli.substrate.cost import bucket_verdict  # binding -> substrate

                groups = spec_numels(bindings.bucket_groups(bucket.index, phase.name))
                verdict, reason, _, _ = bucket_verdict(sub, groups, bindings.world_size)
            bucket.verdicts[phase.name], bucket.reasons[phase.name] = verdict, reason


def _as_substrate(substrate: Any) -> Any:
    from nfabric_cli.substrate.model import as_substrate  # binding -> substrate

    return as_substrate(substrate, source="profile substrate")


def compile_profile(
    profile: OperatingProfile,
    model: nn.Module,
    world_size: int | None = None,
    bucket_cap_mb: float | None = None,
    total_steps: int | None = None,
    substrate: Any = None,
    find_unused_parameters: bool = False,
    ready_order: list[str] | None = None,
) -> Bindings:
    """Bind `profile` to `model` (see module doc).

    - `world_size`: ranks to model bytes and verdicts for (default: the profile's, else 2).
    - `bucket_cap_mb`: what the runtime passes to DDP (None, the default: DDP's own default,
      25 MB with a 1 MB first bucket; an explicit cap also caps the first bucket, see
      `bucket_caps`).
    - `substrate`: a `Substrate` or its dict (default: the profile's); None admits every bucket.
    - `find_unused_parameters` / `ready_order`: pick DDP's layout (see `binding.buckets`).
    """
    profile.validate()
    ws = default_world_size(profile, world_size)
    total_steps = check_total_steps(total_steps)
    params = trainable_parameters(model)
    if not params:
        raise InputError("the model has no trainable parameters")
    match = match_model(profile.meta, params)
    fingerprint = fingerprint_of(params)
    params = match.aliased(params)  # selectors match the profile's names and the model's
    resolved = resolve_routes(profile, params)
    bindings = Bindings(
        phases=profile.phases(),
        params={
            p.name: ParamBinding(
                name=p.name,
                shape=p.shape,
                numel=p.numel,
                dtype=p.dtype,
                bucket=-1,  # set by plan_layout
                offset=-1,
                routes={ph: spec for ph, (spec, _) in resolved[p.name].items()},
                regions={ph: region for ph, (_, region) in resolved[p.name].items()},
                aliases=p.aliases,
            )
            for p in params
        },
        buckets=[],
        world_size=ws,
        bucket_cap_mb=bucket_cap_mb,
        total_steps=total_steps,
        fingerprint=fingerprint,
        meta=dict(profile.meta),
    )
    if match.notes():
        bindings.meta["model_match"] = {**match.to_dict(), "notes": match.notes()}
    plan_layout(bindings, params, bucket_cap_mb, find_unused_parameters, ready_order)
    if substrate is not None:
        remember_substrate(bindings, substrate)
    fill_buckets(bindings, bindings.meta.get("substrate"))
    return bindings


def whole_number(value: Any) -> int | None:
    """`value` as an int where it is one (an int, a numpy integer), else None (a float, a
    string, a bool)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_total_steps(total_steps: Any) -> int | None:
    """`total_steps` as an int (None stays None); InputError unless a whole number >= 1 (a
    float, a string or 0 would place the phases somewhere nobody asked for)."""
    if total_steps is None:
        return None
    steps = whole_number(total_steps)
    if steps is None or steps < 1:
        raise InputError(f"total steps must be a whole number >= 1, got {total_steps!r}")
    return steps


def default_world_size(profile: OperatingProfile, world_size: int | None = None) -> int:
    """The ranks to compile for: `world_size`, else the profile's, else 2 (InputError unless
    a positive integer)."""
    ws = world_size if world_size is not None else (profile.meta.get("world_size") or 2)
    if not isinstance(ws, int) or isinstance(ws, bool) or ws < 1:
        raise InputError(f"world size must be a positive integer, got {ws!r}")
    return ws


def compile_for_workload(
    profile: OperatingProfile,
    model: nn.Module,
    workload: Any | None,
    world_size: int | None = None,
    bucket_cap_mb: float | None = None,
    total_steps: int | None = None,
    substrate: Any = None,
    find_unused_parameters: bool = False,
) -> Bindings:
    """`compile_profile` for a run on `workload` (None: a bare model): a workload has data, so
    DDP's bucket order is observed from one real backward pass (`trace_ready_order`) instead
    of assumed from the parameter order (not with `find_unused_parameters`, where DDP keeps
    its initial assignment)."""
    from nfabric_cli.binding.buckets import trace_ready_order

    order = None
    if workload is not None and not find_unused_parameters:
        ws = default_world_size(profile, world_size)
        order = trace_ready_order(
            model, lambda: workload.loss(model, workload.train_batch(0, 0, ws, 0)).backward())
    return compile_profile(profile, model, world_size, bucket_cap_mb, total_steps, substrate,
                           find_unused_parameters, order)


def remember_substrate(bindings: Bindings, substrate: Any) -> None:
    """Store `substrate` (a `Substrate` or its dict) in the bindings' metadata: the runtime's
    capacity gate prices buckets on what the bindings carry, so it must be the fabric their
    verdicts were computed for."""
    from nfabric_cli.substrate.model import Substrate

    sub = Substrate.from_dict(substrate) if isinstance(substrate, dict) else substrate
    bindings.meta["substrate"] = sub.to_dict()
