"""The fits recover known constants from synthetic timings; stage splits; aggregation."""

from __future__ import annotations

import math

import pytest

from nfabric_cli.errors import InputError
from nfabric_cli.replay.fit import (
    FREE_GBPS,
    LinkFit,
    OpSample,
    ReduceSample,
    StageSample,
    affine_rate,
    fit_codec,
    fit_endpoint,
    fit_kind_latency,
    fit_link,
)
from nfabric_cli.replay.plan import ROLE_CODEC, ROLE_SWEEP, ReplayCase, ReplayPlan
from nfabric_cli.replay.run import CaseResult, fit_substrate
from nfabric_cli.replay.timed import Event, Stages, split_stages
from nfabric_cli.routes.spec import FP32, RouteSpec
from nfabric_cli.substrate.cost import codec_cost, op_cost, route_cost, route_plan
from nfabric_cli.substrate.model import Substrate

ALPHA, BETA = 150e-6, 8 / 100e6  # 150 us per hop, 100 Mbit/s


def allreduce_s(numel: int, w: int, shared: bool) -> float:
    link_bytes = 2 * (w - 1) * 4 * numel * (1 if shared else 1 / w)
    return 2 * (w - 1) * ALPHA + link_bytes * BETA


@pytest.mark.parametrize("shared", [True, False])
def test_link_fit_recovers_alpha_and_beta(shared: bool) -> None:
    samples = [OpSample("allreduce", 4 * n, w, allreduce_s(n, w, shared))
               for w in (2, 4) for n in (1, 256, 4096, 65536, 1 << 20)]
    fit = fit_link(samples, shared)
    assert fit.alpha_s == pytest.approx(ALPHA, rel=1e-9)
    assert fit.beta_s_per_byte == pytest.approx(BETA, rel=1e-9)
    assert fit.link_gbps == pytest.approx(0.1, rel=1e-9)
    assert fit.rms_rel_error < 1e-9 and fit.samples == 10
    # A mixed set of collectives: the same constants through each kind's own terms.
    mixed = [OpSample("all_gather", 4096, 4, 3 * ALPHA + (12 if shared else 3) * 4096 * BETA),
             OpSample("all_to_all", 65536, 4, 3 * ALPHA + (3 if shared else 0.75) * 65536 * BETA)]
    fit = fit_link(samples[:3] + mixed, shared)
    assert (fit.alpha_s, fit.beta_s_per_byte) == (pytest.approx(ALPHA), pytest.approx(BETA))


def test_link_fit_is_robust_to_jitter_on_small_transfers_and_clamps_alpha() -> None:
    # Latency-bound points off by +-40 % (scheduling jitter on a loaded host) must not drag β:
    # a joint relative least-squares fit moved it by tens of percent on real data.
    jitter = {1: 1.4, 256: 0.6, 1024: 1.4, 4096: 0.7}
    samples = [OpSample("allreduce", 4 * n, 2, allreduce_s(n, 2, True) * jitter.get(n, 1.0))
               for n in (1, 256, 1024, 4096, 65536, 262144, 1 << 20)]
    fit = fit_link(samples, True)
    assert fit.beta_s_per_byte == pytest.approx(BETA, rel=0.01)
    # At 100 Mbit/s only the 1-element all-reduce is latency-bound (256 elements already
    # spend half a hop's latency on the wire): α is its value, jitter included.
    assert fit.alpha_s == pytest.approx(1.4 * ALPHA, rel=0.01)
    # Pure bandwidth (zero latency) with noise pushing α below 0: α is clamped, β kept.
    pts = [OpSample("allreduce", 4 * n, 2, 2 * 4 * n * BETA * f)
           for n, f in ((1000, 0.9), (100000, 1.0), (1000000, 1.0))]
    fit = fit_link(pts, True)
    assert fit.alpha_s == 0.0
    assert fit.beta_s_per_byte == pytest.approx(BETA, rel=1e-6)


def test_link_fit_refuses_unidentifiable_data() -> None:
    one = OpSample("allreduce", 4096, 2, 1e-3)
    with pytest.raises(InputError, match="at least two"):
        fit_link([one], True)
    with pytest.raises(InputError, match="one size"):
        fit_link([one, one], True)
    flat = [OpSample("allreduce", 4 * n, 2, 1e-3) for n in (1, 10, 100)]  # latency only
    with pytest.raises(InputError, match="no bandwidth term"):
        fit_link(flat, True)
    with pytest.raises(InputError, match="no bandwidth term"):  # bigger was faster
        fit_link([flat[0], OpSample("allreduce", 4000, 2, 0.9e-3)], True)


