"""Route exactness, error bounds, packing and byte accounting (single process)."""

from __future__ import annotations

import itertools

import pytest
import torch

from nfabric_cli.errors import InputError
from nfabric_cli.routes import ROUTE_NAMES, RouteSpec, make_route
from nfabric_cli.routes.chunks import chunk_layout
from nfabric_cli.routes.packing import (
    pack_bool,
    pack_trits,
    pack_uint,
    unpack_bool,
    unpack_trits,
    unpack_uint,
)


@pytest.mark.parametrize("name", ROUTE_NAMES)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_constant_tensors_aggregate_exactly(name: str, world_size: int) -> None:
    # Every rank sends the same constant: every route must return it exactly.
    grads = [torch.full((1001,), -0.375) for _ in range(world_size)]
    out = make_route(name).simulate(grads, segments=(1, 1000))
    assert torch.equal(out, grads[0])


@pytest.mark.parametrize("world_size", range(1, 9))
def test_sign_majority_exact_with_ties(world_size: int) -> None:
    # Enumerate every vote pattern over the ranks (one element per pattern).
    patterns = list(itertools.product([-1.0, 1.0], repeat=world_size))
    grads = [torch.tensor([p[r] for p in patterns]) for r in range(world_size)]
    out = make_route(RouteSpec("sign", chunk=1 << 20)).simulate(grads)
    scale = 1.0  # every |g| is 1, so the agreed mean |g| is exactly 1
    for i, p in enumerate(patterns):
        positives = sum(1 for v in p if v > 0)
        expected = 1.0 if 2 * positives > world_size else (-1.0 if 2 * positives < world_size else 0.0)
        assert out[i].item() == expected * scale, (p, out[i].item())


@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_sign_count_mode_is_scaled_vote_mean(world_size: int) -> None:
    patterns = list(itertools.product([-1.0, 1.0], repeat=world_size))
    grads = [torch.tensor([p[r] for p in patterns]) for r in range(world_size)]
    out = make_route(RouteSpec("sign", mode="count", chunk=1 << 20)).simulate(grads)
    expected = torch.tensor([sum(p) / world_size for p in patterns])
    assert torch.equal(out, expected)


def test_sign_exact_zero_vote() -> None:
    """Zeros split (step 0 with no noise given: even ranks up): a tie at W = 2, up at W = 3
    (ranks 0 and 2); down on every rank under the old rule (tests/routes/test_sign_zeros.py)."""
    g = [torch.tensor([0.0, 2.0])] * 3  # scale = mean |g| over the chunk = 1
    assert make_route("sign").simulate(g[:2]).tolist() == [0.0, 1.0]
    assert make_route("sign").simulate(g).tolist() == [1.0, 1.0]
    assert make_route(RouteSpec("sign", zeros="negative")).simulate(g).tolist() == [-1.0, 1.0]


