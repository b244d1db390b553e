"""A bucket's sharded low-bit reduces share one all-to-all and one all-gather (issue 16, part 2).

`reduce_pieces` over several pieces of different routes gives each piece exactly what its
route's `simulate` gives (the same bits as reducing it alone), issues one all-to-all and one
all-gather in all (plus one MAX all-reduce when an int route is among them), and moves exactly
the bytes the pieces' own plans add up to.
"""

from __future__ import annotations

import pytest
import torch

from nfabric_cli.routes import Comm, CommOp, RouteSpec, make_route
from nfabric_cli.routes.exchange import WHOLE, Piece, reduce_pieces
from tests.distutil import run_ranks

# (route, segments): odd lengths, several parameters per piece, one empty piece
PIECES = [
    (RouteSpec("sign"), (7, 1000, 1)),
    (RouteSpec("int8", rounding="stochastic", chunk=100), (513,)),
    (RouteSpec("ternary", tau=0.2), (2993, 5)),
    (RouteSpec("sign", mode="count", chunk=128), (77,)),
    (RouteSpec("int4", chunk=64), (0,)),
    (RouteSpec("int4", chunk=64), (300, 41)),
    (RouteSpec("int8", chunk=256), (1000, 24)),  # nearest: quantised straight onto the wire
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


def test_which_routes_gather_codes_instead_of_sharding():
    # (W - 1) code widths against the result's width: gather where the result is wider
    gathers = {name: [w for w in range(2, 9) if make_route(RouteSpec(name)).gathers_codes(w)]
               for name in ("sign", "int8", "int4", "ternary")}
    assert gathers == {"sign": [2], "int8": [2], "int4": [2], "ternary": [2, 3]}
    assert make_route(RouteSpec("sign", mode="count")).gathers_codes(4)  # 0..4: 4-bit counts
    assert not make_route(RouteSpec("sign", reducer="central")).gathers_codes(2)
    # the plan is one all-gather of the padded codes and, for sign, its scales
    assert make_route(RouteSpec("sign")).plan(4097, 2) == [CommOp("all_gather", 520 + 8)]


#: per world size, the collectives of PIECES and SIGN_ONLY: at W = 2 every piece gathers
#: codes with its local scales, so one all-gather and nothing else; from W = 3 int8 / int4
#: add the MAX all-reduce of their scales
CALLS = {2: (["all_gather"], ["all_gather"]),
         3: (["allreduce", "all_to_all", "all_gather"], ["all_to_all", "all_gather"]),
         4: (["allreduce", "all_to_all", "all_gather"], ["all_to_all", "all_gather"])}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_one_exchange_equals_each_route_alone(world: int) -> None:
    per_rank = run_ranks(_worker, world)
    for j, (pieces, kinds) in enumerate(zip((PIECES, SIGN_ONLY), CALLS[world], strict=True)):
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
                gathered = make_route(spec).gathers_codes(world)
                # every rank holds the same whole part, not to be summed over ranks: the
                # agreement of a piece combined whole on every rank (it gathers codes), or the
                # silent chunks left out of a sharded one (none here: 0); a sharded piece's
                # ranks each count their shard
                wholes = [r["stats"][k].get(WHOLE, {}) for r in results]
                for key in ("agree_sum", "agree_n"):
                    held = {float(w.get(key, 0)) for w in wholes}
                    assert len(held) == 1, (world, spec, key)
                    shards = sum(float(r["stats"][k].get(key, 0)) for r in results)
                    if gathered:
                        assert shards == 0, (world, spec, key)
                    assert shards + held.pop() == float(stats[key]), (world, spec, key)


# One sign piece over three health scopes (`Tally`): ranges of odd lengths that cross 64-element
# words and the kernels' tiles, a scope met twice, and parameters of one scope side by side.
SCOPED = (RouteSpec("sign"), (7, 1000, 1, 2993, 16_384, 5), ("a", "b", "a", "c", "c", "b"))
SCOPED_COUNT = (RouteSpec("sign", mode="count", chunk=128), (300, 41, 77), ("b", "a", "b"))


def _scoped_worker(rank: int, world: int, native: bool) -> list[dict]:
    import os

    from nfabric_cli.routes import kernels
    from nfabric_cli.routes.tally import Tally

    os.environ[kernels.DISABLE_ENV] = "0" if native else "1"
    out = []
    for k, (spec, segs, scopes) in enumerate((SCOPED, SCOPED_COUNT)):
        comm = Comm()
        sinks = {s: {} for s in scopes}
        x = _grads(world, segs, k)[rank].clone()
        reduce_pieces([Piece(make_route(spec), x, segs,
                             Tally.over(scopes, segs, sinks.__getitem__))], comm)
        out.append({"x": x, "sinks": sinks, "bytes": comm.take(), "status": kernels.status()})
    return out


@pytest.mark.parametrize(("world", "native"), [(2, True), (3, True), (4, True), (2, False),
                                               (3, False)])
def test_a_piece_over_several_scopes_keeps_each_scopes_agreement(world: int, native: bool) -> None:
    """Regions on one route share one piece; each region's agreement sums are exactly those of
    its parameters reduced alone (on every rank where the piece is combined whole, summed over
    the ranks' shards where it is sharded), and the result is the route's bit for bit."""
    per_rank = run_ranks(_scoped_worker, world, native)
    for k, (spec, segs, scopes) in enumerate((SCOPED, SCOPED_COUNT)):
        route, grads = make_route(spec), _grads(world, segs, k)
        want: dict[str, dict] = {}
        off = 0
        for n, scope in zip(segs, scopes, strict=True):
            route.simulate([g[off : off + n] for g in grads], (n,), want.setdefault(scope, {}))
            off += n
        sim = route.simulate(grads, segs)
        gathered = route.gathers_codes(world)
        for rank, r in enumerate(per_rank):
            got = r[k]
            assert got["status"].startswith("native") == native
            assert torch.equal(got["x"], sim)
            assert got["bytes"] == route.wire_bytes(sum(segs), world, rank, segs)
        for scope, stats in want.items():
            if gathered:
                for r in per_rank:
                    whole = r[k]["sinks"][scope][WHOLE]
                    assert (float(whole["agree_sum"]), whole["agree_n"]) == (
                        float(stats["agree_sum"]), stats["agree_n"]), (scope, spec)
            else:
                sinks = [r[k]["sinks"][scope] for r in per_rank]
                assert sum(float(s.get("agree_sum", 0)) for s in sinks) == float(stats["agree_sum"])
                assert sum(s.get("agree_n", 0) for s in sinks) == stats["agree_n"], scope
