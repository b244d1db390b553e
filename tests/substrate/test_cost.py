"""α-β cost model on hand-computed cases, verdict boundaries and crossovers."""

from __future__ import annotations

import pytest

from nfabric_cli.routes.plan import CommOp
from nfabric_cli.routes.spec import FP32, RouteSpec
from nfabric_cli.substrate.cost import (
    Cost,
    bucket_cost,
    bucket_verdict,
    central_saturation_world_size,
    codec_seconds,
    crossover_bucket_numel,
    endpoint_ingress_bound_world_size,
    first_true,
    op_cost,
    plan_cost,
    predict_fp32,
    predict_route,
    route_plan,
)
from nfabric_cli.substrate.cost import codec_cost as codec_cost_of
from nfabric_cli.substrate.model import Substrate

SIGN = RouteSpec("sign")
SIGN_CENTRAL = RouteSpec("sign", reducer="central")

# Codec GB/s pinned here so verdicts do not move when the measured defaults change.
CODEC = dict(encode_gbps={"sign": 1.0}, reduce_gbps={"sign": 0.5}, decode_gbps={"sign": 0.25})
# 8 Gbit/s = 1e9 bytes/s, 10 us per hop: round numbers for hand arithmetic.
S = Substrate(link_gbps=8.0, latency_us=10.0, **CODEC)
A, B = 1e-5, 1e9


def test_allreduce_ring():
    # 2(W-1)a + 2(W-1)/W n/B with W=4, n=4e6: 6e-5 + 1.5 * 4e-3 = 0.00606
    c = op_cost(CommOp("allreduce", 4_000_000), 4, S)
    assert c.latency_s == pytest.approx(6e-5)
    assert c.wire_s == pytest.approx(6e-3)
    assert c.total_s == pytest.approx(0.00606)
    assert c.collectives == 1


def test_all_to_all_and_all_gather():
    # all_to_all: 3a + 3/4 * 4e6/1e9 = 3e-5 + 3e-3
    assert op_cost(CommOp("all_to_all", 4_000_000), 4, S).total_s == pytest.approx(0.00303)
    # all_gather of a 1e6-byte contribution: 3a + 3 * 1e6/1e9 = 3e-5 + 3e-3
    assert op_cost(CommOp("all_gather", 1_000_000), 4, S).total_s == pytest.approx(0.00303)


def test_gather_saturates_endpoint():
    # W=8, n=1e6, E = B: a + max(1e-3, 7 * 1e-3); the 6e-3 excess is the endpoint's
    c = op_cost(CommOp("gather", 1_000_000), 8, S)
    assert c.latency_s == pytest.approx(1e-5)
    assert c.wire_s == pytest.approx(1e-3)
    assert c.endpoint_s == pytest.approx(6e-3)
    assert c.total_s == pytest.approx(0.00701)
    assert c.fanin_bytes == 1_000_000
    # An 80 Gbit/s endpoint (1e10 B/s) keeps up: max(1e-3, 7e-4) = 1e-3, no excess
    fast = Substrate(link_gbps=8.0, latency_us=10.0, endpoint_gbps=80.0)
    c = op_cost(CommOp("gather", 1_000_000), 8, fast)
    assert c.endpoint_s == 0.0
    assert c.total_s == pytest.approx(0.00101)
    # broadcast from the endpoint: the same W-1 copies through E
    assert op_cost(CommOp("broadcast", 1_000_000), 8, S).total_s == pytest.approx(0.00701)
    assert op_cost(CommOp("broadcast", 1_000_000), 8, S).fanin_bytes == 0


