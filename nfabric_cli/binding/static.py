"""Hand-written (static) profiles: `nfabric profile init`.

Rules ``SELECTOR=ROUTE`` apply in order, the first match wins, and a default rule ``*``
takes the remaining parameters; the same rules hold in every phase. The profile is compiled
against the model before it is returned, so a selector that matches nothing fails here and
not at launch time. Without substrate information the runtime admits it as written.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from nfabric_cli.binding.compile import compile_profile, name_some, shadowed_rules
from nfabric_cli.binding.fingerprint import model_fingerprint, trainable_parameters
from nfabric_cli.binding.matching import params_record
from nfabric_cli.binding.selectors import check_selector, selector_matches
from nfabric_cli.errors import InputError
from nfabric_cli.profile.operating import OperatingProfile, route_row
from nfabric_cli.profile.phases import Phase
from nfabric_cli.profile.provenance import base_provenance
from nfabric_cli.routes.spec import REDUCERS, RouteSpec

DEFAULT_SELECTOR = "*"


def parse_rule(text: str) -> tuple[str, str]:
    """``'head.*=fp32'`` -> ("head.*", "fp32"); the route is checked."""
    selector, sep, route = text.rpartition("=")
    if not sep or not selector.strip() or not route.strip():
        raise InputError(f"--set {text!r}: expected SELECTOR=ROUTE, e.g. 'head.*=fp32'")
    RouteSpec(route.strip())
    return check_selector(selector), route.strip()


def static_profile(
    model: nn.Module,
    default_route: str,
    rules: list[tuple[str, str]] | None = None,
    phases: list[Phase] | None = None,
    workload: str | None = None,
    tau: float | None = None,
    error_feedback: bool = False,
    reducer: str = "sharded",
    world_size: int | None = None,
    provenance: dict[str, Any] | None = None,
) -> OperatingProfile:
    """A profile that routes `rules` (in order) then `*` -> `default_route`, in every phase.

    `tau` applies to ternary rows; `error_feedback` and `reducer` to every non-fp32 row.
    `provenance` adds to the recorded provenance (e.g. the workload's data fingerprint).
    """
    rules = list(rules or [])
    phases = phases or [Phase("all", 0.0, 1.0)]
    if reducer not in REDUCERS:
        raise InputError(f"unknown reducer {reducer!r} (choose from {', '.join(REDUCERS)})")
    if tau is not None and not 0.0 <= tau < 1.0:  # checked even where no row is ternary
        raise InputError(f"tau must be in [0, 1), got {tau}")
    if any(sel == DEFAULT_SELECTOR for sel, _ in rules):
        raise InputError("--set '*=ROUTE' duplicates the default rule; use --route ROUTE")
    ordered = [*rules, (DEFAULT_SELECTOR, default_route)]
    rows = []
    for phase in phases:
        for priority, (selector, route) in enumerate(ordered):
            rows.append(route_row(selector, phase, priority, route, tau=tau,
                                  error_feedback=error_feedback, reducer=reducer,
                                  any_lossy=True))
    meta: dict[str, Any] = {
        "workload": workload,
        "model_fingerprint": model_fingerprint(model),
        "world_size": world_size,
        "provenance": base_provenance(
            source="profile init",
            rules=[f"{s}={r}" for s, r in ordered],
            model_params=params_record(trainable_parameters(model)),
            **(provenance or {}),
        ),
    }
    profile = OperatingProfile(rows, meta).validate()
    bindings = compile_profile(profile, model, world_size=world_size)  # fails on a dead selector
    shadowed = shadowed_rules(profile, bindings)
    if shadowed:  # a hand-written rule that does nothing: say so now, not in a run
        sel = next(iter(shadowed))
        mine = [p for p in trainable_parameters(model) if selector_matches(sel, p)]
        first = [s for s, _ in rules if s != sel and any(selector_matches(s, p) for p in mine)]
        raise InputError(f"--set {sel!r} claims no parameter: every one it matches is claimed "
                         f"first by {name_some([repr(f) for f in first])}; put it before them")
    return profile


def on_route(profile: OperatingProfile, route: str = "fp32") -> OperatingProfile:
    """`profile` with every row on `route` (no route options): the same regions, hence the same
    health scopes, and the same phases. The reference arm of a like-for-like comparison."""
    RouteSpec(route)
    rows = [dataclasses.replace(r, route=route, error_feedback=False, tau=None, rounding=None,
                                mode=None, zeros=None, chunk=None) for r in profile.rows]
    return OperatingProfile(rows, dict(profile.meta))
