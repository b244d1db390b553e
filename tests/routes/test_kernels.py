"""Native codec kernels: every build gives the same bits as the torch path, and the build cache.

The routes pick the native kernels when they load (`kernels.native()`); NFABRIC_NO_NATIVE=1
forces the torch path. Each comparison below runs a route both ways on the same input and
requires identical payload bytes, identical scales and identical decoded / aggregated floats
(bit for bit; NaN positions must match, NaN payload bits are not compared).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

from nfabric_cli.routes import RouteSpec, kernels, make_route
from nfabric_cli.routes.base import ZeroVote, codec_noise
from nfabric_cli.routes.chunks import chunk_layout
from nfabric_cli.routes.packing import unpack_bool
from nfabric_cli.routes.tally import Tally

HAVE_CC = shutil.which("cc") is not None or shutil.which("gcc") is not None
pytestmark = pytest.mark.skipif(not HAVE_CC, reason="no C compiler: only the torch path exists")

ISAS = ["baseline", "avx2", "portable"]  # portable: the plain-C path of other CPUs
SPECS = [
    RouteSpec("int8"),
    RouteSpec("int8", chunk=7),
    RouteSpec("int8", rounding="stochastic", chunk=100),
    RouteSpec("int4"),
    RouteSpec("int4", chunk=33, rounding="stochastic"),
    RouteSpec("ternary"),
    RouteSpec("ternary", tau=0.0, chunk=9),
    RouteSpec("ternary", tau=0.3, chunk=1),
    RouteSpec("sign"),
    RouteSpec("sign", chunk=12),
    RouteSpec("sign", mode="count", chunk=128),
    RouteSpec("sign", chunk=1),
]
SEGMENTS = [(20_011,), (7, 1000, 1, 2993, 16_384, 5)]


def _variant(isa: str) -> kernels.Kernels:
    k = kernels.variant(isa)
    if k is None and isa == "avx2":
        base = kernels.variant("baseline")
        if base is not None and not base.lib.nf_cpu_has_avx2():
            pytest.skip("this CPU has no AVX2")
    assert k is not None, kernels.status()
    return k


def _both(isa: str, fn: Callable[[], object], monkeypatch: pytest.MonkeyPatch) -> tuple:
    """fn() on the torch path, then on the native build `isa`; the global RNG (stochastic
    rounding without a generator) is reseeded before each."""
    _variant(isa)
    monkeypatch.setenv(kernels.DISABLE_ENV, "1")
    torch.manual_seed(1234)
    ref = fn()
    monkeypatch.setenv(kernels.DISABLE_ENV, "0")
    monkeypatch.setenv(kernels.ISA_ENV, isa)
    assert kernels.status() == f"native ({_variant(isa).isa})"
    torch.manual_seed(1234)
    return ref, fn()


def assert_same(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    if not a.is_floating_point():
        assert torch.equal(a, b), what
        return
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(b)), what
    bits_a, bits_b = a.view(torch.int32)[~nan], b.view(torch.int32)[~nan]
    bad = (bits_a != bits_b).nonzero()
    assert bad.numel() == 0, (what, bad[:5].flatten().tolist(), a[~nan][bad[:5]], b[~nan][bad[:5]])


def _grads(n: int, world: int, seed: int, special: bool = False) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for r in range(world):
        g = torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 3 * (r + 1)
        g[r::97] = 0.0  # exact zeros: sign's vote (spec.zeros), never kept by ternary
        g[1::89] = -0.0
        g[: min(n, 40)] = 0.0  # an all-zero chunk: zero scale
        if special and n > 5000:
            g[4100] = float("inf")  # inf and NaN chunks: both paths must treat them alike
            g[4500] = -float("inf")
            g[5000] = float("nan")
        out.append(g)
    return out


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.name}-{s.chunk}-{s.rounding}-{s.mode}-{s.tau}")
def test_native_matches_torch_bit_for_bit(
    isa: str, spec: RouteSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    route = make_route(spec)
    for segs in SEGMENTS:
        n = sum(segs)
        x = _grads(n, 1, seed=n)[0]
        p_ref, p_nat = _both(isa, lambda x=x, segs=segs: route.encode(x, segs), monkeypatch)
        assert_same(p_ref.codes, p_nat.codes, "codes")
        assert_same(p_ref.scales, p_nat.scales, "scales")
        if spec.name == "sign":  # exact zeros (+0, -0) voted up, as half the ranks do
            up_ref, up_nat = _both(isa, lambda x=x, segs=segs: route.encode(x, segs, ZeroVote(True)),
                                   monkeypatch)
            assert_same(up_ref.codes, up_nat.codes, "codes, zeros up")
            ones = [int(unpack_bool(p.codes, n).sum()) for p in (p_ref, up_ref)]
            assert ones[1] - ones[0] == int((x == 0).sum()) > 0  # the zeros, -0 too, and no more
        d_ref, d_nat = _both(isa, lambda p=p_ref: route.decode(p), monkeypatch)
        assert_same(d_ref, d_nat, "decode")
        for world in (1, 2, 3, 5):
            grads = _grads(n, world, seed=world)

            def sim(grads=grads, world=world, segs=segs) -> tuple[torch.Tensor, dict]:
                stats: dict[str, float] = {}
                gens = [torch.Generator().manual_seed(50 + r) for r in range(world)]
                return route.simulate(grads, segs, stats, gens), stats

            (s_ref, st_ref), (s_nat, st_nat) = _both(isa, sim, monkeypatch)
            assert_same(s_ref, s_nat, f"simulate W={world}")
            assert st_ref == st_nat
            if spec.name == "sign":  # each rank's zero vote as the hook casts it at step 3
                votes = [codec_noise(spec, 0, 3, r, ["g"], [n]) for r in range(world)]
                (z_ref, _), (z_nat, _) = _both(
                    isa, lambda grads=grads, segs=segs, votes=votes:
                    (route.simulate(grads, segs, {}, votes), None), monkeypatch)
                assert_same(z_ref, z_nat, f"simulate W={world}, zeros split")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", ["sign", "int8", "int4"])
def test_encode_writes_its_codes_into_out(isa: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Given `out` (the exchange's wire buffer), the native encode writes the same codes
    there, in place, and leaves the bytes after them alone."""
    monkeypatch.setenv(kernels.ISA_ENV, isa)
    _variant(isa)
    route, segs = make_route(RouteSpec(name)), SEGMENTS[1]
    x = _grads(sum(segs), 1, seed=7)[0]
    for up in (ZeroVote(False), ZeroVote(True)):
        ref = route.encode(x, segs, up)
        out = torch.full((ref.codes.numel() + 5,), 0xAB, dtype=torch.uint8)
        got = route.encode(x, segs, up, out)
        assert got.codes.data_ptr() == out.data_ptr()
        assert_same(got.codes, ref.codes, "codes")
        assert_same(got.scales, ref.scales, "scales")
        assert out[ref.codes.numel():].eq(0xAB).all()
    # a destination the codes could not be written into in place is refused, not copied
    for bad in (torch.zeros(2 * out.numel(), dtype=torch.uint8)[::2], out.view(torch.int8)):
        with pytest.raises(ValueError, match="need contiguous torch.uint8"):
            route.encode(x, segs, ZeroVote(False), bad)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("name", ["int8", "int4", "ternary", "sign"])