def test_shared_link_counts_every_rank_bytes():
    shared = Substrate(link_gbps=8.0, latency_us=10.0, shared_link=True)
    # ring all-reduce, every rank sends 2(W-1)/W n: total 2(W-1) n = 24e6 bytes over 1e9 B/s
    assert op_cost(CommOp("allreduce", 4_000_000), 4, shared).total_s == pytest.approx(
        6e-5 + 0.024
    )
    # all_gather: W(W-1) n = 12e6 bytes; gather: (W-1) n = 3e6 bytes, no endpoint excess
    assert op_cost(CommOp("all_gather", 1_000_000), 4, shared).total_s == pytest.approx(
        3e-5 + 0.012
    )
    c = op_cost(CommOp("gather", 1_000_000), 4, shared)
    assert (c.wire_s, c.endpoint_s) == (pytest.approx(0.003), 0.0)


def test_degenerate_ops():
    assert op_cost(CommOp("allreduce", 100), 1, S) == Cost()
    assert op_cost(CommOp("allreduce", 0), 4, S) == Cost()
    with pytest.raises(ValueError, match="unknown collective"):
        op_cost(CommOp("reduce_scatter", 8), 4, S)
    ops = [CommOp("all_to_all", 4_000_000), CommOp("all_gather", 1_000_000)]
    assert plan_cost(ops, 4, S).total_s == pytest.approx(0.00606)
    assert plan_cost(ops, 4, S).collectives == 2


def test_fitted_alpha_beta_replace_link_and_latency():
    fitted = Substrate(link_gbps=1.0, latency_us=999.0, alpha_s=1e-5, beta_s_per_byte=1e-9)
    assert op_cost(CommOp("allreduce", 4_000_000), 4, fitted).total_s == pytest.approx(0.00606)


def test_codec_seconds():
    s = Substrate(
        link_gbps=8.0,
        encode_gbps={"sign": 1.0, "bf16": 4.0},
        reduce_gbps={"sign": 0.5},
        decode_gbps={"sign": 0.25, "bf16": 2.0},
    )
    # sharded: 4e6/1e9 + 4e6/5e8 + 4e6/2.5e8 = 0.004 + 0.008 + 0.016
    assert codec_seconds(SIGN, 1_000_000, 4, s) == pytest.approx(0.028)
    # central: the endpoint combines W * 4e6 bytes: 0.004 + 0.032 + 0.016
    assert codec_seconds(SIGN_CENTRAL, 1_000_000, 4, s) == pytest.approx(0.052)
    # bf16: cast and cast back, the sum happens inside the all-reduce: 1e-3 + 2e-3
    assert codec_seconds(RouteSpec("bf16"), 1_000_000, 4, s) == pytest.approx(0.003)
    assert codec_seconds(FP32, 1_000_000, 4, s) == 0.0
    off = Substrate(link_gbps=8.0, include_codec=False)
    assert codec_seconds(SIGN, 1_000_000, 4, off) == 0.0
    # a substrate topology overrides the spec's reducer
    assert codec_seconds(SIGN, 1_000_000, 4, Substrate(**{**s.to_dict(), "topology": "central"})
                         ) == pytest.approx(0.052)


def test_predict_fp32_is_one_ring_allreduce():
    # 1e6 elements = 4e6 bytes at W=4: 0.00606 (see test_allreduce_ring)
    assert predict_fp32(1_000_000, 4, S) == pytest.approx(0.00606)
    assert predict_fp32(1_000_000, 1, S) == 0.0


def test_predict_sign_sharded_from_the_real_plan():
    # 2^20 elements, chunk 4096 -> 256 scales (1024 bytes, sent to every rank for the mean,
    # riding in the codes' all-to-all: W x 1024 bytes); payload 2^20 / 8 = 131072 bytes;
    # even W majority result travels in 2 bits: 262144 bytes, all-gathered in shards of 65536.
    # Two rounds: the bytes of the old scale all-gather, without its latency.
    n, w = 1 << 20, 4
    assert route_plan(SIGN, n, w) == [
        CommOp("all_to_all", 131072 + 4 * 1024),
        CommOp("all_gather", 65536),
    ]
    s = Substrate(link_gbps=8.0, latency_us=10.0, include_codec=False)
    expected = (3 * A + 0.75 * (131072 + 4096) / B) + (3 * A + 3 * 65536 / B)
    assert predict_route(SIGN, n, w, s) == pytest.approx(expected)
    # with codec, the codec term adds exactly codec_seconds: 4n/1e9 + 4n/5e8 + 4n/2.5e8
    assert codec_seconds(SIGN, n, w, S) == pytest.approx(4 * n * (1e-9 + 2e-9 + 4e-9))
    assert predict_route(SIGN, n, w, S) == pytest.approx(
        expected + codec_seconds(SIGN, n, w, S)
    )


