"""`nfabric capacity`: JSON shape and numbers, plots, projection, one-line errors (exit 2)."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
from typer.testing import CliRunner

from nfabric_cli.app import app
from nfabric_cli.routes.spec import FP32, RouteSpec
from nfabric_cli.substrate.cost import bucket_verdict
from nfabric_cli.substrate.model import Substrate

runner = CliRunner()
CODEC = {"encode_gbps": 1.0, "reduce_gbps": 0.5, "decode_gbps": 0.25}

MODEL_SRC = textwrap.dedent(
    """
    import torch
    from torch import nn

    def build():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 10)
        )
    """
)
# Parameters: 0.weight 262144, 0.bias 1024, 2.weight 524288, 2.bias 512, 4.weight 5120, 4.bias 10


@pytest.fixture()
def files(tmp_path, monkeypatch):
    """A plugin model, a profile (last layer fp32, the rest sign) and its compiled bindings."""
    from nfabric_cli.binding import compile_profile, static_profile, write_bindings
    from nfabric_cli.profile.store import write_profile
    from nfabric_cli.workloads.registry import load_model

    (tmp_path / "capmodel.py").write_text(MODEL_SRC)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    model = load_model("capmodel:build")
    profile = static_profile(model, "sign", rules=[("4.*", "fp32")])
    write_profile(profile, tmp_path / "p.parquet")
    write_bindings(compile_profile(profile, model, world_size=4, bucket_cap_mb=1.0),
                   tmp_path / "b.parquet")
    # codec rates pinned (as `nfabric bench routes --json` writes them): verdicts stay fixed
    (tmp_path / "bench.json").write_text(json.dumps({"routes": {"sign": CODEC}}))
    yield tmp_path
    sys.modules.pop("capmodel", None)


def invoke(*args: str):
    bench = ["--bench", "bench.json"] if "--project" not in args else []
    return runner.invoke(app, ["capacity", *args, *bench])


def assert_one_line_error(result, text: str) -> None:
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error: ") and text in lines[0]
    assert "Traceback" not in result.output


def test_json_report_numbers(files):
    r = invoke("b.parquet", "--link-gbps", "0.1", "--latency-us", "50", "--world-size", "4",
               "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert set(doc) == {"phase", "world_size", "substrate", "buckets", "totals", "crossover"}
    assert doc["phase"] == "all" and doc["world_size"] == 4
    s = Substrate(link_gbps=0.1, latency_us=50.0,
                  **{k: {"sign": v} for k, v in CODEC.items()})
    for b in doc["buckets"]:
        assert {"index", "bytes", "routes", "fp32_time_s", "lowbit_time_s", "verdict",
                "reason"} <= set(b)
        numels = {FP32 if k == "fp32" else RouteSpec("sign"): v["numel"]
                  for k, v in b["routes"].items()}
        v = bucket_verdict(s, numels, 4)
        assert (b["verdict"], b["reason"]) == (v.verdict, v.reason)
        assert b["fp32_time_s"] == pytest.approx(v.fp32_time_s)
        assert b["lowbit_time_s"] == pytest.approx(v.lowbit_time_s)
        assert b["bytes"] == sum(x["bytes"] for x in b["routes"].values())
    # 1 MB cap -> the first bucket holds the fp32 head (5130 elements) and the sign layer 2
    assert doc["buckets"][0]["routes"]["fp32"]["numel"] == 5130
    assert sum(b["numel"] for b in doc["buckets"]) == 793098
    t = doc["totals"]
    assert t["numel"] == 793098
    assert t["fp32_time_s"] == pytest.approx(sum(b["fp32_time_s"] for b in doc["buckets"]))
    assert t["admitted"] + t["fallback"] == len(doc["buckets"])
    assert t["bytes"] < t["fp32_bytes"] / 10  # 1-bit payloads on a slow link
    c = doc["crossover"]
    assert set(c["bucket_numel"]) == {"sign/sharded"}
    assert c["bucket_numel"]["sign/sharded"] > 0
    assert c["central_saturation_numel"] == max(b["numel"] for b in doc["buckets"])
    assert set(c["central_saturation_world_size"]) == {"sign/central"}
    assert c["route_world_size_limit"] == {"sign/central": 255}


def test_json_report_prices_each_reduce(files):
    """Layers 0 and 2 on sign as two regions side by side in one bucket: one reduce with both
    regions, listed in "groups" and priced as one; layer 2 on int8 instead: two reduces,
    priced as two (verdict and times), and each route's bytes in "routes"."""
    from nfabric_cli.binding import compile_profile, static_profile, write_bindings
    from nfabric_cli.workloads.registry import load_model

    model = load_model("capmodel:build")
    s = Substrate(link_gbps=0.1, latency_us=50.0, **{k: {"sign": v} for k, v in CODEC.items()})
    cases = {"sign": [(FP32, 5130), (RouteSpec("sign"), 787968)],
             "int8": [(FP32, 5130), (RouteSpec("int8"), 524800), (RouteSpec("sign"), 263168)]}
    reports = {}
    for body, priced in cases.items():
        profile = static_profile(model, body, rules=[("4.*", "fp32"), ("0.*", "sign")])
        write_bindings(compile_profile(profile, model, world_size=4, bucket_cap_mb=25.0),
                       files / "two.parquet")
        r = invoke("two.parquet", "--link-gbps", "0.1", "--latency-us", "50", "--json")
        assert r.exit_code == 0, r.output
        (b,) = json.loads(r.output)["buckets"]
        assert [(g["route"].split("/")[0], g["numel"]) for g in b["groups"]] == [
            (spec.name, n) for spec, n in priced]
        reports[body] = b
    v = bucket_verdict(s, cases["sign"], 4)  # (int8 is priced on the default tables)
    assert (reports["sign"]["verdict"], reports["sign"]["reason"]) == (v.verdict, v.reason)
    assert reports["sign"]["lowbit_time_s"] == pytest.approx(v.lowbit_time_s)
    assert [g["regions"] for g in reports["sign"]["groups"]] == [["4.*"], ["*", "0.*"]]
    assert reports["sign"]["routes"]["sign/sharded"] == {
        "numel": 787968, "bytes": reports["sign"]["groups"][1]["bytes"]}
    assert reports["int8"]["lowbit_time_s"] > reports["sign"]["lowbit_time_s"]  # two calls


