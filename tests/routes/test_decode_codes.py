"""The reduce path's result decode: native `decode_codes` straight from the packed combined result
equals the torch path (unpack to int64, add the offset, `decode_values`) bit for bit, in every
build, for every code route and result width (1, 2, 4, 8, 16 and 32 bits)."""

from __future__ import annotations

import pytest
import torch

from nfabric_cli.routes import RouteSpec, make_route
from nfabric_cli.routes.chunks import chunk_layout
from nfabric_cli.routes.packing import pack_uint
from tests.routes.test_kernels import HAVE_CC, ISAS, _both, _variant, assert_same

pytestmark = pytest.mark.skipif(not HAVE_CC, reason="no C compiler: only the torch path exists")

SPECS = [
    RouteSpec("sign"),  # majority: 1 bit for odd W, 2 bits for even W
    RouteSpec("sign", chunk=7),
    RouteSpec("sign", mode="count", chunk=100),
    RouteSpec("ternary", chunk=9),
    RouteSpec("int8", chunk=1),
    RouteSpec("int8"),
    RouteSpec("int4", chunk=33),
]
SEGMENTS = [(1,), (13,), (7, 1000, 1, 2993, 5), (64 * 9 + 3,)]


def _scales(nchunks: int, seed: int) -> torch.Tensor:
    """Agreed scales with the awkward cases in them: zeros of both signs, inf, NaN, negative."""
    s = torch.rand(nchunks, generator=torch.Generator().manual_seed(seed)) * 3
    specials = [0.0, -0.0, float("inf"), float("nan"), -1.5, 1e-40]
    s[1::7][: len(specials)] = torch.tensor(specials)[: s[1::7].numel()]
    return s


def _packed(route, world: int, numel: int, seed: int) -> torch.Tensor:  # noqa: ANN001
    """A packed combined result of random valid values, padded as `reduce` pads it."""
    lo, hi = route.result_range(world)
    padded = route._sizes(numel, world)[0] * route.elems_per_byte
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(lo, hi + 1, (padded,), generator=gen)
    if route.result_bits(world) == 1:  # odd-W majority: +-1 only
        values = torch.where(values > 0, 1, -1)
    return route._pack_result(values, world)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.name}-{s.mode}-{s.chunk}")
def test_decode_codes_matches_torch_bit_for_bit(
    isa: str, spec: RouteSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    route = make_route(spec)
    widths = set()
    for world in range(1, 9):
        widths.add(route.result_bits(world))
        for segs in SEGMENTS:
            n = sum(segs)
            layout = chunk_layout(segs, spec.effective_chunk)
            packed, scales = _packed(route, world, n, seed=n + world), _scales(layout.nchunks, world)
            ref, nat = _both(
                isa, lambda p=packed, s=scales, w=world, la=layout, n=n: route._decode_result(p, n, w, s, la),
                monkeypatch,
            )
            assert_same(ref, nat, f"W={world} segments={segs}")
    expected = {"sign": {1, 2}, "ternary": {2, 4, 8}, "int8": {8, 16}, "int4": {4, 8}}[spec.name]
    if spec.mode == "count":
        expected = {1, 2, 4}
    assert widths == expected


@pytest.mark.parametrize("isa", ISAS)
def test_wide_results_and_unaligned_buffers(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # int8 over 300 ranks: 76,201 levels travel in 32 bits.
    route = make_route(RouteSpec("int8", chunk=64))
    segs = (1000, 3)
    layout = chunk_layout(segs, 64)
    scales = _scales(layout.nchunks, 3)
    packed = _packed(route, 300, 1003, seed=3)
    assert route.result_bits(300) == 32
    ref, nat = _both(isa, lambda: route._decode_result(packed, 1003, 300, scales, layout), monkeypatch)
    assert_same(ref, nat, "W=300")
    # A packed result at an odd address (16-bit codes are read as aligned words: copied first).
    packed4 = _packed(route, 4, 1003, seed=4)
    shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), packed4])[1:]
    assert shifted.data_ptr() % 2 == 1
    ref, nat = _both(isa, lambda: route._decode_result(shifted, 1003, 4, scales, layout), monkeypatch)
    assert_same(ref, nat, "unaligned")
    assert_same(nat, route._decode_result(packed4, 1003, 4, scales, layout), "aligned")


@pytest.mark.parametrize("isa", ISAS)
def test_decode_codes_equals_decode_values_of_int64(isa: str) -> None:
    # Any mul and lo, every mode and width, including offsets too large for int32 lanes.
    k = _variant(isa)
    layout = chunk_layout((5, 300, 2), 64)
    scales = _scales(layout.nchunks, 9)
    gen = torch.Generator().manual_seed(9)
    for bits in (1, 2, 4, 8, 16, 32):
        codes = torch.randint(0, 2**bits, (layout.numel,), generator=gen, dtype=torch.int64)
        packed = pack_uint(codes, bits)
        for mul, lo in ((1, 0), (2, -1), (-3, 7), (1, -(1 << 40)), (1 << 20, 5)):
            for mode, d in ((0, 1.0), (1, 127.0 * 3), (2, 5.0)):
                want = k.decode_values(codes * mul + lo, layout, scales, mode, d)
                got = k.decode_codes(packed, bits, layout, scales, mode, d, mul, lo)
                assert_same(want, got, f"bits={bits} mul={mul} lo={lo} mode={mode}")


def test_decode_codes_refuses_bad_input() -> None:
    k = _variant("baseline")
    layout = chunk_layout((16,), 8)
    with pytest.raises(ValueError, match="code width 3"):
        k.decode_codes(torch.zeros(6, dtype=torch.uint8), 3, layout, torch.ones(2), 0)
    with pytest.raises(ValueError, match="packed result"):
        k.decode_codes(torch.zeros(3, dtype=torch.uint8), 2, layout, torch.ones(2), 0)
    with pytest.raises(ValueError, match="must be uint8"):
        k.decode_codes(torch.zeros(4, dtype=torch.int32), 2, layout, torch.ones(2), 0)