def test_verdict_slow_link_admits_sign():
    slow = Substrate(link_gbps=0.1, latency_us=50.0, **CODEC)
    v = bucket_verdict(slow, {SIGN: 1_000_000}, 4)
    verdict, reason, fp32, low = v  # unpacks as a 4-tuple
    assert verdict == "admit"
    # fp32: 6 * 5e-5 + 1.5 * 4e6 / 1.25e7 = 0.4803 s
    assert fp32 == pytest.approx(0.4803)
    assert low < 0.9 * fp32
    assert reason == f"admit: {fp32 / low:.1f}x faster"


def test_verdict_fast_link_codec_falls_back_naming_the_slow_stage():
    # 100 Gbit/s, W=4, 1e6 elements: fp32 = 6e-5 + 1.5 * 4e6 / 1.25e10 = 5.4e-4 s
    fast = dict(link_gbps=100.0, latency_us=10.0)
    slow_encode = Substrate(**fast, encode_gbps={"sign": 0.5}, reduce_gbps={"sign": 50.0},
                            decode_gbps={"sign": 50.0})
    v = bucket_verdict(slow_encode, {SIGN: 1_000_000}, 4)
    assert v.verdict == "fallback"
    assert v.fp32_time_s == pytest.approx(5.4e-4)
    # codec: 4e6/5e8 + 4e6/5e10 + 4e6/5e10 = 8 ms + 0.08 ms + 0.08 ms
    assert v.reason.startswith("encode slower than link: codec 8.16 ms (encode 8 ms) vs fp32 0.54 ms")
    slow_decode = Substrate(**fast, encode_gbps={"sign": 50.0}, reduce_gbps={"sign": 50.0},
                            decode_gbps={"sign": 0.5})
    assert bucket_verdict(slow_decode, {SIGN: 1_000_000}, 4).reason.startswith(
        "decode slower than link: codec 8.16 ms (decode 8 ms)")


def test_verdict_tiny_bucket_is_latency_bound():
    # 256 elements: fp32 = 6a; int8 = 3 collectives (its codes need the agreed max scale
    # first: a 6-hop all-reduce, then 3 + 3 hops) = 12a; sign = 2 of them (its scales ride
    # with the codes) = 6a, no faster than fp32, so below the margin
    s = Substrate(link_gbps=10.0, latency_us=50.0, include_codec=False)
    v = bucket_verdict(s, {RouteSpec("int8"): 256}, 4)
    assert v.verdict == "fallback"
    assert v.reason.startswith("latency-bound: 3 collectives vs 1")
    assert v.lowbit_time_s == pytest.approx(12 * 5e-5, rel=1e-3)
    v = bucket_verdict(s, {SIGN: 256}, 4)
    assert v.verdict == "fallback" and v.reason.startswith("below margin")
    assert v.lowbit_time_s == pytest.approx(6 * 5e-5, rel=1e-2)


