"""Substrate TOML round trip, every bad value, overrides and bench codec tables."""

from __future__ import annotations

import json
import math

import pytest

from nfabric_cli.errors import InputError
from nfabric_cli.substrate.model import (
    DEFAULT_CODEC_CALL_US,
    DEFAULT_ENCODE_GBPS,
    Substrate,
    as_substrate,
    build_substrate,
    codec_rates_from_bench,
    load_substrate,
    save_substrate,
)

FULL = Substrate(
    link_gbps=0.1,
    latency_us=55.5,
    topology="central",
    endpoint_gbps=0.4,
    world_size=4,
    shared_link=True,
    margin=0.2,
    encode_gbps={"sign": 1.5, "int8": 0.7},
    reduce_gbps={"sign": 0.5},
    decode_gbps={"sign": 2.0},
    include_codec=False,
    alpha_s=4.2e-05,
    beta_s_per_byte=8.1e-08,
    codec_call_us={"sign": 120.0, "int8": 0.0},
    latency_us_by_kind={"all_to_all": 300.0, "all_gather": 150.5},
)


def test_toml_round_trip(tmp_path):
    path = tmp_path / "s.toml"
    save_substrate(FULL, path)
    assert load_substrate(path) == FULL
    assert [p.name for p in tmp_path.iterdir()] == ["s.toml"]  # no temp file left behind
    minimal = Substrate(link_gbps=10.0)
    save_substrate(minimal, path)
    assert load_substrate(path) == minimal
    assert "topology" not in path.read_text()  # unset keys are not written


def test_units_and_defaults():
    s = Substrate(link_gbps=8.0, latency_us=10.0)
    assert s.link_bytes_per_s == 1e9
    assert s.endpoint_bytes_per_s == 1e9  # None: the endpoint is a rank's link
    assert s.alpha == pytest.approx(1e-5)
    assert s.encode_bytes_per_s("sign") == DEFAULT_ENCODE_GBPS["sign"] * 1e9
    assert s.encode_bytes_per_s("fp32") == math.inf
    assert FULL.encode_bytes_per_s("sign") == 1.5e9
    assert FULL.alpha == 4.2e-05
    assert FULL.link_bytes_per_s == pytest.approx(1 / 8.1e-08)
    assert FULL.with_link(100.0).link_bytes_per_s == 12.5e9  # fitted beta dropped


@pytest.mark.parametrize(
    "text, message",
    [
        ("link_gbps = 0", "link_gbps must be > 0, got 0"),
        ("link_gbps = -1.5", "link_gbps must be > 0, got -1.5"),
        ('link_gbps = "fast"', "link_gbps must be a number, got 'fast'"),
        ("link_gbps = true", "link_gbps must be a number, got True"),
        ("link_gbps = nan", "link_gbps must be a number, got nan"),
        ("link_gbps = inf", "link_gbps must be finite, got inf"),
        ("latency_us = 5", "link_gbps is required"),
        ("link_gbps = 1\nlatency_us = -1", "latency_us must be >= 0, got -1"),
        ('link_gbps = 1\ntopology = "ring"', "unknown topology 'ring' (choose from sharded, central)"),
        ("link_gbps = 1\nendpoint_gbps = 0", "endpoint_gbps must be > 0, got 0"),
        ("link_gbps = 1\nworld_size = 0", "world_size must be an integer >= 1, got 0"),
        ("link_gbps = 1\nworld_size = 2.5", "world_size must be an integer >= 1, got 2.5"),
        ("link_gbps = 1\nmargin = 1.0", "margin must be in [0, 1), got 1.0"),
        ("link_gbps = 1\nmargin = -0.1", "margin must be >= 0, got -0.1"),
        ('link_gbps = 1\nshared_link = "yes"', "shared_link must be true or false, got 'yes'"),
        ("link_gbps = 1\nbeta_s_per_byte = 0", "beta_s_per_byte must be > 0, got 0"),
        ("link_gbps = 1\nalpha_s = -1e-6", "alpha_s must be >= 0, got -1e-06"),
        ("link_gbps = 1\n[encode_gbps]\nsign = 0", "encode_gbps.sign must be > 0, got 0"),
        ("link_gbps = 1\n[decode_gbps]\nfp8 = 1.0", "decode_gbps: unknown route 'fp8'"),
        ("link_gbps = 1\nencode_gbps = 3", "encode_gbps must be a table of route = GB/s, got 3"),
        ("link_gbps = 1\nlink_mbps = 3", "unknown key(s) link_mbps (known: "),
        ("link_gbps = 1\n[codec_call_us]\nsign = -1", "codec_call_us.sign must be >= 0, got -1"),
        ("link_gbps = 1\n[codec_call_us]\nfp32 = 10",
         "codec_call_us.fp32: fp32 has no codec (its per-call cost is in α)"),
        ("link_gbps = 1\n[codec_call_us]\nfp8 = 10", "codec_call_us: unknown route 'fp8'"),
        ("link_gbps = 1\ncodec_call_us = 3",
         "codec_call_us must be a table of route = microseconds, got 3"),
        ("link_gbps = 1\n[latency_us_by_kind]\nring = 5",
         "latency_us_by_kind: unknown collective kind 'ring' (choose from allreduce, "
         "all_to_all, all_gather, gather, broadcast)"),
        ('link_gbps = 1\n[latency_us_by_kind]\nall_to_all = "x"',
         "latency_us_by_kind.all_to_all must be a number, got 'x'"),
        ("link_gbps = 1\n[latency_us_by_kind]\ngather = inf",
         "latency_us_by_kind.gather must be finite, got inf"),
        ("link_gbps = ", "malformed TOML"),
    ],
)
def test_every_bad_value_is_one_line(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text + "\n")
    with pytest.raises(InputError) as err:
        load_substrate(path)
    assert message in str(err.value)
    assert str(err.value).startswith(str(path))
    assert "\n" not in str(err.value)