def test_inf_and_nan_handled_alike(isa: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    segs = (6000, 3)
    grads = _grads(6003, 2, seed=11, special=True)
    route = make_route(RouteSpec(name, chunk=256))
    p_ref, p_nat = _both(isa, lambda: route.encode(grads[0], segs), monkeypatch)
    assert_same(p_ref.codes, p_nat.codes, "codes")
    assert_same(p_ref.scales, p_nat.scales, "scales")
    assert_same(*_both(isa, lambda: route.decode(p_ref), monkeypatch), "decode")
    assert_same(*_both(isa, lambda: route.simulate(grads, segs), monkeypatch), "simulate")


@pytest.mark.parametrize("isa", ISAS)
def test_int_codes_at_every_rounding_edge(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Values at k + 1/2 steps (ties to even), at +-absmax and just inside it, in one chunk.
    steps = torch.arange(-127, 128, dtype=torch.float32)
    x = (torch.cat([steps, steps + 0.5, steps - 0.5, steps * 0.999]) / 127).clamp(-1.0, 1.0)
    for name in ("int8", "int4"):
        route = make_route(RouteSpec(name, chunk=1 << 20))
        p_ref, p_nat = _both(isa, lambda r=route: r.encode(x), monkeypatch)
        assert_same(p_ref.codes, p_nat.codes, name)
    # absmax 1 -> inv = (1 / 1) * 127 exactly: codes are x * 127 rounded half to even
    codes = make_route(RouteSpec("int8", chunk=1 << 20)).encode(x).codes.view(torch.int8)
    scaled = x * 127
    ties = scaled == scaled.floor() + 0.5
    assert ties.sum() > 50  # the data really holds ties
    assert torch.equal(codes.long(), scaled.round().clamp(-127, 127).long())
    assert torch.equal(codes[:255].long(), torch.arange(-127, 128))


@pytest.mark.parametrize("isa", ISAS)
def test_codes_under_an_agreed_scale_and_large_decodes_match_torch(
    isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Codes against another rank's (agreed) scale, here half this rank's absmax, so codes clamp
    # on both sides, beside NaN and infinities: the native quantise takes a checked fast path
    # that must fall back on exactly these. Past 2^18 elements codes and decoded floats go out
    # with non-temporal stores where aligned: codes at an offset that aligns the second
    # segment's chunks (27 + 5 bytes), decoded floats one element off (an unaligned head).
    n = (1 << 18) + 4099
    segs = (5, n - 5)
    x = _grads(n, 1, seed=3, special=True)[0]
    x[200_000:200_040] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30] * 8)
    for name in ("int8", "int4"):
        route = make_route(RouteSpec(name, chunk=2048))
        layout = chunk_layout(segs, 2048)
        agreed = route.local_scales(x.nan_to_num(posinf=1.0, neginf=1.0), layout) * 0.5

        def codes(route=route, layout=layout, agreed=agreed) -> torch.Tensor:
            out = torch.zeros(n + 27, dtype=torch.int8)[27:]
            return route._codes(x, layout, agreed, None, out)

        ref, nat = _both(isa, codes, monkeypatch)
        assert_same(ref, nat, name)
        assert set(ref[x.isnan()].tolist()) == {0} and ref.abs().max() == route.qmax
    shards = [torch.randint(-127, 128, (n,), dtype=torch.int8).view(torch.uint8) for _ in range(2)]
    layout = chunk_layout(segs, 2048)
    scales = torch.rand(2, layout.nchunks)  # W = 2 gathers codes: each rank's own scales
    for name, nbytes in (("int8", n), ("int4", (n + 1) // 2)):
        route = make_route(name)

        def decoded(route=route, nbytes=nbytes) -> torch.Tensor:
            out = torch.full((n + 1,), float("nan"))[1:]
            return route.combine_decode([s[:nbytes] for s in shards], 2, scales, layout, out, None)

        assert_same(*_both(isa, decoded, monkeypatch), f"{name} combine_decode, local scales")
    # a sharded reduce's packed result (W = 4: 16-bit codes), decoded as every rank does
    route, layout = make_route("int8"), chunk_layout((n,), 2048)
    packed = route.combine_packed([*shards, *shards], 4, n, None)

    def unpacked() -> torch.Tensor:
        out = torch.full((n + 1,), float("nan"))[1:]
        return route._decode_result(packed, n, 4, scales[0], layout, out=out)

    assert_same(*_both(isa, unpacked, monkeypatch), "decode_codes")


@pytest.mark.parametrize("isa", ISAS)
def test_ternary_tiles_and_threads_match_torch(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A block larger than one tile of kept |x| (kernels.TILE_ELEMS), on 1 and on 2 threads.
    n = kernels.TILE_ELEMS + 3 * 4096 + 77
    x = _grads(n, 1, seed=5)[0]
    route = make_route("ternary")
    prev = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            p_ref, p_nat = _both(isa, lambda: route.encode(x), monkeypatch)
            assert_same(p_ref.scales, p_nat.scales, f"scales, {threads} threads")
            assert_same(p_ref.codes, p_nat.codes, f"codes, {threads} threads")
    finally:
        torch.set_num_threads(prev)


@pytest.mark.parametrize("isa", ISAS)
def test_sum_codes_exact(isa: str) -> None:
    k = _variant(isa)
    gen = torch.Generator().manual_seed(1)
    for world in (1, 2, 7, 127):
        shards = [torch.randint(0, 243, (1031,), generator=gen, dtype=torch.uint8) for _ in range(world)]
        pow3 = 3 ** torch.arange(5)
        digits = torch.stack([((s.long().unsqueeze(1) // pow3) % 3).reshape(-1) for s in shards])
        assert torch.equal(k.sum_codes(shards, "trit", offset=-world), digits.sum(0) - world)
        bits = torch.stack([(s.long().unsqueeze(1) >> torch.arange(8)) & 1 for s in shards]).reshape(world, -1)
        assert torch.equal(k.sum_codes(shards, "bit"), bits.sum(0))
        assert torch.equal(k.sum_codes(shards, "int8"), torch.stack([s.view(torch.int8).long() for s in shards]).sum(0))
        nib = torch.stack([torch.stack([s.long() & 15, s.long() >> 4], 1).reshape(-1) for s in shards])
        assert torch.equal(k.sum_codes(shards, "nibble", offset=-8 * world), nib.sum(0) - 8 * world)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("spec", [RouteSpec("sign"), RouteSpec("sign", mode="count"),
                                  RouteSpec("int8"), RouteSpec("int4"), RouteSpec("ternary")],
                         ids=lambda s: f"{s.name}-{s.mode}")
def test_combine_packed_matches_torch(isa: str, spec: RouteSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused combine-and-pack (one pass over the shards, no int64 values) gives the bytes
    `combine` + `_pack_result` give, and the same agreement sums over the valid elements, at
    odd and even world sizes (sign: 1- and 2-bit majority results, counts up to 8 bits)."""
    route = make_route(spec)
    valid = 16_000 - 123  # the agreement counts real elements only, not padding
    for world in (1, 2, 3, 4, 7, 16):
        payloads = [route.encode(g).codes for g in _grads(16_000, world, world)]
        padded, _ = route._sizes(16_000, world)
        shards = [route._pad(c, padded) for c in payloads]

        def combined(shards: list = shards, world: int = world) -> tuple:
            stats: dict[str, float] = {}
            return route.combine_packed(shards, world, valid, stats), stats

        (ref, ref_stats), (nat, nat_stats) = _both(isa, combined, monkeypatch)
        assert_same(ref, nat, f"W={world}")
        assert ref_stats == nat_stats, world
        assert ("agree_n" in nat_stats) == (spec.name == "sign")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("spec", [RouteSpec("sign"), RouteSpec("sign", chunk=1),
                                  RouteSpec("sign", chunk=12),
                                  RouteSpec("sign", mode="count", chunk=100),
                                  RouteSpec("int8", chunk=300), RouteSpec("int4"),
                                  RouteSpec("ternary", chunk=777)],
                         ids=lambda s: f"{s.name}-{s.mode}-{s.chunk}")
def test_combine_decode_is_combine_then_decode(isa: str, spec: RouteSpec,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Gathered codes combined and decoded in one pass give the floats that the packed
    combine and its decode give (the torch path), and the same agreement, whatever the
    segments (chunks ending mid-tile, odd tails) and chunk scales (zero, inf, NaN). Two ranks'
    sign votes take a pass of their own in the kernel (count and table lookup in one step)."""
    route = make_route(spec)
    segments = (5, 9000, 1, 7001, 2)
    n = sum(segments)
    layout = chunk_layout(segments, route.spec.effective_chunk)
    for world in (2, 3, 4):
        grads = _grads(n, world, world, special=True)
        payloads = [route.encode(g, segments) for g in grads]
        codes = [route._pad(p.codes, route._sizes(n, 1)[0]) for p in payloads]
        scales = sum(p.scales for p in payloads) / world
        if route.agreement(world) == "local":  # int8 / int4 at W = 2: each rank's own scales
            scales = torch.stack([p.scales for p in payloads])

        def decoded(codes: list = codes, world: int = world, scales: torch.Tensor = scales) -> tuple:
            stats: dict[str, float] = {}
            out = torch.full((n,), float("nan"))
            got = route.combine_decode(codes, world, scales, layout, out, stats)
            return got, stats

        (ref, ref_stats), (nat, nat_stats) = _both(isa, decoded, monkeypatch)
        assert_same(ref, nat, f"W={world}")
        assert ref_stats == nat_stats, world
        assert ("agree_n" in nat_stats) == (spec.name == "sign")


def test_disable_env_forces_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.DISABLE_ENV, "1")
    assert kernels.native() is None
    assert kernels.status() == "torch fallback: NFABRIC_NO_NATIVE=1"
    monkeypatch.setenv(kernels.DISABLE_ENV, "0")
    assert kernels.native() is not None


def test_torch_behaviours_the_kernels_mirror_hold() -> None:
    # vector_norm(ord=1) sums left to right in float32; NaN casts to int8 0; `127 / t` is
    # reciprocal-then-multiply.
    assert kernels._check_torch_agrees(_variant("baseline")) is None


def test_build_is_cached_by_hash_and_atomic(tmp_path) -> None:
    first = kernels.build("baseline", directory=tmp_path)
    stamp = first.stat().st_mtime_ns
    assert kernels.build("baseline", directory=tmp_path) == first  # same hash: not rebuilt
    assert first.name.startswith("routes_kernels-baseline-") and first.suffix == ".so"
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temp files left behind
    # A fresh process pointed at the cache loads that library instead of compiling again.
    env = dict(os.environ, NFABRIC_CACHE_DIR=str(tmp_path), NFABRIC_NATIVE_ISA="baseline")
    env.pop(kernels.DISABLE_ENV, None)
    code = "from nfabric_cli.routes import kernels; print(kernels.status())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("native (")
    assert [p.name for p in tmp_path.iterdir()] == [first.name]
    assert first.stat().st_mtime_ns == stamp


def test_no_compiler_falls_back_to_torch(tmp_path) -> None:
    env = dict(os.environ, NFABRIC_CACHE_DIR=str(tmp_path), CC="/nonexistent/cc")
    env.pop(kernels.DISABLE_ENV, None)
    code = (
        "import torch; from nfabric_cli.routes import kernels, make_route;"
        "print(kernels.status()); print(make_route('sign').encode(torch.ones(9)).codes.tolist())"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    status, codes = out.stdout.strip().splitlines()
    assert status.startswith("torch fallback: native baseline build failed")
    assert codes == "[255, 1]"


def test_layout_mismatch_is_refused() -> None:
    k = _variant("baseline")
    with pytest.raises(ValueError, match="elements for a layout"):
        k.abs_max(torch.ones(10), chunk_layout((11,), 4))
    with pytest.raises(ValueError, match="contiguous float32"):
        k.sign_bits(torch.ones(10, dtype=torch.float64))
    with pytest.raises(ValueError, match="sign payload"):
        k.sign_decode(torch.zeros(1, dtype=torch.uint8), chunk_layout((9,), 4), torch.ones(3))


@pytest.mark.parametrize("isa", ISAS)
def test_vote_margins_per_element_range(isa: str) -> None:
    """The kernels that sum the sign vote's margins (the bit-sliced majority, the packed
    combine, the fused combine-decode, with its own pass for two ranks' votes) sum them per
    element range: each range's sum is the
    per-element |2c - W| of the torch vote summed over that range, for ranges that start and
    end inside 64-element words and tiles, empty ones, and elements past the last range
    (padding) left out."""
    k = _variant(isa)
    route = make_route(RouteSpec("sign"))
    n = 20_011
    ends = [0, 7, 64, 65, 130, 4096, 9000, 9000, 17_000, n - 3]
    for world in (2, 3, 5):
        codes = [route.encode(g).codes for g in _grads(n, world, seed=world)]
        nbytes = (len(codes[0]) + 7) // 8 * 8
        shards = [torch.cat([c, torch.zeros(nbytes - len(c), dtype=torch.uint8)]) for c in codes]
        count = sum(torch.tensor([(int(b) >> i) & 1 for b in s.tolist() for i in range(8)])
                    for s in shards)
        per = (2 * count - world).abs()
        want = [int(per[a:b].sum()) for a, b in zip([0, *ends], ends, strict=False)]

        def tally() -> Tally:
            return Tally(tuple(ends), tuple({} for _ in ends))

        def sums(t: Tally, world: int = world) -> list[int]:
            for d, a, b in zip(t.into, [0, *ends], ends, strict=False):
                assert d["agree_n"] == (b - a) * world
            return [int(d["agree_sum"]) for d in t.into]

        k.sign_majority(shards, t := tally())
        assert sums(t) == want, world
        kind, bits, _, table = route._result_codes(world)
        k.combine_pack(shards, kind, bits, table=table, tally=(t := tally()))
        assert sums(t) == want, world
        layout = chunk_layout((8 * nbytes,), route.spec.effective_chunk)
        scales = torch.ones(layout.nchunks)
        s, mode, d = route.decode_mode(scales, world)
        _, value = route.native_combine(world)
        k.combine_decode(shards, "bit", layout, s, mode, d, torch.empty(8 * nbytes),
                         values=value, tally=(t := tally()))
        assert sums(t) == want, world
        with pytest.raises(ValueError, match="past"):
            k.sign_majority(shards, Tally((8 * nbytes + 1,), ({},)))
