"""A bucket's sharded low-bit reduces share one all-to-all and one all-gather (issue 16, part 2).

`reduce_pieces` over several pieces of different routes gives each piece exactly what its
route's `simulate` gives (the same bits as reducing it alone), issues one all-to-all and one
all-gather in all (plus one MAX all-reduce when an int route is among them), and moves exactly
the bytes the pieces' own plans add up to.
"""

from __future__ import annotations

import pytest
import torch

from nfabric_cli.routes import Comm, RouteSpec, make_route
from nfabric_cli.routes.exchange import Piece, reduce_pieces
from tests.distutil import run_ranks

# (route, segments): odd lengths, several parameters per piece, one empty piece
PIECES = [
    (RouteSpec("sign"), (7, 1000, 1)),
    (RouteSpec("int8", rounding="stochastic", chunk=100), (513,)),
    (RouteSpec("ternary", tau=0.2), (2993, 5)),
    (RouteSpec("sign", mode="count", chunk=128), (77,)),
    (RouteSpec("int4", chunk=64), (0,)),
    (RouteSpec("int4", chunk=64), (300, 41)),
]
SIGN_ONLY = [PIECES[0], PIECES[3]]


def _grads(world: int, segments: tuple[int, ...], k: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * world + k)
    return [torch.randn(sum(segments), generator=gen) * (1 + r) for r in range(world)]


def _noise(spec: RouteSpec, world: int, segments: tuple[int, ...], k: int) -> list:
    if spec.rounding != "stochastic":
        return [None] * world
    return [torch.rand(sum(segments), generator=torch.Generator().manual_seed(7 * k + r))
            for r in range(world)]


def _worker(rank: int, world: int) -> list[dict]:
    return [_exchange(rank, world, pieces) for pieces in (PIECES, SIGN_ONLY)]


def _exchange(rank: int, world: int, pieces: list) -> dict:
    comm = Comm()
    xs, stats = [], []
    batch = []
    for k, (spec, segs) in enumerate(pieces):
        xs.append(_grads(world, segs, k)[rank].clone())
        stats.append({})
        batch.append(Piece(make_route(spec), xs[-1], segs, stats[-1],
                           _noise(spec, world, segs, k)[rank]))
    reduce_pieces(batch, comm)
    calls = [kind for kind, _ in comm.calls]
    return {"x": xs, "stats": stats, "calls": calls, "bytes": comm.take()}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_one_exchange_equals_each_route_alone(world: int) -> None:
    per_rank = run_ranks(_worker, world)
    for j, (pieces, kinds) in enumerate(((PIECES, ["allreduce", "all_to_all", "all_gather"]),
                                         (SIGN_ONLY, ["all_to_all", "all_gather"]))):
        results = [r[j] for r in per_rank]
        for rank, got in enumerate(results):
            assert got["calls"] == kinds  # one round of each, whatever the number of pieces
            planned = None
            for k, (spec, segs) in enumerate(pieces):
                route = make_route(spec)
                stats: dict = {}
                sim = route.simulate(_grads(world, segs, k), segs, stats,
                                     _noise(spec, world, segs, k))
                assert torch.equal(got["x"][k], sim), (world, rank, spec)
                wb = route.wire_bytes(sum(segs), world, rank, segs)
                planned = wb if planned is None else planned + wb
            assert got["bytes"] == planned
        # agreement sums: every rank's shard adds up to the simulator's whole
        for k, (spec, segs) in enumerate(pieces):
            stats = {}
            make_route(spec).simulate(_grads(world, segs, k), segs, stats,
                                      _noise(spec, world, segs, k))
            if "agree_n" in stats:
                total = sum(float(r["stats"][k]["agree_sum"]) for r in results)
                assert total == pytest.approx(float(stats["agree_sum"]), abs=0)
                assert sum(r["stats"][k]["agree_n"] for r in results) == stats["agree_n"]