def test_verdict_saturated_central_endpoint_falls_back_where_sharded_admits():
    # W=64, 1 Gbit/s links and endpoint, 4M elements: gather 63 x 524288 B into
    # 1.25e8 B/s = 0.264 s; broadcast 63 x 1 MiB (2-bit result) = 0.528 s;
    # fp32 ring 2*63/64 * 16.8e6 / 1.25e8 = 0.264 s.
    s = Substrate(link_gbps=1.0, latency_us=10.0, endpoint_gbps=1.0, include_codec=False)
    n = 1 << 22
    v = bucket_verdict(s, {SIGN_CENTRAL: n}, 64)
    assert v.verdict == "fallback"
    assert v.reason.startswith("endpoint saturated: 63x524 KB into 0.125 GB/s")
    assert v.fp32_time_s == pytest.approx(2 * 63 / 64 * 4 * n / 1.25e8 + 126 * 1e-5)
    assert bucket_verdict(s, {SIGN: n}, 64).verdict == "admit"


def test_verdict_margin_and_special_buckets():
    strict = Substrate(link_gbps=0.1, latency_us=50.0, margin=0.9, **CODEC)
    v = bucket_verdict(strict, {SIGN: 1_000_000}, 4)
    speedup = v.fp32_time_s / v.lowbit_time_s
    assert 1 < speedup < 10
    assert v == ("fallback", f"below margin: {speedup:.2f}x faster, 10.00x needed",
                 v.fp32_time_s, v.lowbit_time_s)
    assert bucket_verdict(S, {FP32: 1000}, 4)[:2] == ("admit", "fp32 only: nothing to gate")
    assert bucket_verdict(S, {SIGN: 1000}, 1)[:2] == (
        "fallback", "single rank: no communication to save")


def test_mixed_bucket_sums_its_routes():
    slow = Substrate(link_gbps=0.1, latency_us=50.0, **CODEC)
    v = bucket_verdict(slow, {FP32: 1000, SIGN: 1_000_000}, 4)
    assert v.fp32_time_s == pytest.approx(predict_fp32(1_001_000, 4, slow))
    assert v.lowbit_time_s == pytest.approx(
        predict_fp32(1000, 4, slow) + predict_route(SIGN, 1_000_000, 4, slow)
    )


def test_crossover_bucket_numel_is_the_boundary_and_monotone():
    def at(latency_us: float, link: float = 1.0) -> int | None:
        return crossover_bucket_numel(SIGN, 4, Substrate(link_gbps=link, latency_us=latency_us, **CODEC))

    s = Substrate(link_gbps=1.0, latency_us=50.0, **CODEC)
    n = at(50.0)
    assert n is not None and n > 1
    assert bucket_verdict(s, {SIGN: n}, 4).verdict == "admit"
    assert bucket_verdict(s, {SIGN: n - 1}, 4).verdict == "fallback"
    # more latency per hop: low-bit's extra collectives cost more, the crossover grows
    assert at(10.0) < at(50.0) < at(200.0)
    # a link faster than the codec (0.25 GB/s decode = 2 Gbit/s) never admits sign
    assert at(50.0, link=100.0) is None


def test_central_saturation_world_size():
    s = Substrate(link_gbps=1.0, latency_us=10.0, include_codec=False)
    n = 1 << 22
    w = central_saturation_world_size(SIGN, n, s)
    central = Substrate(**{**s.to_dict(), "topology": "central"})
    assert w is not None and w > 2
    assert bucket_verdict(central, {SIGN: n}, w).verdict == "fallback"
    assert bucket_verdict(central, {SIGN: n}, w - 1).verdict == "admit"
    # a faster endpoint keeps up with more ranks
    big = Substrate(link_gbps=1.0, latency_us=10.0, endpoint_gbps=4.0, include_codec=False)
    w_big = central_saturation_world_size(SIGN, n, big)
    assert w_big is None or w_big > w


def test_endpoint_ingress_bound_and_first_true():
    assert endpoint_ingress_bound_world_size(S) == 3  # E = B: 2 senders outlast one link
    assert endpoint_ingress_bound_world_size(
        Substrate(link_gbps=8.0, endpoint_gbps=64.0)) == 10
    assert first_true(lambda n: n >= 37, 1, 1000) == 37
    assert first_true(lambda n: n >= 1, 1, 1000) == 1
    assert first_true(lambda n: n >= 1000, 1, 1000) == 1000
    assert first_true(lambda n: False, 1, 1000) is None


