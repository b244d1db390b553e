"""`RouteSpec`: the name and options of a route, as profiles and bindings store them.

A spec is plain data (no tensors, no process groups) so the profile and binding layers can
carry it without importing the codecs. `nfabric_cli.routes.make_route(spec)` builds the route.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from nfabric_cli.errors import InputError

#: Every route name, cheapest-on-the-wire last. `sign` is the cheapest low-bit route.
ROUTE_NAMES: tuple[str, ...] = ("fp32", "bf16", "fp16", "int8", "int4", "ternary", "sign")
LOWBIT_ROUTES: tuple[str, ...] = ("int8", "int4", "ternary", "sign")
REDUCERS: tuple[str, ...] = ("sharded", "central")
ROUNDINGS: tuple[str, ...] = ("nearest", "stochastic")
SIGN_MODES: tuple[str, ...] = ("majority", "count")
#: How sign votes an exact zero: "split" (half the ranks up, half down, alternating each step:
#: at an even world size an element no rank has a gradient for ties and gets exactly 0) or
#: "negative" (every rank votes it down: what profiles of schema 1.0 were proven with).
ZERO_VOTES: tuple[str, ...] = ("split", "negative")

#: Default elements per scale chunk, per route (a chunk never spans two parameters).
DEFAULT_CHUNK: dict[str, int] = {"int8": 2048, "int4": 512, "ternary": 4096, "sign": 4096}
DEFAULT_TAU = 0.5


@dataclass(frozen=True)
class RouteSpec:
    """One route with its options.

    - ``tau``: ternary gate; |g| < tau * scale becomes 0 (ignored by other routes).
    - ``chunk``: elements per scale chunk (None: the route's default).
    - ``error_feedback``: keep the local compression residual per parameter and add it back.
    - ``reducer``: ``sharded`` (all-to-all + all-gather) or ``central`` (fan-in to rank 0).
    - ``rounding``: int8/int4 rounding, ``nearest`` or ``stochastic``.
    - ``mode``: sign reducer output, ``majority`` (sign of the vote) or ``count`` (scaled count).
    - ``zeros``: how sign votes an exact zero (`ZERO_VOTES`): ``split`` (default) or
      ``negative`` (the rule before profile schema 1.1, kept so those profiles replay).
    """

    name: str = "fp32"
    tau: float = DEFAULT_TAU
    chunk: int | None = None
    error_feedback: bool = False
    reducer: str = "sharded"
    rounding: str = "nearest"
    mode: str = "majority"
    zeros: str = "split"

    def __post_init__(self) -> None:
        if self.name not in ROUTE_NAMES:
            raise InputError(
                f"unknown route {self.name!r} (choose from {', '.join(ROUTE_NAMES)})"
            )
        if self.reducer not in REDUCERS:
            raise InputError(f"unknown reducer {self.reducer!r} (choose from sharded, central)")
        if self.rounding not in ROUNDINGS:
            raise InputError(f"unknown rounding {self.rounding!r} (nearest or stochastic)")
        if self.mode not in SIGN_MODES:
            raise InputError(f"unknown sign mode {self.mode!r} (majority or count)")
        if self.zeros not in ZERO_VOTES:
            raise InputError(f"unknown sign zero vote {self.zeros!r} (split or negative)")
        if self.chunk is not None and self.chunk < 1:
            raise InputError(f"chunk must be >= 1, got {self.chunk}")
        if not (0.0 <= self.tau < 1.0):
            raise InputError(f"tau must be in [0, 1), got {self.tau}")

    @property
    def lowbit(self) -> bool:
        return self.name in LOWBIT_ROUTES

    @property
    def effective_chunk(self) -> int:
        return self.chunk if self.chunk is not None else DEFAULT_CHUNK.get(self.name, 0)

    def with_name(self, name: str) -> RouteSpec:
        return replace(self, name=name)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RouteSpec:
        if not isinstance(data, dict):
            raise InputError(f"a route spec is a table of its fields (name, ...), got {data!r}")
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data and data[k] is not None}
        return cls(**known)

    def label(self) -> str:
        """Short human label, e.g. ``sign/sharded+ef`` or ``ternary(tau=0.5)``."""
        text = self.name
        if self.name == "ternary":
            text += f"(tau={self.tau:g})"
        if self.name in ("sign", "ternary", "int8", "int4"):
            text += f"/{self.reducer}"
        if self.error_feedback:
            text += "+ef"
        return text


FP32 = RouteSpec("fp32")