def test_profile_needs_a_model_and_compiles_with_one(files):
    r = invoke("p.parquet", "--link-gbps", "0.1", "--world-size", "4", "--json")
    assert_one_line_error(r, "is a profile: give --workload or --model")
    r = invoke("p.parquet", "--model", "capmodel:build", "--link-gbps", "100",
               "--world-size", "4", "--bucket-cap-mb", "1", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    # a 100 Gbit/s link outruns the CPU sign codec: every sign bucket falls back
    assert {b["verdict"] for b in doc["buckets"]} == {"fallback"}
    assert all(" slower than link: codec " in b["reason"] for b in doc["buckets"])
    assert doc["totals"]["gated_time_s"] == pytest.approx(doc["totals"]["fp32_time_s"])


def test_human_output_and_plot(files):
    r = invoke("b.parquet", "--link-gbps", "0.1", "--plot", "sweep.png")
    assert r.exit_code == 0, r.output
    assert "capacity per bucket" in r.output and "admit" in r.output
    assert "crossover sign/sharded" in r.output
    assert (files / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_substrate_file_and_flags_override(files):
    (files / "s.toml").write_text('link_gbps = 100.0\nlatency_us = 50.0\ntopology = "central"\n')
    r = invoke("b.parquet", "--substrate", "s.toml", "--link-gbps", "0.1", "--json")
    doc = json.loads(r.output)
    assert doc["substrate"] == {"link_gbps": 0.1, "latency_us": 50.0, "topology": "central",
                                "margin": 0.1, "shared_link": False, "include_codec": True,
                                **{k: {"sign": v} for k, v in CODEC.items()}}


@pytest.mark.parametrize(
    "args, text",
    [
        (["b.parquet", "--link-gbps", "0"], "link_gbps must be > 0, got 0"),
        (["b.parquet", "--link-gbps", "-2"], "link_gbps must be > 0, got -2"),
        (["b.parquet", "--link-gbps", "1", "--endpoint-gbps", "0"], "endpoint_gbps must be > 0"),
        (["b.parquet", "--link-gbps", "1", "--topology", "ring"], "unknown topology 'ring'"),
        (["b.parquet"], "no substrate: pass --substrate PATH or --link-gbps"),
        (["b.parquet", "--substrate", "missing.toml"], "no such file"),
        (["b.parquet", "--substrate", "."], "substrate file .: is a folder, not a file"),
        (["b.parquet", "--link-gbps", "1", "--phase", "warmup"], "unknown phase 'warmup'"),
        (["b.parquet", "--link-gbps", "1", "--world-size", "0"], "--world-size must be >= 1"),
        (["nope.parquet", "--link-gbps", "1"], "nope.parquet"),
        (["--link-gbps", "1"], "give a bindings or profile file (or --project)"),
        (["--project", "--shape", "gpt-5"], "unknown shape 'gpt-5'"),
        (["--project"], "--project needs exactly one of --workload, --model, --shape"),
        (["b.parquet", "--project", "--shape", "pythia-160m"], "--project takes shapes"),
        (["--project", "--shape", "pythia-160m", "--latency-us", "-1"], "latency_us must be >= 0"),
        *[(["--project", "--shape", "pythia-160m", "--bucket-cap-mb", cap],
           f"bucket cap must be a finite number > 0 MB, got {shown}")
          for cap, shown in (("-1", "-1.0"), ("0", "0.0"), ("nan", "nan"))],
        *[(["--project", "--shape", "pythia-160m", option, value],
           "--world-size and --phase are for a bindings or profile file")
          for option, value in (("--world-size", "3"), ("--phase", "main"))],
        (["b.parquet", "--link-gbps", "1", "--plot", "b.parquet"],
         "--plot b.parquet: exists and is not a PNG file; refusing to overwrite it"),
        (["--project", "--shape", "pythia-160m", "--plot", "/proc/nfabric.png"],
         "--plot /proc/nfabric.png: cannot write in /proc"),
    ],
)
def test_bad_input_exits_2_with_one_line(files, args, text):
    assert_one_line_error(invoke(*args), text)


def test_projection_json_and_plot(files):
    r = invoke("--project", "--shape", "pythia-160m", "--latency-us", "5", "--no-codec",
               "--json", "--plot", "proj.png")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["params"] == 162_322_944  # Pythia-160M
    assert len(doc["rows"]) == 8 * 6
    row = next(x for x in doc["rows"] if x["world_size"] == 8 and x["link_gbps"] == 100.0)
    # the fp32 ring moves 2(W-1)/W of 4 bytes per parameter: at least 1.136 GB per rank
    assert row["fp32_ring_s"] > 2 * 7 / 8 * 4 * 162_322_944 / 12.5e9
    assert row["sign_sharded_s"] < row["fp32_ring_s"] / 5
    big = next(x for x in doc["rows"] if x["world_size"] == 1024 and x["link_gbps"] == 100.0)
    assert big["sign_sharded_s"] is None  # beyond the sign route's exact-count limit
    assert doc["route_world_size_limit"] == 255
    # Endpoint = a link, bandwidth-bound: sign-central moves (W-1)(n/8 + 2n/8) bytes through
    # the endpoint for even W (2-bit result), the ring 2(W-1)/W * 4n per rank, so central
    # loses once 3/8 >= 8/W, i.e. W >= 21.3 -> 22 (W = 21 is odd: a 1-bit result, still wins).
    sat = doc["saturation_world_size"]
    assert list(sat) == ["10", "25", "50", "100", "200", "400"]
    assert sat["10"] == 22
    # faster links make the ring's 2(W-1) latency hops matter more: saturation moves out
    assert list(sat.values()) == sorted(sat.values())
    assert any("alpha = 5 us" in a for a in doc["assumptions"])
    assert (files / "proj.png").read_bytes()[:4] == b"\x89PNG"


def test_link_speed_in_mbit_as_validate_takes_it(files):
    gbps = invoke("b.parquet", "--link-gbps", "0.1", "--latency-us", "50", "--json")
    mbit = invoke("b.parquet", "--link-mbit", "100", "--latency-us", "50", "--json")
    assert gbps.exit_code == mbit.exit_code == 0, mbit.output
    assert json.loads(mbit.output) == json.loads(gbps.output)
    assert_one_line_error(invoke("b.parquet", "--link-mbit", "100", "--link-gbps", "0.1"),
                          "give the link once")
    for bad in ("0", "inf", "nan"):
        assert_one_line_error(invoke("b.parquet", "--link-mbit", bad),
                              f"--link-mbit must be a finite number > 0, got {bad}")
