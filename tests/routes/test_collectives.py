"""The real collective over gloo equals the single-process simulation, and meters its bytes."""

from __future__ import annotations

import pytest
import torch

from nfabric_cli.routes import Comm, RouteSpec, make_route
from tests.distutil import run_ranks

SPECS = [
    RouteSpec("fp32"),
    RouteSpec("bf16"),
    RouteSpec("fp16"),
    RouteSpec("int8"),
    RouteSpec("int8", reducer="central"),
    RouteSpec("int8", rounding="stochastic", chunk=100),
    RouteSpec("int4"),
    RouteSpec("int4", reducer="central", chunk=64),
    RouteSpec("ternary"),
    RouteSpec("ternary", reducer="central", tau=0.2),
    RouteSpec("sign"),
    RouteSpec("sign", reducer="central"),
    RouteSpec("sign", mode="count", chunk=128),
]
SEGMENTS = (7, 1000, 1, 2993)  # odd lengths, several parameters in one flat buffer
N = sum(SEGMENTS)


def rank_grads(world_size: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1234 + world_size)
    return [torch.randn(N, generator=gen) * (1 + r) for r in range(world_size)]


def rank_gens(world_size: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(99 + r) for r in range(world_size)]


def _worker(rank: int, world_size: int) -> dict:
    grads = rank_grads(world_size)
    out = {}
    for spec in SPECS:
        comm = Comm()
        result = make_route(spec).reduce(
            grads[rank].clone(), comm, SEGMENTS, generator=rank_gens(world_size)[rank]
        )
        out[spec] = (result, comm.take())
    # one Comm for every route, forward then back: its kept buffers are reused at other sizes
    # (the front of a larger one, stale bytes and all) and must not change a single result
    shared = Comm()
    for spec in [*SPECS, *reversed(SPECS)]:
        result = make_route(spec).reduce(
            grads[rank].clone(), shared, SEGMENTS, generator=rank_gens(world_size)[rank]
        )
        out.setdefault((spec, "shared"), []).append(result)
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_collective_equals_simulation(world_size: int) -> None:
    results = run_ranks(_worker, world_size)
    grads = rank_grads(world_size)
    for spec in SPECS:
        route = make_route(spec)
        sim = route.simulate(grads, SEGMENTS, generators=rank_gens(world_size))
        for rank, per_rank in enumerate(results):
            got, metered = per_rank[spec]
            if spec.name in ("bf16", "fp16"):
                # 16-bit sums round by the backend's reduction order: within a 16-bit ulp.
                tol = 2 * torch.finfo(getattr(torch, "bfloat16" if spec.name == "bf16" else "float16")).eps
                assert torch.allclose(got, sim, rtol=tol, atol=tol * sim.abs().max()), spec
            elif spec.name == "fp32" and world_size > 2:
                # float sums in ring order may differ from rank order by an ulp
                assert torch.allclose(got, sim, rtol=1e-6, atol=1e-6), spec
            else:
                assert torch.equal(got, sim), (spec, rank)
            assert all(torch.equal(again, got) for again in per_rank[spec, "shared"]), spec
            # the meter counts exactly what the plan predicts for this rank
            assert metered == route.wire_bytes(N, world_size, rank=rank, segments=SEGMENTS), (spec, rank)


def _scratch(rank: int, world_size: int) -> dict:
    comm = Comm()
    big = comm.scratch("k", 1000, torch.uint8)
    small = comm.scratch("k", 10, torch.uint8)
    same = comm.scratch("k", 1000, torch.uint8)
    bigger = comm.scratch("k", 1001, torch.uint8)
    return {"big": big.data_ptr(), "small": (small.numel(), small.data_ptr()),
            "same": same.data_ptr(), "bigger": (bigger.numel(), bigger.data_ptr()),
            "dtype": comm.scratch("k", 10, torch.float32).dtype,
            "other": comm.scratch("other", 10, torch.uint8).data_ptr()}


def test_scratch_hands_out_the_front_of_a_kept_buffer_until_a_larger_one_is_asked_for() -> None:
    (got,) = run_ranks(_scratch, 1)
    assert got["small"] == (10, got["big"])  # the front of the kept buffer: no new pages
    assert got["same"] == got["big"]
    assert got["bigger"][0] == 1001 and got["bigger"][1] != got["big"]  # grown: a new one
    assert got["dtype"] == torch.float32  # another dtype: a new one
    assert got["other"] not in (got["big"], got["bigger"][1])