def test_fixed_costs_and_kind_latency_defaults():
    # A substrate that does not describe a route's codec pays the host defaults, fixed cost
    # included; one that describes it (any codec table) pays only what it gives.
    bare = Substrate(link_gbps=1.0)
    assert bare.codec_call_s("sign") == pytest.approx(DEFAULT_CODEC_CALL_US["sign"] * 1e-6)
    assert bare.codec_call_s("fp32") == 0.0
    described = Substrate(link_gbps=1.0, encode_gbps={"sign": 2.0})
    assert described.codec_call_s("sign") == 0.0  # files written before the key: unchanged
    assert described.codec_call_s("int8") == pytest.approx(DEFAULT_CODEC_CALL_US["int8"] * 1e-6)
    assert FULL.codec_call_s("sign") == pytest.approx(1.2e-4)
    assert FULL.codec_call_s("int8") == 0.0
    assert FULL.kind_latency_s("all_gather") == pytest.approx(1.505e-4)
    assert FULL.kind_latency_s("gather") is None  # α per hop applies
    # Profile metadata keeps them (the dict the runtime's gate reads).
    assert as_substrate(FULL.to_dict()).latency_us_by_kind == FULL.latency_us_by_kind
    assert Substrate.from_dict(FULL.to_dict()) == FULL


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match="substrate file .*: no such file"):
        load_substrate(tmp_path / "nope.toml")


def test_build_substrate_overrides(tmp_path):
    path = tmp_path / "s.toml"
    save_substrate(FULL, path)
    s = build_substrate(path, link_gbps=1.0, latency_us=None, encode_gbps={"int4": 0.3},
                        codec_call_us={"sign": 50.0}, latency_us_by_kind={"gather": 9.0})
    assert s.link_gbps == 1.0
    assert s.latency_us == 55.5  # None overrides are ignored
    assert s.encode_gbps == {"int4": 0.3, "int8": 0.7, "sign": 1.5}  # tables merge
    assert s.codec_call_us == {"int8": 0.0, "sign": 50.0}
    assert s.latency_us_by_kind == {"all_gather": 150.5, "all_to_all": 300.0, "gather": 9.0}
    assert build_substrate(None, base={"link_gbps": 2.0}, margin=0.3) == Substrate(2.0, margin=0.3)
    with pytest.raises(InputError, match="no substrate: pass --substrate PATH or --link-gbps"):
        build_substrate(None, base=None, latency_us=3.0)
    with pytest.raises(InputError, match="unknown topology"):
        build_substrate(None, link_gbps=1.0, topology="mesh")


def test_codec_rates_from_bench(tmp_path):
    path = tmp_path / "bench.json"
    rows = [
        {"route": "sign/sharded", "encode_gbps": 1.1, "reduce_gbps": 0.4, "decode_gbps": 0.9},
        {"route": "fp32", "encode_gbps": 99},
        {"route": "ternary(tau=0.5)/sharded", "encode_gbps": 0.2},
    ]
    expected = {
        "encode_gbps": {"sign": 1.1, "ternary": 0.2},
        "reduce_gbps": {"sign": 0.4},
        "decode_gbps": {"sign": 0.9},
    }
    for doc in (
        {"routes": rows},
        rows,
        {"sign": rows[0], "ternary": {"encode_gbps": 0.2}},
        {"size": 4, "kernels": {"sign": "native"},  # `bench routes --json`
         "routes": {"sign": rows[0], "fp32": rows[1], "ternary": {"encode_gbps": 0.2}}},
    ):
        path.write_text(json.dumps(doc))
        assert codec_rates_from_bench(path) == expected
    path.write_text(json.dumps({"routes": []}))
    with pytest.raises(InputError, match="no encode_gbps / reduce_gbps / decode_gbps"):
        codec_rates_from_bench(path)
    path.write_text("{")
    with pytest.raises(InputError, match="malformed JSON"):
        codec_rates_from_bench(path)


def test_shipped_substrates_load():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "substrates"
    loaded = {p.name: load_substrate(p) for p in sorted(root.glob("*.toml"))}
    assert len(loaded) >= 3
    assert loaded["loopback-100mbit.toml"].shared_link is True
    assert loaded["cluster-100g-central.toml"].topology == "central"
