"""The capacity gate in calibration: a substrate in the spec prices every simulated bucket the
way the hook's gate does, and the calibrated profile carries it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from nfabric_cli.app import app
from nfabric_cli.binding import compile_profile
from nfabric_cli.binding.fingerprint import trainable_parameters
from nfabric_cli.calibration import calibrate
from nfabric_cli.calibration.reduces import ddp_layouts
from nfabric_cli.calibration.simulate import simulate_run
from nfabric_cli.calibration.space import Config, config_profile, fp32_config
from nfabric_cli.calibration.traffic import gated, held_on_fp32, step_bytes, traffic_lower_bound
from nfabric_cli.errors import InputError
from nfabric_cli.profile import read_profile
from nfabric_cli.runtime.gate import CapacityGate
from nfabric_cli.workloads.registry import get_workload
from tests.calibration.helpers import TINY, tiny_spec, tiny_spec_dict, toml_text

STEPS = 4
#: Fast link, slow codec: 5 ms per sign reduce loses to one fp32 all-reduce of a tiny model.
REFUSES = {"link_gbps": 100.0, "latency_us": 5.0, "codec_call_us": {"sign": 5000.0}}
#: A 1 Mbit/s link: bytes dominate, low-bit always wins.
ADMITS = {"link_gbps": 0.001, "latency_us": 1.0}
#: 10 Mbit/s, 2 ms fixed per sign reduce: the tiny model's one sign reduce loses to fp32.
CALL_LOSES = {"link_gbps": 0.01, "latency_us": 10.0, "codec_call_us": {"sign": 2000.0},
              "encode_gbps": {"sign": 5.0}, "reduce_gbps": {"sign": 0.5},
              "decode_gbps": {"sign": 0.15}}


def _bindings(config: Config, substrate: dict | None, cap_mb: float | None = None):  # noqa: ANN202
    wl = get_workload(TINY)
    spec = tiny_spec(world_size=2, steps=STEPS, substrate=substrate or {})
    meta = {"world_size": 2, **({"substrate": spec.substrate} if spec.substrate else {})}
    return spec, compile_profile(config_profile(spec, config, meta), wl.build_model(0),
                                 world_size=2, bucket_cap_mb=cap_mb, total_steps=STEPS)


SIGN = Config((("sign", "sign"), ("sign", "sign")), (0.3,), 0.5, True)


def _run(bindings):  # noqa: ANN001, ANN202
    return simulate_run(get_workload(TINY), bindings, 2, STEPS, 0, checkpoints=(STEPS,),
                        processes=1)


def test_a_refused_bucket_trains_exactly_as_fp32_and_counts_fp32_traffic() -> None:
    spec, refused = _bindings(SIGN, REFUSES)
    _, fp32 = _bindings(fp32_config(spec), None)
    got, want = _run(refused), _run(fp32)
    assert got.traffic_fraction == 1.0
    for p, q in zip(got.model.parameters(), want.model.parameters(), strict=True):
        assert torch.equal(p, q)
    gate = CapacityGate(refused.meta["substrate"], 2)
    assert traffic_lower_bound(refused, 2, STEPS, gate) == 1.0
    assert traffic_lower_bound(refused, 2, STEPS) < 0.2  # without the gate: sign's bytes


def test_an_admitted_bucket_trains_as_if_there_were_no_gate() -> None:
    _, admitted = _bindings(SIGN, ADMITS)
    _, plain = _bindings(SIGN, None)
    got, want = _run(admitted), _run(plain)
    assert got.traffic_fraction == want.traffic_fraction < 0.2
    for p, q in zip(got.model.parameters(), want.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_the_gate_decides_per_bucket() -> None:
    """Buckets of a 500-byte cap on a 24 Mbit/s link with a 0.5 ms codec cost per call: the gate
    refuses the small buckets (fp32 sends them faster) and keeps the big ones."""
    sub = {"link_gbps": 0.024, "latency_us": 10.0, "codec_call_us": {"sign": 500.0}}
    _, b = _bindings(SIGN, sub, cap_mb=0.0005)
    assert len(b.buckets) >= 2
    gate = CapacityGate(b.meta["substrate"], 2)
    phase = b.phases[-1].name
    routes = gated(b, phase, lambda n: b.params[n].routes[phase], gate)
    refused = [k.params for k in b.buckets if all(routes(n).name == "fp32" for n in k.params)]
    kept = [k.params for k in b.buckets if all(routes(n).name == "sign" for n in k.params)]
    assert refused and kept and len(refused) + len(kept) == len(b.buckets)
    sizes = {tuple(k.params): k.numel for k in b.buckets}
    assert max(sizes[tuple(p)] for p in refused) < min(sizes[tuple(p)] for p in kept)
    # the run counts each step on DDP's buckets: after the first step the planned ones here,
    # at the first step one bucket (DDP reduces it in one bucket per dtype), which the gate
    # prices as the hook does: big enough to keep
    wl = get_workload(TINY)
    model = wl.build_model(0)
    names = [tp.name for tp in trainable_parameters(model)]
    first, rebuilt = ddp_layouts(wl, model, names, 2, 0, b.bucket_cap_mb).named(names)
    assert len(first) == 1 and {frozenset(k) for k in rebuilt} == {frozenset(p) for p in sizes}
    at_first = step_bytes(b, 2, phase, gated(b, phase, lambda n: b.params[n].routes[phase],
                                             CapacityGate(b.meta["substrate"], 2), first), first)
    later = step_bytes(b, 2, phase, routes, rebuilt)
    assert at_first.sent < at_first.fp32 / 10  # the one bucket went on sign
    run = _run(b)
    assert run.traffic_fraction == pytest.approx(
        (at_first.sent + (STEPS - 1) * later.sent) / (at_first.fp32 + (STEPS - 1) * later.fp32),
        rel=1e-12)


def test_gated_refuses_exactly_what_compile_profile_refuses() -> None:
    """Head and body are two sign regions side by side in one bucket: the hook issues one
    612-element sign reduce for both. On 10 Mbit/s with 2 ms fixed per reduce it does not pay
    (2.02 ms vs fp32 1.98 ms): compile-profile and the simulator's gate both price that reduce
    and refuse the bucket; on a 1 Mbit/s link both admit it."""
    for sub, expected in ((CALL_LOSES, "fallback"), (ADMITS, "admit")):
        _, b = _bindings(SIGN, sub)
        gate = CapacityGate(b.meta["substrate"], 2)
        (bucket,) = b.buckets
        for phase in b.phase_names():
            assert [(g.regions, g.reduces()) for g in b.bucket_groups(0, phase)] == [
                (("head.*",) * 2 + ("*",) * 4, [tuple(range(6))])]
            routes = gated(b, phase, held_on_fp32(b, phase, ()), gate)
            refused = {n for n in b.params if routes(n).name == "fp32"}
            assert bucket.verdicts[phase] == expected
            assert refused == (set(bucket.params) if expected == "fallback" else set())
            assert gate.decided()[(tuple(bucket.params), phase)].reason == bucket.reasons[phase]
    _, b = _bindings(SIGN, CALL_LOSES)
    assert b.buckets[0].reasons["main"] == (
        "codec call overhead: codec 2.02 ms (2 ms fixed per call) vs fp32 1.98 ms (0.94x)")


def test_spec_substrate_table_path_and_bad_values(tmp_path: Path) -> None:
    spec = tiny_spec(substrate={"link_gbps": 10.0})
    assert spec.substrate["link_gbps"] == 10.0
    assert spec.search_key() != tiny_spec().search_key()
    with pytest.raises(InputError, match="link_gbps"):
        tiny_spec(substrate={"link_gbps": -1.0})
    (tmp_path / "fabric.toml").write_text("link_gbps = 0.5\nlatency_us = 50.0\n")
    data = tiny_spec_dict(substrate="fabric.toml")
    (tmp_path / "spec.toml").write_text(toml_text(data))
    from nfabric_cli.calibration.spec import load_spec

    assert load_spec(tmp_path / "spec.toml", "tiny").substrate["latency_us"] == 50.0


def test_calibrated_profile_carries_the_substrate(tmp_path: Path) -> None:
    wl = get_workload(TINY)
    spec = tiny_spec(trials=2, substrate=REFUSES)
    _, out = calibrate(wl, spec, f"sqlite:///{tmp_path}/s.db", "g", tmp_path / "p", processes=1)
    meta = read_profile(out.path).meta
    assert meta["substrate"]["codec_call_us"] == {"sign": 5000.0}
    assert out.best["traffic_fraction"] == 1.0  # the gate refuses every low-bit bucket


def test_cli_substrate_flag_bad_file_exits_2(tmp_path: Path) -> None:
    (tmp_path / "bad.toml").write_text("link_gbps = 0\n")
    res = CliRunner().invoke(app, ["calibrate", TINY, "--substrate", str(tmp_path / "bad.toml"),
                                   "--storage", f"sqlite:///{tmp_path}/s.db"])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "link_gbps" in lines[0], res.output