# -- fixed codec cost per call and latency per collective kind ----------------------------


def test_kind_latency_rounds_and_overlap_with_the_transfer():
    # all_to_all: one round per call whatever W; all_gather: W-1 rounds; a named kind takes
    # max(rounds·L, transfer), so its Cost carries only the latency the transfer leaves over.
    s = Substrate(link_gbps=8.0, latency_us=10.0,
                  latency_us_by_kind={"all_to_all": 100.0, "all_gather": 50.0})
    c = op_cost(CommOp("all_to_all", 4_000), 4, s)  # wire 3/4 * 4e3 / 1e9 = 3 us
    assert (c.latency_s, c.wire_s, c.total_s) == (pytest.approx(97e-6), pytest.approx(3e-6),
                                                  pytest.approx(100e-6))
    big = op_cost(CommOp("all_to_all", 4_000_000), 4, s)  # 3 ms of wire hides the 0.1 ms
    assert (big.latency_s, big.total_s) == (0.0, pytest.approx(3e-3))
    assert op_cost(CommOp("all_gather", 8), 4, s).total_s == pytest.approx(3 * 50e-6)
    assert op_cost(CommOp("all_gather", 8), 8, s).total_s == pytest.approx(7 * 50e-6)
    # Kinds not named: α per hop, added to the transfer (the model as before).
    assert op_cost(CommOp("allreduce", 4_000), 4, s) == op_cost(CommOp("allreduce", 4_000), 4, S)
    assert op_cost(CommOp("gather", 1_000_000), 8, s) == op_cost(CommOp("gather", 1_000_000), 8, S)


def test_fixed_codec_cost_is_codec_time_once_per_call():
    s = Substrate(link_gbps=8.0, latency_us=10.0, codec_call_us={"sign": 500.0}, **CODEC)
    c = codec_cost_of(SIGN, 1_000_000, 4, s)
    # 500 us + encode 4e6/1e9 + reduce 4e6/5e8 + decode 4e6/2.5e8 = 0.5 + 4 + 8 + 16 ms
    assert c.call_s == pytest.approx(5e-4)
    assert c.codec_s == pytest.approx(0.0285)
    assert predict_route(SIGN, 1_000_000, 4, s) == pytest.approx(
        predict_route(SIGN, 1_000_000, 4, S) + 5e-4)
    assert codec_cost_of(FP32, 1000, 4, s).codec_s == 0.0
    assert codec_cost_of(SIGN, 1000, 4, Substrate(8.0, codec_call_us={"sign": 500.0},
                                                  include_codec=False)).codec_s == 0.0
    # A fixed cost moves the crossover up: small buckets lose to fp32 (on a 100 Mbit/s link).
    slow, slow_fixed = S.with_link(0.1), s.with_link(0.1)
    assert crossover_bucket_numel(SIGN, 4, slow_fixed) > crossover_bucket_numel(SIGN, 4, slow)


def test_fixed_cost_names_itself_in_the_fallback_reason():
    s = Substrate(link_gbps=8.0, latency_us=1.0, codec_call_us={"sign": 500.0}, **CODEC)
    v = bucket_verdict(s, {SIGN: 1000}, 2)
    # fp32: 2 hops * 1 us + 4e3/1e9 = 6 us; sign: 500 us fixed + 28 us codec + 3 us latency
    assert v.verdict == "fallback"
    assert v.reason == ("codec call overhead: codec 0.528 ms (0.5 ms fixed per call) vs fp32 "
                        "0.006 ms (0.01x)")


# -- a bucket is priced as the hook reduces it: a codec per (region, route) group, the sharded
# -- low-bit groups' collectives shared ------------------------------------------------------


