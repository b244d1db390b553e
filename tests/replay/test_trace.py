"""A recorded trace loads into the groups the run executed; plans; aggregation of rank results."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from nfabric_cli.errors import InputError
from nfabric_cli.replay.plan import (
    ROLE_CODEC,
    ROLE_SWEEP,
    ROLE_TRACE,
    ROLE_TWIN,
    build_plan,
    codec_sweep_sizes,
    sweep_sizes,
)
from nfabric_cli.replay.run import aggregate, check_payloads
from nfabric_cli.replay.timed import Stages
from nfabric_cli.replay.trace import load_payload, load_trace
from nfabric_cli.routes.spec import FP32, RouteSpec
from tests.replay.record import STEPS

# The tiny model's gradient bucket: the body (sign) in DDP's first-step order, then reversed
# after DDP's bucket rebuild; the head (fp32) likewise.
BODY_STEP0 = (512, 32, 1024, 32, 32, 32)
HEAD_STEP0 = (128, 4)


def test_recorded_trace_groups_match_the_run(recorded: Path) -> None:
    trace = load_trace(recorded)
    assert (trace.version, trace.world_size, trace.backend) == ("1.0", 2, "gloo")
    got = {(g.label, g.segments): g for g in trace.groups}
    assert set(got) == {
        ("sign/sharded", BODY_STEP0), ("sign/sharded", BODY_STEP0[::-1]),
        ("fp32", HEAD_STEP0), ("fp32", HEAD_STEP0[::-1]),
    }
    first, later = got["sign/sharded", BODY_STEP0], got["sign/sharded", BODY_STEP0[::-1]]
    assert (first.numel, first.rows, later.rows) == (1664, 2, 2 * (STEPS - 1))
    # Payloads: the first two steps of each rank, ordered by (step, rank).
    assert first.payloads == ("payloads/rank0-step0-bucket0-g0-sign.npy",
                              "payloads/rank1-step0-bucket0-g0-sign.npy")
    # after the rebuild the head's fp32 group comes first in the bucket: sign is group 1
    assert later.payloads == ("payloads/rank0-step1-bucket0-g1-sign.npy",
                              "payloads/rank1-step1-bucket0-g1-sign.npy")
    assert all(g.recorded_s > 0 for g in trace.groups)
    arr, why = load_payload(recorded, first.payloads[1], 1664)
    assert why == "" and arr.dtype == np.float32 and arr.shape == (1664,)
    assert np.isfinite(arr).all()


def test_plan_what_if_world_size_and_payload_cycling(recorded: Path) -> None:
    trace = load_trace(recorded)
    plan = build_plan(trace, world_size=3, topology="central", repeats=2)
    roles = [c.role for c in plan.cases]
    assert roles.count(ROLE_TRACE) == 4 and roles.count(ROLE_TWIN) == 2
    assert [c.numel for c in plan.cases if c.role == ROLE_SWEEP] == sweep_sizes(3, None)
    # One codec sweep per distinct compressed route: random data, 1,000 up to 100x that (the
    # largest recorded sign group has only 1,664 elements), log-spaced.
    codec = [c for c in plan.cases if c.role == ROLE_CODEC]
    assert [(c.route, c.numel, c.segments, c.payloads) for c in codec] == [
        (RouteSpec("sign", reducer="central"), n, [n], []) for n in (1000, 4642, 21544, 100000)]
    sign = [c for c in plan.cases if c.role == ROLE_TRACE and c.spec["name"] == "sign"]
    assert {c.route for c in sign} == {RouteSpec("sign", reducer="central")}
    assert all(c.recorded_s is None for c in sign)  # another world size: not what ran
    for c in plan.cases:
        if c.role == ROLE_TWIN:
            twin = plan.cases[c.twin_of]
            assert (c.route, c.numel, twin.spec["name"]) == (FP32, twin.numel, "sign")
    c = next(c for c in sign if tuple(c.segments) == BODY_STEP0)
    assert [c.payload_for(r) for r in range(3)] == [c.payloads[0], c.payloads[1], c.payloads[0]]
    same = build_plan(trace, repeats=1)
    assert all(c.recorded_s is not None for c in same.cases if c.role == ROLE_TRACE)
    # Sweep: from 1 element up to ~0.2 s at the nominal link (sizes for a slow link stop early).
    assert sweep_sizes(4, 50.0) == [1, 256, 1024, 4096, 16384]
    assert sweep_sizes(2, None)[-1] == 1 << 22
    # A codec sweep reaches the largest recorded group, cut to ~0.2 s on a slow link.
    sign = RouteSpec("sign")
    assert codec_sweep_sizes(sign, 4, 50.0, 262656) == [1000, 6404, 41013, 262656]
    assert codec_sweep_sizes(sign, 4, 1.0, 10**7)[-1] < 10**6
    assert codec_sweep_sizes(sign, 4, 0.001, 10**7) == [1000]


def test_unusable_payloads_are_reported_and_replaced(trace_copy: Path) -> None:
    plan = build_plan(load_trace(trace_copy))
    assert check_payloads(plan) == []
    (trace_copy / "payloads/rank1-step0-bucket0-g0-sign.npy").unlink()
    # A truncated sample (e.g. a disk that filled up mid-write elsewhere).
    np.save(trace_copy / "payloads/rank0-step0-bucket0-g0-sign.npy", np.zeros(7, np.float32))
    (trace_copy / "payloads/rank0-step1-bucket0-g0-fp32.npy").write_bytes(b"junk")
    warnings = check_payloads(plan)
    assert warnings[:2] == [
        "payload payloads/rank0-step0-bucket0-g0-sign.npy: 7 elements, but its trace row says "
        "1664: random data used",
        "payload payloads/rank1-step0-bucket0-g0-sign.npy: missing: random data used",
    ]
    assert len(warnings) == 3
    assert warnings[2].startswith("payload payloads/rank0-step1-bucket0-g0-fp32.npy: not a "
                                  "readable .npy payload")
    assert load_payload(trace_copy, "payloads/rank1-step0-bucket0-g0-sign.npy", 1664)[0] is None


def test_aggregate_takes_the_slowest_rank_and_rank0_collectives() -> None:
    plan = build_plan_stub()
    ev = lambda a, b: [["all_gather", 64, a, a + 0.001], ["all_to_all", 512, b, b + 0.002],  # noqa: E731
                       ["all_gather", 128, b + 0.003, b + 0.004]]
    ranks = [
        {"cases": [{"seconds": [0.010, 0.030, 0.012], "events": [ev(0.001, 0.003)] * 3,
                    "input": "payload"}]},
        {"cases": [{"seconds": [0.011, 0.020, 0.040], "events": [ev(0.002, 0.004)] * 3,
                    "input": "random"}]},
    ]
    (res,) = aggregate(plan, ranks)
    assert res.measured_s == pytest.approx(0.030)  # median of per-repeat maxima .011 .030 .040
    assert res.inputs == {"payload": 1, "random": 1}
    assert [(k, n) for k, n, _ in res.ops] == [("all_gather", 64), ("all_to_all", 512),
                                               ("all_gather", 128)]
    assert res.ops[1][2] == pytest.approx(0.002)
    assert res.op_medians == (pytest.approx(0.001), pytest.approx(0.002), pytest.approx(0.001))
    # Stages per rank (median over repeats), then the slowest rank per stage: rank 1 encodes
    # 0.002 + 0.001 before its all-to-all, both combine 0.001, rank 1 decodes from 0.008 to its
    # median 0.020.
    assert res.stages == Stages(pytest.approx(0.003), pytest.approx(0.001),
                                pytest.approx(0.012), pytest.approx(0.004))


def build_plan_stub():
    from nfabric_cli.replay.plan import ReplayCase, ReplayPlan

    case = ReplayCase(ROLE_TRACE, RouteSpec("sign").to_dict(), 1000, [1000])
    return ReplayPlan("/nonexistent", 2, 3, [case])


@pytest.mark.parametrize("edit, message", [
    (lambda d: (d / "trace.json").unlink(), "not an nfabric trace (no trace.json)"),
    (lambda d: (d / "trace.json").write_text("{"), "malformed JSON"),
    (lambda d: _meta(d, format="other"), "not an nfabric trace (trace.json format"),
    (lambda d: _meta(d, version="2.0"), "trace version 2.0 is incompatible (this nfabric reads 1.x)"),
    (lambda d: _meta(d, world_size=0), "world_size must be an integer >= 1"),
    (lambda d: [p.unlink() for p in d.glob("*.parquet")], "no buckets-rank*.parquet"),
    (lambda d: (d / "buckets-rank0.parquet").write_text("x"), "not a readable Parquet file"),
    # a rank's file left by an earlier recording at three ranks: fitting it in would mix runs
    (lambda d: shutil.copy(d / "buckets-rank1.parquet", d / "buckets-rank2.parquet"),
     "buckets-rank2.parquet lie beyond trace.json's world size 2 (left by another recording?)"),
])
def test_unusable_trace_directories(trace_copy: Path, edit, message: str) -> None:
    edit(trace_copy)
    with pytest.raises(InputError) as err:
        load_trace(trace_copy)
    assert message in str(err.value)


def _meta(d: Path, **changes) -> None:
    meta = json.loads((d / "trace.json").read_text())
    (d / "trace.json").write_text(json.dumps({**meta, **changes}))
