"""What the simulated ranks receive: the hook's reduces, simulated one (region, route) group at
a time with per-rank error feedback, for a set of parameters (a region's agreement sums are
then simply that group's).

A route's result for an element depends only on its chunk, and chunks never span parameters
(scales, codes and sign votes are per chunk; stochastic-rounding noise is drawn per parameter),
so any split of the parameters into groups gives the same values bit for bit: the hook's
per-bucket route groups, one group per (region, route) over the whole model, or the parameter shards
that forked processes aggregate side by side (`shard`). A float route's sum is per element
too, in the order gloo adds that element in the real run's all-reduce (`reduces.py`, given as
`orders`). Mirrors `runtime/state.py`'s numbers (values, residuals, each region's agreement),
deliberately not its grouping: the hook groups by route only (`routes/groups.py`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nfabric_cli.routes import ErrorFeedback, make_route
from nfabric_cli.routes.base import Route, codec_noise
from nfabric_cli.routes.ring import Piece, join_pieces, ring_pieces
from nfabric_cli.routes.spec import RouteSpec

if TYPE_CHECKING:
    from nfabric_cli.calibration.reduces import ReduceOrders

#: (agree_sum, agree_n) per health scope: the sign routes' vote agreement.
Agreement = dict[str, tuple[float, float]]

#: Fixed aggregation work, in elements of a sign route's work: per parameter (error feedback,
#: slicing) and per (region, route) group (a route call, an encode, a roundtrip and error
#: feedback per rank: on `vision` a shard holding one more group took 1.5x as long).
PER_PARAM_ELEMS = 256
PER_GROUP_ELEMS = 50_000


@dataclass(frozen=True)
class StepRoutes:
    """One step's decisions, per parameter (in the simulator's parameter order): the health
    scope it reports to and the route it takes (fp32 where the monitor or the gate says so).
    `plain`: the step goes out as plain DDP (an all-fp32 phase), so a non-finite value is
    neither zeroed before the reduce nor neutralised after it: it reaches the optimizer, as
    there."""

    regions: tuple[str, ...]
    specs: tuple[RouteSpec, ...]
    plain: bool = False


def shard(
    numels: Sequence[int], parts: int, groups: Sequence[Hashable] | None = None
) -> list[list[int]]:
    """Parameter indices split into `parts` sets of about equal aggregation work, each in
    index order. `groups[i]`: a key shared by parameters likely reduced together (their
    regions and routes): a set pays the fixed cost of each key it holds once. Greedy, largest
    first onto the set it costs least, then single moves off the busiest set while they help."""
    keys = list(groups) if groups is not None else [None] * len(numels)
    sets: list[list[int]] = [[] for _ in range(max(1, parts))]

    def load(members: list[int]) -> int:
        held = {keys[i] for i in members}
        return sum(numels[i] + PER_PARAM_ELEMS for i in members) + PER_GROUP_ELEMS * len(held)

    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        best = min(range(len(sets)), key=lambda p: (load([*sets[p], i]), p))
        sets[best].append(i)
    for _ in range(4 * len(numels)):
        loads = [load(m) for m in sets]
        hi, lo = loads.index(max(loads)), loads.index(min(loads))
        moves = [(max(load([j for j in sets[hi] if j != i]), load([*sets[lo], i])), i)
                 for i in sets[hi]]
        if hi == lo or not moves or min(moves)[0] >= loads[hi]:
            break
        i = min(moves)[1]
        sets[hi].remove(i)
        sets[lo].append(i)
    return [sorted(m) for m in sets]


class Aggregator:
    """Per-rank error feedback for the parameters it owns, and their aggregation."""

    def __init__(
        self, names: Sequence[str], world_size: int, seed: int, owned: Sequence[int],
        orders: ReduceOrders | None = None,
    ) -> None:
        self.names, self.world_size, self.seed = list(names), world_size, seed
        self.owned = list(owned)
        self.orders = orders
        self.efs = [ErrorFeedback() for _ in range(world_size)]
        self._routes: dict[RouteSpec, Route] = {}

    def reset_feedback(self, i: int) -> None:
        """Forget parameter `i`'s error-feedback residual on every rank (a held update's)."""
        for ef in self.efs:
            ef.reset(self.names[i])

    def _route(self, spec: RouteSpec) -> Route:
        if spec not in self._routes:
            self._routes[spec] = make_route(spec)
        return self._routes[spec]

    def run(
        self,
        step: int,
        plan: StepRoutes,
        grads: Sequence[Sequence[torch.Tensor]],
        out: Sequence[torch.Tensor],
    ) -> Agreement:
        """Aggregate the owned parameters of every rank's flat gradients `grads[rank][i]` into
        `out[i]`; returns the sign agreement per scope. Error feedback compensates before the
        reduce and keeps what each rank's own roundtrip lost, as the hook does."""
        groups: dict[tuple[str, RouteSpec], list[int]] = {}
        for i in self.owned:
            spec = plan.specs[i]
            groups.setdefault((plan.regions[i] if spec.lowbit else "", spec), []).append(i)
        agree: Agreement = {}
        for (region, spec), idx in groups.items():
            route, label = self._route(spec), spec.label()
            names = [self.names[i] for i in idx]
            segs = tuple(out[i].numel() for i in idx)
            if spec.error_feedback:
                flats = [ef.compensate_flat(names, label, [g[i] for i in idx])
                         for ef, g in zip(self.efs, grads, strict=True)]
            else:
                flats = [torch.cat([g[i] for i in idx]) if len(idx) > 1 else g[idx[0]]
                         for g in grads]
            noise = [codec_noise(spec, self.seed, step, r, names, segs)
                     for r in range(self.world_size)]
            stats: dict[str, float | torch.Tensor] = {}  # the torch path's margins: a tensor
            if spec.lowbit:
                result = route.simulate(flats, segs, stats, noise)
            else:  # a float route: the sum in gloo's order
                pieces = self._pieces(step, plan, idx, route, segs)
                result = route.simulate(flats, segs, stats, noise, pieces=pieces)
            if spec.error_feedback and spec.lowbit:
                # One roundtrip per rank and group, as the hook does it (same noise as sent).
                for ef, flat, nz in zip(self.efs, flats, noise, strict=True):
                    ef.update_flat(names, flat, route.roundtrip(flat, segs, nz), segs)
            for i, piece in zip(idx, result.split(segs), strict=True):
                out[i].copy_(piece)
            if "agree_n" in stats:
                s, n = agree.get(region, (0.0, 0.0))
                agree[region] = (s + float(stats["agree_sum"]), n + float(stats["agree_n"]))
        return agree

    def _pieces(self, step: int, plan: StepRoutes, idx: list[int], route: Route,
                segs: tuple[int, ...]) -> tuple[Piece, ...]:
        """Ring pieces of a float group's flat: the real run's (`orders`), else as if each
        parameter were all-reduced alone (any split of the parameters agrees)."""
        if self.orders is not None:
            return self.orders.group(step, plan, tuple(idx))
        size = route.wire_dtype.itemsize  # type: ignore[attr-defined]
        return join_pieces([ring_pieces(0, n, n, self.world_size, size) for n in segs], segs)


def merge_agreement(parts: Sequence[Agreement]) -> Agreement:
    """Sum the per-scope (agree_sum, agree_n) of several shards."""
    total: Agreement = {}
    for part in parts:
        for scope, (s, n) in part.items():
            a, b = total.get(scope, (0.0, 0.0))
            total[scope] = (a + s, b + n)
    return total