def test_codec_fit_recovers_rates_with_the_cost_models_byte_counts() -> None:
    enc, red, dec = 2e9, 0.5e9, 0.25e9  # bytes/s
    samples = []
    for reducer, w in (("sharded", 4), ("central", 4)):
        for n in (1000, 100000, 1000000):
            combined = 4 * n * (w if reducer == "central" else 1)
            samples.append(StageSample("sign", reducer, True, n, w, 4 * n / enc,
                                       combined / red, 4 * n / dec))
    samples.append(StageSample("bf16", "sharded", False, 1000, 4, 4000 / 4e9, 0.0, 4000 / 8e9))
    samples.append(StageSample("fp32", "sharded", False, 1000, 4, 1.0, 1.0, 1.0))
    for affine in (True, False):  # no fixed cost in the data: both fits find the same rates
        fit = fit_codec(samples, affine=affine)
        rates = fit.rates
        assert rates["encode_gbps"] == {"bf16": pytest.approx(4.0), "sign": pytest.approx(2.0)}
        assert rates["reduce_gbps"] == {"sign": pytest.approx(0.5)}  # 16-bit: in the all-reduce
        assert rates["decode_gbps"] == {"bf16": pytest.approx(8.0), "sign": pytest.approx(0.25)}
        # one bf16 size: through the origin, no fixed cost; sign's is zero
        assert fit.call_us == ({"sign": pytest.approx(0.0, abs=1e-6)} if affine else {})


def test_endpoint_fit_uses_only_bandwidth_bound_gathers() -> None:
    link = LinkFit(ALPHA, BETA, 0.0, 10)
    e = 40e6  # bytes/s
    big = [OpSample("gather", n, 4, ALPHA + 3 * n / e) for n in (100_000, 1_000_000)]
    tiny = OpSample("gather", 16, 4, 5 * ALPHA)  # latency and noise: would wreck the fit
    assert fit_endpoint(big + [tiny], link) == pytest.approx(e, rel=1e-9)
    assert fit_endpoint([tiny, OpSample("broadcast", 10**6, 4, 1.0)], link) is None


def test_split_stages_attributes_gaps_between_collectives() -> None:
    code = [Event("all_gather", 64, 0.001, 0.002), Event("all_to_all", 512, 0.005, 0.009),
            Event("all_gather", 256, 0.012, 0.013)]
    s = split_stages(code, 0.020)
    assert s == Stages(pytest.approx(0.004), pytest.approx(0.003), pytest.approx(0.007),
                       pytest.approx(0.006))
    fp = split_stages([["allreduce", 4096, 0.0005, 0.0035]], 0.004)  # JSON lists work too
    assert fp == Stages(pytest.approx(0.0005), 0.0, pytest.approx(0.0005), pytest.approx(0.003))
    assert split_stages([], 0.001) == Stages(0.0, 0.0, 0.0, 0.0)


# -- fixed costs and per-kind latency: the fits recover the model's own constants ------------

#: The "true" fabric the synthetic timings come from: 100 Mbit/s shared link, 150 us per
#: all-reduce hop, per-kind rounds, sign's codec with a fixed cost per call.
TRUE = Substrate(
    link_gbps=0.1, alpha_s=ALPHA, beta_s_per_byte=BETA, shared_link=True, world_size=4,
    encode_gbps={"sign": 2.0}, reduce_gbps={"sign": 0.5}, decode_gbps={"sign": 0.25},
    codec_call_us={"sign": 900.0},
    latency_us_by_kind={"all_gather": 700.0, "all_to_all": 2500.0, "gather": 1100.0,
                        "broadcast": 1800.0},
)
SPLIT = (0.5, 0.2, 0.3)  # how the fixed cost falls on encode / reduce / decode
SIGNS = (RouteSpec("sign", reducer="sharded"), RouteSpec("sign", reducer="central"))
SIZES = (1000, 6404, 41013, 262656)


def stages_of(spec: RouteSpec, numel: int, w: int) -> Stages:
    c = codec_cost(spec, numel, w, TRUE)
    comm = route_cost(spec, numel, w, TRUE).total_s - c.codec_s
    e, r, d = (c.call_s * f for f in SPLIT)
    return Stages(c.encode_s + e, c.reduce_s + r, c.decode_s + d, comm)


def test_affine_codec_fit_recovers_rates_and_fixed_cost() -> None:
    samples = [StageSample("sign", spec.reducer, True, n, 4, *stages_of(spec, n, 4)[:3])
               for spec in SIGNS for n in SIZES]
    fit = fit_codec(samples)
    assert fit.call_us == {"sign": pytest.approx(900.0, rel=0.01)}
    assert {t: r["sign"] for t, r in fit.rates.items()} == {
        "encode_gbps": pytest.approx(2.0, rel=0.01), "reduce_gbps": pytest.approx(0.5, rel=0.01),
        "decode_gbps": pytest.approx(0.25, rel=0.01)}
    # Through the origin (the model before fixed costs), the fixed cost inflates every rate's
    # time: the 1,000-element reduce is what a relative fit cannot match then.
    old = fit_codec(samples, affine=False)
    assert old.call_us == {} and old.rates["decode_gbps"]["sign"] < 0.25


