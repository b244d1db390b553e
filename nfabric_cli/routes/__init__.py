"""Routes: the wire formats a gradient slice can take across the fabric.

`make_route(spec)` builds a route from a `RouteSpec`. Every route offers `plan` (its
collectives), `wire_bytes`, `reduce` (real collective over a `Comm`), `simulate` (N workers in
one process, same codec) and a local `encode` / `decode`.
"""

from __future__ import annotations

import functools

import torch

from nfabric_cli.routes.base import Payload, Route, check_input
from nfabric_cli.routes.comm import Comm
from nfabric_cli.routes.fp32 import Fp32Route
from nfabric_cli.routes.half import Bf16Route, Fp16Route
from nfabric_cli.routes.intq import Int4Route, Int8Route
from nfabric_cli.routes.memory import ErrorFeedback
from nfabric_cli.routes.plan import CommOp, WireBytes
from nfabric_cli.routes.sign import SignRoute
from nfabric_cli.routes.spec import FP32, LOWBIT_ROUTES, ROUTE_NAMES, RouteSpec
from nfabric_cli.routes.ternary import TernaryRoute

_CLASSES: dict[str, type[Route]] = {
    "fp32": Fp32Route,
    "bf16": Bf16Route,
    "fp16": Fp16Route,
    "int8": Int8Route,
    "int4": Int4Route,
    "ternary": TernaryRoute,
    "sign": SignRoute,
}


@functools.lru_cache(maxsize=256)
def make_route(spec: RouteSpec | str, dtype: torch.dtype | None = None) -> Route:
    """The route for a spec (or a bare route name with default options) carrying gradients of
    `dtype` (default float32). Routes are stateless.

    `fp32` is the full-precision route: the gradient's own dtype on the wire, as plain DDP
    sends it (float32 for a float32 model, bfloat16 for a bf16 model), never an up-cast.
    Every other route's wire format does not depend on the gradient's dtype."""
    if isinstance(spec, str):
        spec = RouteSpec(spec)
    route = _CLASSES[spec.name](spec)
    if spec.name == "fp32" and dtype is not None and dtype.is_floating_point:
        route.wire_dtype = dtype  # full precision is the gradient's own precision
    return route


__all__ = [
    "FP32",
    "LOWBIT_ROUTES",
    "ROUTE_NAMES",
    "Comm",
    "CommOp",
    "ErrorFeedback",
    "Payload",
    "Route",
    "RouteSpec",
    "WireBytes",
    "check_input",
    "make_route",
]