@pytest.mark.parametrize("name,qmax", [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("world_size", [1, 2, 4, 7])
def test_int_error_bound_on_ramps(name: str, qmax: int, world_size: int) -> None:
    # Ramps of different slopes per rank. Nearest rounding: each code is off by <= 1/2 step,
    # so the mean is off by <= step/2, step = shared absmax / qmax (per chunk).
    n, chunk = 4099, 256
    grads = [torch.linspace(-1.0, 1.0, n) * (r + 1) + 0.01 * r for r in range(world_size)]
    out = make_route(RouteSpec(name, chunk=chunk)).simulate(grads)
    true = torch.stack(grads).mean(0)
    absmax = torch.stack([g.abs() for g in grads]).amax(0)
    # per-chunk shared absmax, expanded
    bound = torch.cat(
        [absmax[i : i + chunk].max().expand(min(chunk, n - i)) for i in range(0, n, chunk)]
    ) / qmax / 2
    assert ((out - true).abs() <= bound * (1 + 1e-5) + 1e-7).all()


@pytest.mark.parametrize("name,qmax", [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_int_at_two_ranks_is_the_mean_of_each_ranks_own_roundtrip(
    name: str, qmax: int, rounding: str
) -> None:
    # W = 2 gathers codes with each rank's own chunk scales: the result is exactly the mean
    # of what each rank's roundtrip gives (what error feedback subtracts), and a rank whose
    # gradient is 1000x smaller keeps its own quantisation step (a MAX-agreed scale would
    # give it the larger rank's).
    spec = RouteSpec(name, chunk=256, rounding=rounding)
    route, segs = make_route(spec), (3, 4000, 997)
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(5000, generator=gen), torch.randn(5000, generator=gen) * 1e-3]
    noise = [torch.rand(5000, generator=gen) if rounding == "stochastic" else None for _ in xs]
    out = route.simulate(xs, segs, generators=noise)
    own = [route.roundtrip(x, segs, n) for x, n in zip(xs, noise, strict=True)]
    assert torch.equal(out, (own[0] + own[1]) / 2)
    step = [route.local_scales(x, chunk_layout(segs, 256)) / qmax for x in xs]  # its own step
    err = (own[1] - xs[1]).abs().max()
    assert err <= step[1].max() * (1.0 if rounding == "stochastic" else 0.5) * (1 + 1e-5)


def test_int8_stochastic_rounding_is_unbiased() -> None:
    x = torch.full((200_000,), 0.3)
    x[0] = 1.0  # absmax 1 -> step 1/127; 0.3*127 = 38.1 is between codes 38 and 39
    gen = torch.Generator().manual_seed(0)
    out = make_route(RouteSpec("int8", rounding="stochastic", chunk=1 << 20)).simulate([x], generators=[gen])
    assert set(torch.unique(out[1:] * 127).round().tolist()) == {38.0, 39.0}
    assert abs(out[1:].mean().item() - 0.3) < 2e-4
    nearest = make_route(RouteSpec("int8", chunk=1 << 20)).simulate([x])
    assert torch.unique(nearest[1:] * 127).round().tolist() == [38.0]


def test_ternary_gate() -> None:
    # absmax 1.0, tau 0.5: |g| < 0.5 -> 0; kept: 0.5, -0.8, 1.0 -> scale = mean(0.5, 0.8, 1.0)
    x = torch.tensor([0.1, -0.49, 0.5, -0.8, 1.0, 0.0])
    route = make_route(RouteSpec("ternary", tau=0.5))
    out = route.simulate([x])
    s = (0.5 + 0.8 + 1.0) / 3
    assert torch.allclose(out, torch.tensor([0.0, 0.0, s, -s, s, 0.0]))
    # tau 0: every non-zero element votes
    out0 = make_route(RouteSpec("ternary", tau=0.0)).simulate([x])
    assert (out0 != 0).tolist() == [True, True, True, True, True, False]
    # votes: two ranks disagreeing cancel, agreeing add
    a, b = torch.tensor([1.0, 1.0]), torch.tensor([1.0, -1.0])
    assert make_route("ternary").simulate([a, b]).tolist() == [1.0, 0.0]


@pytest.mark.parametrize("n", [1, 7, 9, 1_000_003])
def test_packing_round_trips_odd_lengths(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    bits = torch.randint(0, 2, (n,), generator=gen, dtype=torch.uint8)
    packed = pack_bool(bits.bool())
    assert packed.numel() == (n + 7) // 8
    assert torch.equal(unpack_bool(packed, n), bits)
    trits = torch.randint(0, 3, (n,), generator=gen, dtype=torch.uint8)
    packed3 = pack_trits(trits)
    assert packed3.numel() == (n + 4) // 5  # 1.6 bits per element
    assert torch.equal(unpack_trits(packed3, n), trits)
    for width in (2, 4):
        v = torch.randint(0, 2**width, (n,), generator=gen, dtype=torch.uint8)
        p = pack_uint(v, width)
        assert p.numel() == (n * width + 7) // 8
        assert torch.equal(unpack_uint(p, n, width), v)


@pytest.mark.parametrize("name", ROUTE_NAMES)
@pytest.mark.parametrize("n", [1, 7, 9, 1_000_003])
def test_codec_round_trip_odd_lengths(name: str, n: int) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    route = make_route(name)
    payload = route.encode(x)
    back = route.decode(payload)
    assert back.shape == x.shape
    if name in ("sign", "ternary"):
        nonzero = x != 0  # exact zeros vote negative on the sign route (documented)
        assert ((back == 0) | (torch.sign(back) == torch.sign(x)))[nonzero].all()
    else:
        assert torch.allclose(back, x, rtol=0.2 if name == "int4" else 0.01, atol=0.3 if name == "int4" else 0.03)


def test_payload_is_really_packed() -> None:
    n = 10_000
    x = torch.randn(n)
    bytes_per_elem = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "int4": 0.5, "ternary": 0.2, "sign": 0.125}
    for name, b in bytes_per_elem.items():
        p = make_route(name).encode(x)
        assert p.codes.dtype == torch.uint8
        assert p.codes.numel() == int(n * b + 0.999), name


@pytest.mark.parametrize("name", ["int8", "int4", "ternary", "sign"])
def test_aggregation_is_separable_per_parameter(name: str) -> None:
    # Aggregating a concatenation with segments = aggregating each parameter alone: results do
    # not depend on DDP's bucketing.
    gen = torch.Generator().manual_seed(3)
    a = [torch.randn(5000, generator=gen) for _ in range(3)]
    b = [torch.randn(77, generator=gen) * 10 for _ in range(3)]
    route = make_route(name)
    joint = route.simulate([torch.cat([x, y]) for x, y in zip(a, b, strict=False)], segments=(5000, 77))
    assert torch.equal(joint, torch.cat([route.simulate(a), route.simulate(b)]))


def test_sign_wire_bytes_about_two_n_over_eight() -> None:
    n, w = 1 << 20, 3  # odd W: 1-bit result
    wb = make_route("sign").wire_bytes(n, w)
    fp32 = make_route("fp32").wire_bytes(n, w)
    packed = n // 8
    padded = -(-packed // (8 * w)) * 8 * w  # whole 8-byte groups per shard
    # all-to-all (W-1)/W of the packed buffer + all-gather (W-1) shards of padded/W, + scales
    assert wb.sent == (w - 1) * padded // w + (w - 1) * (padded // w) + (w - 1) * 4 * (n // 4096)
    assert wb.total / fp32.total < 0.035
    # central: the endpoint (rank 0) receives W-1 payloads
    central = make_route(RouteSpec("sign", reducer="central"))
    assert central.wire_bytes(n, w, rank=0).received >= (w - 1) * packed
    assert central.wire_bytes(n, w, rank=1).sent >= packed


def test_bad_input_is_named() -> None:
    route = make_route("sign")
    with pytest.raises(InputError, match="floating-point"):
        route.encode(torch.arange(10))
    with pytest.raises(InputError, match="contiguous"):
        route.encode(torch.randn(10, 10).t())
    with pytest.raises(InputError, match="unknown route 'int3'"):
        RouteSpec("int3")
    with pytest.raises(InputError, match=r"a route spec is a table of its fields \(name, ...\), "
                                         r"got \[1, 2\]"):
        RouteSpec.from_dict([1, 2])  # type: ignore[arg-type]
    assert RouteSpec.from_dict({"name": "int8", "chunk": 256}) == RouteSpec("int8", chunk=256)
    with pytest.raises(InputError, match="up to 255 ranks"):
        route.simulate([torch.randn(4)] * 256)
    with pytest.raises(InputError, match="up to 127 ranks"):
        make_route("ternary").wire_bytes(10, 128)
    with pytest.raises(InputError, match="do not add up"):
        route.simulate([torch.randn(4)], segments=(1, 2))