def test_affine_rate_clamps_to_non_negative_terms() -> None:
    assert affine_rate([(1.0, 2e-3), (1e6, 2e-3)]) == (pytest.approx(2e-3), math.inf)
    c, r = affine_rate([(1e3, 1e-6), (1e6, 1e-3), (1e5, 1e-4)])  # through the origin
    assert c == 0.0 and r == pytest.approx(1e9)
    # Bigger was faster: no per-byte term; c = sum(1/t) / sum(1/t^2) = 1200 / 1.04e6.
    assert affine_rate([(1e3, 5e-3), (1e6, 1e-3)]) == (pytest.approx(1200 / 1.04e6), math.inf)
    assert affine_rate([(1e3, 0.0)]) == (0.0, math.inf)
    assert FREE_GBPS == 1e4  # what a stage without per-byte cost is written as


def reduce_samples(w: int) -> list[ReduceSample]:
    out = []
    for spec in SIGNS:
        for n in SIZES:
            ops = tuple(OpSample(op.kind, op.nbytes, w, op_cost(op, w, TRUE).total_s)
                        for op in route_plan(spec, n, w))
            out.append(ReduceSample(w, route_cost(spec, n, w, TRUE).total_s,
                                    codec_cost(spec, n, w, TRUE).codec_s, ops))
    return out


def test_kind_latency_fit_recovers_each_kind_per_round() -> None:
    link = LinkFit(ALPHA, BETA, 0.0, 10)
    for w in (2, 4):
        got = fit_kind_latency(reduce_samples(w), link, shared_link=True)
        # at W = 2 a sharded sign reduce all-gathers its codes: no all-to-all to time
        kinds = {k: v for k, v in TRUE.latency_us_by_kind.items()
                 if w > 2 or k != "all_to_all"}
        assert got == {k: pytest.approx(v * 1e-6, rel=0.01) for k, v in kinds.items()}
    # A transfer-bound reduce says nothing about latency: with none latency-bound, the one
    # closest to it is used (a slower link: every sample is mostly transfer).
    slow = LinkFit(ALPHA, BETA * 1000, 0.0, 10)
    assert set(fit_kind_latency(reduce_samples(4), slow, True)) == {
        "all_gather", "all_to_all", "broadcast", "gather"}
    assert fit_kind_latency([], link, True) == {}


def test_fit_substrate_recovers_the_model_that_made_the_timings() -> None:
    w = 4
    cases, results = [], []
    for spec in SIGNS:
        for n in SIZES:
            cases.append(ReplayCase(ROLE_CODEC, spec.to_dict(), n, [n]))
    for n in (1, 256, 1024, 4096, 16384, 65536):
        cases.append(ReplayCase(ROLE_SWEEP, FP32.to_dict(), n, [n]))
    for i, case in enumerate(cases):
        spec, n = case.route, case.numel
        ops = [(op.kind, op.nbytes, op_cost(op, w, TRUE).total_s) for op in route_plan(spec, n, w)]
        stages = stages_of(spec, n, w) if spec != FP32 else Stages(0.0, 0.0, 0.0, 0.0)
        results.append(CaseResult(i, route_cost(spec, n, w, TRUE).total_s, stages, tuple(ops),
                                  {"random": w}, tuple(d for *_, d in ops)))
    plan = ReplayPlan("/nonexistent", w, 3, cases)
    sub, link = fit_substrate(plan, results, shared_link=True)
    assert (sub.alpha_s, sub.beta_s_per_byte) == (pytest.approx(ALPHA, rel=0.01),
                                                  pytest.approx(BETA, rel=0.01))
    assert sub.codec_call_us == {"sign": pytest.approx(900.0, rel=0.01)}
    for table in ("encode_gbps", "reduce_gbps", "decode_gbps"):
        assert getattr(sub, table) == {"sign": pytest.approx(getattr(TRUE, table)["sign"],
                                                             rel=0.01)}
    assert sub.latency_us_by_kind == {k: pytest.approx(v, rel=0.01)
                                      for k, v in TRUE.latency_us_by_kind.items()}
    for spec in SIGNS:  # so the fitted substrate predicts what the true one does
        for n in (1056, 100000):
            assert route_cost(spec, n, w, sub).total_s == pytest.approx(
                route_cost(spec, n, w, TRUE).total_s, rel=0.01)
