"""Silent chunks: elements no rank has a gradient for are left out of sign's vote agreement.

A chunk whose agreed scale is 0 decodes to exactly 0 whatever the votes; its elements voted
the zero vote (a tie under the split vote at an even world size), which read as a collapse of
agreement where such chunks were most of a scope. The agreement is now measured over the
other elements, alike on real ranks and in the simulator.
"""

from __future__ import annotations

import pytest
import torch

from nfabric_cli.routes import Comm, make_route
from nfabric_cli.routes.base import codec_noise
from nfabric_cli.routes.exchange import WHOLE, Piece, reduce_pieces
from nfabric_cli.routes.spec import RouteSpec
from tests.distutil import run_ranks

CHUNK = 256
# zero on every rank (16 chunks), random, zero on rank 0 only, zero on every rank (a tail
# chunk of 100), random: the silent elements are the first and the fourth parameters'
SEGMENTS = (4096, 1000, 2048, 100, 300)
SILENT = 4096 + 100


def _grads(world: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(world)
    out = []
    for r in range(world):
        parts = [torch.zeros(4096), torch.randn(1000, generator=gen),
                 torch.zeros(2048) if r == 0 else torch.randn(2048, generator=gen),
                 torch.zeros(100), torch.randn(300, generator=gen)]
        out.append(torch.cat(parts))
    return out


def _noise(spec: RouteSpec, world: int, step: int) -> list:
    return [codec_noise(spec, 0, step, r, ["p"], (sum(SEGMENTS),)) for r in range(world)]


def _margins(grads: list[torch.Tensor], noise: list, keep: torch.Tensor) -> float:
    """Sum of |2c - W| over the elements in `keep`, c the ranks voting up (the zero vote for
    an exact zero), computed element by element."""
    votes = [(g > 0) | ((g == 0) & bool(getattr(n, "up", False)))
             for g, n in zip(grads, noise, strict=True)]
    count = torch.stack(votes).sum(0)
    return float((2 * count - len(grads)).abs()[keep].sum())


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("zeros", ["split", "negative"])
@pytest.mark.parametrize("step", [0, 1])
def test_silent_chunks_are_left_out_of_the_agreement(world: int, zeros: str, step: int) -> None:
    spec = RouteSpec("sign", chunk=CHUNK, zeros=zeros)
    grads, noise = _grads(world), _noise(spec, world, step)
    stats: dict = {}
    make_route(spec).simulate(grads, SEGMENTS, stats, noise)
    keep = torch.ones(sum(SEGMENTS), dtype=torch.bool)
    keep[:4096] = False
    keep[4096 + 1000 + 2048 : 4096 + 1000 + 2048 + 100] = False
    n = sum(SEGMENTS) - SILENT
    assert float(stats["agree_n"]) == world * n
    assert float(stats["agree_sum"]) == _margins(grads, noise, keep)
    # the zeros of rank 0 alone still vote: its agreement is lower than the other ranks'
    assert 0 < float(stats["agree_sum"]) / float(stats["agree_n"]) < 1


def test_a_scope_of_silent_chunks_alone_has_no_agreement() -> None:
    stats: dict = {}
    spec = RouteSpec("sign", chunk=CHUNK)
    make_route(spec).simulate([torch.zeros(1024)] * 4, None, stats, _noise(spec, 4, 0))
    assert float(stats["agree_n"]) == 0 and float(stats["agree_sum"]) == 0


def _exchange(rank: int, world: int, zeros: str) -> dict:
    spec = RouteSpec("sign", chunk=CHUNK, zeros=zeros)
    x, stats = _grads(world)[rank].clone(), {}
    reduce_pieces([Piece(make_route(spec), x, SEGMENTS, stats, _noise(spec, world, 3)[rank])],
                  Comm())
    return {"x": x, "stats": {k: float(v) for k, v in stats.items() if k != WHOLE},
            "whole": {k: float(v) for k, v in stats.get(WHOLE, {}).items()}}


@pytest.mark.parametrize("world", [2, 3])
def test_real_ranks_leave_out_what_the_simulator_leaves_out(world: int) -> None:
    """At 2 ranks the codes are gathered and combined whole on every rank; at 3 each rank
    combines its shard and every rank takes the whole piece's silent chunks out once."""
    zeros = "split"
    spec = RouteSpec("sign", chunk=CHUNK, zeros=zeros)
    stats: dict = {}
    sim = make_route(spec).simulate(_grads(world), SEGMENTS, stats, _noise(spec, world, 3))
    ranks = run_ranks(_exchange, world, zeros)
    for r in ranks:
        assert torch.equal(r["x"], sim)
        assert r["whole"] == ranks[0]["whole"]  # held by every rank, not summed
    for key in ("agree_sum", "agree_n"):
        total = sum(r["stats"].get(key, 0.0) for r in ranks) + ranks[0]["whole"][key]
        assert total == float(stats[key]), key
    assert float(stats["agree_n"]) == world * (sum(SEGMENTS) - SILENT)
