"""`nfabric replay`: a real record -> replay round trip, the substrate it writes, bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nfabric_cli.app import app
from nfabric_cli.replay.plan import sweep_sizes
from nfabric_cli.routes.spec import FP32, RouteSpec
from nfabric_cli.substrate.cost import predict_route
from nfabric_cli.substrate.model import load_substrate
from tests.replay.test_trace import BODY_STEP0

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def bad_input(result, *fragments: str) -> None:
    """Exit 2, exactly one line on stderr containing every fragment, no traceback."""
    assert result.exit_code == 2, (result.stdout, result.stderr)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_round_trip_central_what_if_writes_a_substrate_others_accept(
    trace_copy: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    out = tmp_path / "fitted.toml"
    r = run("replay", trace_copy, "--topology", "central", "--repeats", 2, "--out", out, "--json")
    assert r.exit_code == 0, r.stderr
    rep = json.loads(r.stdout)
    assert (rep["world_size"], rep["trace_world_size"], rep["topology"]) == (2, 2, "central")
    assert sorted((g["route"], g["numel"], g["segments"]) for g in rep["groups"]) == [
        ("fp32", 132, 2), ("fp32", 132, 2), ("sign/central", 1664, 6), ("sign/central", 1664, 6)]
    for g in rep["groups"]:
        assert g["measured_s"] > 0 and g["predicted_s"] > 0
        assert g["error"] == pytest.approx(g["predicted_s"] / g["measured_s"] - 1)
        if g["route"] == "fp32":
            assert g["recorded_s"] > 0 and "verdict" not in g  # ran as recorded; no twin
            continue
        assert g["recorded_s"] is None  # a what-if: the run never used the central reducer
        assert g["fp32_measured_s"] > 0 and g["verdict"] in ("admit", "fallback")
        assert g["agrees"] == (g["verdict"] == g["measured_verdict"])
    sign = [g for g in rep["groups"] if g["route"] == "sign/central"]
    # two sign groups in one bucket (two regions): each keeps its own sampled payload
    assert sorted(tuple(sorted(g["inputs"].items())) for g in sign) == [
        (("payload", 2),), (("payload", 2),)]
    assert rep["warnings"] == []
    fit = rep["fit"]
    assert fit["samples"] == 2 + 2 + len(sweep_sizes(2, None))  # fp32 groups, twins, sweep
    assert fit["alpha_s"] >= 0 and fit["beta_s_per_byte"] > 0
    assert fit["endpoint_gbps"] is None  # 208-byte gathers are latency: no endpoint evidence
    assert [len(rep["sweep"])] == [len(sweep_sizes(2, None))]

    sub = load_substrate(out)
    assert sub.to_dict() == rep["substrate"]
    assert (sub.world_size, sub.topology, sub.shared_link) == (2, "central", True)
    assert sub.alpha_s == float(f"{fit['alpha_s']:.4g}")
    assert all("sign" in getattr(sub, t) for t in ("encode_gbps", "reduce_gbps", "decode_gbps"))
    # The codec sweep (random data, 1,000 to 100,000 elements) fits the fixed cost per call
    # and the latency of each collective kind the central sign reducer issues.
    assert [(c["route"], c["numel"]) for c in rep["codec_sweep"]] == [
        ("sign/central", n) for n in (1000, 4642, 21544, 100000)]
    assert set(fit["codec_call_us"]) == {"sign"} and fit["codec_call_us"]["sign"] >= 0
    assert set(fit["latency_us_by_kind"]) == {"all_gather", "gather", "broadcast"}
    assert (sub.codec_call_us, sub.latency_us_by_kind) == (fit["codec_call_us"],
                                                           fit["latency_us_by_kind"])
    # record -> replay -> file -> load: the loaded file predicts exactly what replay reported.
    specs = {"fp32": FP32, "sign/central": RouteSpec("sign", reducer="central")}
    for row in rep["groups"] + rep["codec_sweep"]:
        spec = specs[row.get("route", "fp32")]
        assert predict_route(spec, row["numel"], 2, sub) == pytest.approx(row["predicted_s"],
                                                                          rel=1e-12)

    # The file is a substrate the other commands take.
    cap = run("capacity", "--project", "--shape", "pythia-160m", "--substrate", out, "--json")
    assert cap.exit_code == 0, cap.stderr
    from nfabric_cli.binding import static_profile
    from nfabric_cli.profile import write_profile
    from tests.runtime.models import make_model

    prof = write_profile(static_profile(make_model(), "sign", [("head.*", "fp32")]),
                         tmp_path / "tiny.v1.parquet")
    comp = run("compile-profile", prof, "--model", "tests.runtime.models:make_model",
               "--substrate", out, "--world-size", 2, "--json")
    assert comp.exit_code == 0, comp.stderr

    from nfabric_cli.cli.common import console
    from nfabric_cli.cli.replay import _render

    monkeypatch.setattr(console, "width", 160)
    _render(rep)
    text = capsys.readouterr().out
    assert "sign/central" in text and f"substrate: {out}" in text
    assert "codec fixed cost per call, us: sign" in text
    assert "latency per round, us: all_gather" in text
    assert "recorded payloads on 8 of 8 rank-groups" in text


@pytest.mark.parametrize("args, fragments", [
    (["--world-size", 1], ["world size must be >= 2"]),
    (["--world-size", 256], ["sign/sharded aggregates exactly only up to 255 ranks"]),
    (["--topology", "ring"], ["unknown topology 'ring'"]),
    (["--repeats", 0], ["--repeats must be >= 1"]),
    (["--link-mbit", 0], ["--link-mbit"]),
    (["--link-mbit", -5], ["--link-mbit"]),
])
def test_bad_options(recorded: Path, args, fragments) -> None:
    bad_input(run("replay", recorded, *args), *fragments)


def test_bad_trace_directories(trace_copy: Path, tmp_path: Path) -> None:
    bad_input(run("replay", tmp_path / "nope"), "trace directory not found")
    (tmp_path / "file").write_text("x")
    bad_input(run("replay", tmp_path / "file"), "is not a directory")
    (tmp_path / "empty").mkdir()
    bad_input(run("replay", tmp_path / "empty"), "not an nfabric trace")
    meta = json.loads((trace_copy / "trace.json").read_text())
    (trace_copy / "trace.json").write_text(json.dumps({**meta, "version": "2.1"}))
    bad_input(run("replay", trace_copy), "trace version 2.1 is incompatible")
    (trace_copy / "trace.json").write_text(json.dumps({**meta, "format": "other"}))
    bad_input(run("replay", trace_copy), "not an nfabric trace (trace.json format")


def test_an_out_that_is_another_file_or_unwritable_is_refused_before_anything_runs(
    recorded: Path, tmp_path: Path
) -> None:
    spec = tmp_path / "vision.toml"
    spec.write_text('workload = "vision"\n')
    bad_input(run("replay", recorded, "--out", spec), f"--out {spec}: exists and is not a "
              "substrate TOML file; refusing to overwrite it")
    assert spec.read_text() == 'workload = "vision"\n'
    bad_input(run("replay", recorded, "--out", "/proc/nfabric.toml"),
              "--out /proc/nfabric.toml: cannot write in /proc")


def test_link_without_root_is_refused_before_anything_runs(tmp_path: Path) -> None:
    # As root, drop the effective uid for this one call (a real unprivileged check, undone
    # after): the refusal comes before the trace is even read.
    root = os.geteuid() == 0
    if root:
        os.seteuid(65534)
    try:
        r = run("replay", tmp_path / "not-read", "--link-mbit", 100)
    finally:
        if root:
            os.seteuid(0)
    bad_input(r, "--link-mbit needs root (it creates a network namespace and a tc qdisc)")


def test_body_segments_constant_matches_the_model() -> None:
    from tests.runtime.models import make_model

    body = [p.numel() for n, p in make_model().named_parameters() if n.startswith("body")]
    assert sorted(body) == sorted(BODY_STEP0)
