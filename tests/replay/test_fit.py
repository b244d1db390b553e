"""The fits recover known constants from synthetic timings; stage splits; aggregation."""

from __future__ import annotations

import pytest

from nfabric_cli.errors import InputError
from nfabric_cli.replay.fit import (
    LinkFit,
    OpSample,
    StageSample,
    fit_codec,
    fit_endpoint,
    fit_link,
)
from nfabric_cli.replay.timed import Event, Stages, split_stages

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
    rates = fit_codec(samples)
    assert rates["encode_gbps"] == {"bf16": pytest.approx(4.0), "sign": pytest.approx(2.0)}
    assert rates["reduce_gbps"] == {"sign": pytest.approx(0.5)}  # 16-bit: inside all-reduce
    assert rates["decode_gbps"] == {"bf16": pytest.approx(8.0), "sign": pytest.approx(0.25)}


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