def test_two_sign_regions_in_one_bucket_pay_two_codecs_and_one_exchange():
    # W=4, 2^20 elements per region, 500 us fixed per sign reduce. One reduce of 2^20 (see
    # test_predict_sign_sharded_from_the_real_plan): 2 collectives x 3 hops = 6a = 60 us;
    # wire 0.75*(131072 + 4096)/B + 3*65536/B = 297.984 us; codec 0.5 ms + 4n(1+2+4)/1e9
    # = 29.860128 ms; together 30.218112 ms. Two regions: two codecs, but their collectives
    # are one all-to-all and one all-gather (bytes summed, latency paid once): 60.376224 ms.
    s = Substrate(link_gbps=8.0, latency_us=10.0, codec_call_us={"sign": 500.0}, **CODEC)
    n = 1 << 20
    two = bucket_cost([(SIGN, n), (SIGN, n)], 4, s)
    assert two.total_s == pytest.approx(0.060376224)
    assert (two.collectives, two.calls) == (2, 2)
    assert two.call_s == pytest.approx(1e-3)
    assert two.latency_s == pytest.approx(6 * A)
    # One region of 2^21 elements: scales 2048 B, payload 262144 B, result shards 131072 B ->
    # the same 595.968 us of wire, one fixed cost: 59.876224 ms, i.e. one fixed cost less.
    merged = bucket_cost({SIGN: 2 * n}, 4, s)
    assert merged.total_s == pytest.approx(0.059876224)
    assert two.total_s - merged.total_s == pytest.approx(5e-4)
    v = bucket_verdict(s, [(SIGN, n), (SIGN, n)], 4)
    # fp32 stays one all-reduce of the whole bucket: 6a + 1.5 * 8388608 / B
    assert (v.fp32_time_s, v.lowbit_time_s) == (pytest.approx(0.012642912),
                                                 pytest.approx(0.060376224))
    # A float group rides along as its own all-reduce; a mapping is one group per route.
    mixed = bucket_verdict(s, [(FP32, 1000), (SIGN, n), (SIGN, n)], 4)
    assert mixed.lowbit_time_s == pytest.approx(0.060376224 + predict_fp32(1000, 4, s))
    assert bucket_verdict(s, {SIGN: n}, 4) == bucket_verdict(s, [(SIGN, n)], 4)
    assert bucket_cost([(SIGN, 0), (SIGN, n)], 4, s) == bucket_cost([(SIGN, n)], 4, s)


def test_two_reduces_can_turn_an_admit_into_a_fallback():
    # W=2, 10 Mbit/s (B = 1.25e6 B/s), 1 us per hop, 4 ms fixed per sign reduce.
    # fp32 of 2000 elements: 2 us + 8000/B = 6.402 ms; admit below 0.9x = 5.7618 ms.
    # One sign reduce of 2000 at W=2 all-gathers its codes: 1 hop 1 us, 256 + 4 B / B = 208 us,
    # codec 4 ms + 8000 * 7e-9 = 4.056 ms: 4.265 ms, admitted. Two regions of 1000: two codecs
    # of 4.028 ms, one shared all-gather of 2 x (128 + 4) B (1 us + 211.2 us): 8.2682 ms,
    # refused.
    s = Substrate(link_gbps=0.01, latency_us=1.0, codec_call_us={"sign": 4000.0}, **CODEC)
    one = bucket_verdict(s, {SIGN: 2000}, 2)
    assert (one.verdict, one.fp32_time_s, one.lowbit_time_s) == (
        "admit", pytest.approx(6.402e-3), pytest.approx(4.265e-3))
    two = bucket_verdict(s, [(SIGN, 1000), (SIGN, 1000)], 2)
    assert (two.verdict, two.fp32_time_s, two.lowbit_time_s) == (
        "fallback", pytest.approx(6.402e-3), pytest.approx(8.2682e-3))
    assert two.reason == ("codec call overhead: codec 8.06 ms (8 ms fixed over 2 calls) vs fp32 "
                          "6.4 ms (0.77x)")
