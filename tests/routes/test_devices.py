"""Routes run where their tensors live (issue 16, part 6): off the CPU the native kernels step
aside and the torch path packs with torch ops. No GPU here: the `meta` device stands in. It
carries shapes, not values, and refuses to mix with CPU tensors just as CUDA does, so a
tensor created on the host by mistake fails these tests."""

from __future__ import annotations

import pytest
import torch

from nfabric_cli.routes import kernels, make_route
from nfabric_cli.routes.base import codec_noise
from nfabric_cli.routes.packing import (
    pack_trits,
    pack_uint,
    torch_pack_trits,
    torch_pack_uint,
    torch_unpack_trits,
    torch_unpack_uint,
    unpack_trits,
    unpack_uint,
)
from nfabric_cli.routes.spec import RouteSpec

SIZES = (1, 7, 8, 9, 63, 1000)


@pytest.mark.parametrize("bits", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("n", SIZES)
def test_torch_packing_gives_numpys_bytes(bits: int, n: int) -> None:
    gen = torch.Generator().manual_seed(bits * 1000 + n)
    values = torch.randint(0, 2**bits if bits < 32 else 2**31, (n,), generator=gen)
    if bits == 32:
        values[0] = 2**32 - 1  # the top bit too
    packed = pack_uint(values, bits)
    assert torch.equal(torch_pack_uint(values, bits), packed)
    back = unpack_uint(packed, n, bits)
    mine = torch_unpack_uint(packed, n, bits)
    assert mine.dtype == back.dtype and torch.equal(mine, back)
    assert torch.equal(mine.to(torch.int64), values)


@pytest.mark.parametrize("n", SIZES)
def test_torch_trit_packing_gives_numpys_bytes(n: int) -> None:
    digits = torch.randint(0, 3, (n,), generator=torch.Generator().manual_seed(n))
    packed = pack_trits(digits)
    assert torch.equal(torch_pack_trits(digits), packed)
    assert torch.equal(torch_unpack_trits(packed, n), unpack_trits(packed, n))
    assert torch.equal(torch_unpack_trits(packed, n).to(torch.int64), digits)


SPECS = [RouteSpec("sign"), RouteSpec("sign", mode="count"), RouteSpec("ternary"),
         RouteSpec("int8"), RouteSpec("int8", rounding="stochastic"), RouteSpec("int4"),
         RouteSpec("int4", rounding="stochastic"), RouteSpec("bf16"), RouteSpec("fp16"),
         RouteSpec("fp32")]


# sign packs its result in 1 bit at an odd world size, in 2 at an even one: both for it
CASES = [(s, 3) for s in SPECS] + [(RouteSpec("sign"), 2), (RouteSpec("sign", mode="count"), 2)]


@pytest.mark.parametrize(("spec", "world"), CASES, ids=lambda v: str(v) if isinstance(v, int)
                         else v.label())
def test_every_route_runs_on_its_tensors_device(spec: RouteSpec, world: int) -> None:
    route = make_route(spec, torch.float32)
    segs = (600, 37, 363)
    xs = [torch.empty(1000, device="meta") for _ in range(world)]
    assert kernels.native(xs[0]) is None
    noise = [codec_noise(spec, 0, 3, r, ["a", "b", "c"], segs) for r in range(world)]
    out = route.simulate(xs, segs, {}, noise)
    assert out.device.type == "meta" and out.shape == (1000,)
    back = route.roundtrip(xs[0], segs, noise[0])
    assert back.device.type == "meta" and back.shape == (1000,)
    payload = route.encode(xs[0], segs, noise[0])
    assert payload.codes.device.type == "meta"
    assert route.decode(payload).shape == (1000,)
