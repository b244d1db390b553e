"""`nfabric validate` end to end on real 2-rank gloo runs of the tiny workload.

Process start-up (importing torch in every rank) dominates, so each launch checks many things:
one spawn run covers every arm, the baselines, an injected NaN and the report files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest

from nfabric_cli.binding import compile_profile, static_profile
from nfabric_cli.runtime.inject import KILL_EXIT_CODE
from tests.validation.common import (
    REPO,
    TINY,
    alive_workers,
    env,
    free_port,
    head_fp32_profile,
    nfabric,
    nfabric_cmd,
    rank_pids,
    summary,
)
from tests.validation.tiny import TinyWorkload

pytestmark = pytest.mark.slow  # real multi-process runs
STEPS = 6


@pytest.fixture(scope="module")
def prof(tmp_path_factory):
    return head_fp32_profile(tmp_path_factory.mktemp("prof") / "tiny.v1.parquet")


def powersgd_elements(model, rank: int = 2, min_rate: float = 2.0) -> int:
    """Elements PowerSGD all-reduces per step once compressing: per its documented rule, a
    matrix (n, m) goes as P (n x r) and Q (m x r) when n*m > (n+m)*r*min_rate, else whole."""
    total = 0
    for p in model.parameters():
        n = p.shape[0]
        m = p.numel() // n
        r = min(n, m, rank)
        total += (n + m) * r if n * m > (n + m) * r * min_rate else n * m
    return total


@pytest.fixture(scope="module")
def all_arms(prof, tmp_path_factory):
    report = tmp_path_factory.mktemp("all") / "report"
    # an earlier recording at three ranks in the trace folder, and a file of the user's
    (report.parent / "trace" / "payloads").mkdir(parents=True)
    for stale in ("buckets-rank2.parquet", "payloads/rank2-step0-bucket0-g0-int8.npy"):
        (report.parent / "trace" / stale).write_bytes(b"x")
    (report.parent / "trace" / "notes.txt").write_text("mine")
    r = nfabric(
        "validate", prof, "--workload", TINY, "--steps", STEPS, "--baselines", "fp16,powersgd",
        "--inject", "nan@2:0,nan@3:1", "--report", report, "--record-trace", report.parent / "trace",
        "--json",
    )  # fmt: skip
    return r, report


def test_record_trace_writes_a_replayable_trace_of_the_profile_arm(all_arms):
    from nfabric_cli.replay.trace import load_trace

    _, report = all_arms
    trace = load_trace(report.parent / "trace")  # the earlier recording's files removed
    assert trace.world_size == 2
    assert sorted(p.name for p in (report.parent / "trace").glob("buckets-rank*")) == [
        "buckets-rank0.parquet", "buckets-rank1.parquet"]
    assert not list((report.parent / "trace").glob("payloads/rank2-*"))
    assert (report.parent / "trace" / "notes.txt").read_text() == "mine"
    labels = {g.label for g in trace.groups}
    assert "sign/sharded" in labels  # the profile arm's body; static arm traces nothing
    assert all(g.rows > 0 for g in trace.groups)


def test_every_arm_runs_and_reports(all_arms):
    r, report = all_arms
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s == summary(report)
    assert list(s["arms"]) == ["fp32", "static", "profile", "fp16", "powersgd"]
    assert (s["workload"], s["world_size"], s["steps"], s["higher_is_better"]) == (
        "tiny",
        2,
        STEPS,
        True,
    )
    assert s["tolerance"] == 0.01  # the profile has no target: accuracy-like default
    for arm in s["arms"].values():
        assert set(arm) == {
            "metric", "metric_delta", "bytes_per_step", "traffic_fraction", "step_time_s", "fallbacks"
        }  # fmt: skip
        assert arm["metric"] is not None and 0.0 <= arm["metric"] <= 1.0  # finite, after a NaN
        assert arm["step_time_s"] > 0
    assert s["passed"] == (s["arms"]["profile"]["metric_delta"] >= -0.01)
    frame = pd.read_parquet(report / "steps.parquet")
    assert list(frame.columns) == ["arm", "rank", "step", "loss", "step_time_s", "bytes"]
    assert len(frame) == 5 * 2 * STEPS
    # Same initial weights and the same first batch in every arm: identical first losses.
    first = frame[frame.step == 0].groupby("rank")["loss"].nunique()
    assert first.tolist() == [1, 1]
    assert (report / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_bytes_per_arm_are_exact(all_arms):
    _, report = all_arms
    s = summary(report)
    arms = s["arms"]
    model = TinyWorkload().build_model(0)
    numel = sum(p.numel() for p in model.parameters())
    fp32 = 2 * 4 * numel  # W=2 ring all-reduce: a rank sends and receives the whole buffer
    assert arms["fp32"]["bytes_per_step"] == fp32
    assert arms["fp16"]["bytes_per_step"] == fp32 / 2 and arms["fp16"]["traffic_fraction"] == 0.5
    start = 2  # max(2, 10 % of 6 steps)
    compressed = 2 * 4 * powersgd_elements(model)
    assert (
        arms["powersgd"]["bytes_per_step"] == (start * fp32 + (STEPS - start) * compressed) / STEPS
    )
    records = json.loads((report / "records.json").read_text())
    for rank_records in records:  # the fabric meters the same buckets at fp32 as the fp32 arm
        by_arm = {rec["arm"]: rec for rec in rank_records}
        assert by_arm["profile"]["fp32_reference"] == fp32 * STEPS
        assert by_arm["static"]["fp32_reference"] == fp32 * STEPS
    # static: the modelled sign bytes plus the small health-statistics all-reduce
    bindings = compile_profile(static_profile(model, "sign"), model, 2, bucket_cap_mb=None)
    modelled = bindings.bytes_per_step("all")[0]
    frame = pd.read_parquet(report / "steps.parquet")
    static = frame[frame.arm == "static"]
    first, rest = static[static.step == 0]["bytes"], static[static.step > 0]["bytes"]
    # from the second step on the round also carries the last step's bucket time (8 bytes
    # each way, gloo all-reduce of W = 2)
    assert first.nunique() == rest.nunique() == 1 and rest.iloc[0] - first.iloc[0] == 16
    assert 0 < first.iloc[0] - modelled < 256
    static = static["bytes"]
    # profile: low-bit until the second NaN (step 3) trips the monitor, fp32 (+ control) after
    profile = frame[(frame.arm == "profile") & (frame["rank"] == 0)]["bytes"].tolist()
    assert all(static.iloc[0] < b < 0.2 * fp32 for b in profile[:4])
    assert all(fp32 < b < fp32 + 256 for b in profile[4:])


def test_injected_nans_are_skipped_and_the_repeat_falls_back(all_arms):
    _, report = all_arms
    s = summary(report)
    assert s["arms"]["profile"]["fallbacks"] == 1
    assert s["arms"]["fp32"]["fallbacks"] == s["arms"]["fp16"]["fallbacks"] == 0
    hits = {(e["step"], e["rank"], e["to"]) for e in s["events"]}
    assert {(3, 0, "fp32"), (3, 1, "fp32"), (2, 0, "skipped"), (2, 1, "skipped"),
            (3, 0, "skipped"), (3, 1, "skipped")} <= hits
    assert not {(2, 0, "fp32"), (2, 1, "fp32")} & hits  # a lone NaN is only neutralised
    assert all(e["step"] >= 2 for e in s["events"])


def test_dead_rank_fails_fast_and_names_rank_and_step(prof, tmp_path):
    report = tmp_path / "r"
    r = nfabric(
        "validate", prof, "--workload", TINY, "--steps", 40, "--arms", "fp32",
        "--inject", "kill@5:1", "--timeout", 60, "--report", report,
    )  # fmt: skip
    done = time.time()
    assert r.returncode == 1
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert "rank 1 failed at step 5 (arm fp32, exit code 17)" in lines[0]
    assert KILL_EXIT_CODE == 17
    died = (report / ".run-node0" / "progress.1.json").stat().st_mtime  # written just before exit
    assert done - died < 5.0  # detected from the exit, not from --timeout
    assert not alive_workers(rank_pids(report))


def test_hung_rank_times_out_and_leaves_nothing(prof, tmp_path):
    report = tmp_path / "r"
    proc = subprocess.Popen(
        nfabric_cmd("validate", prof, "--workload", TINY, "--steps", 100000, "--arms", "fp32",
                    "--timeout", 3, "--report", report),
        cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    progress = report / ".run-node0" / "progress.1.json"
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                state = json.loads(progress.read_text())
            except (OSError, ValueError):
                state = {}
            if state.get("step", 0) >= 2 or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()
        os.kill(state["pid"], signal.SIGSTOP)  # KeyError: never reached step 2
        stopped = time.time()
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1
    assert time.time() - stopped < 3 + 10
    assert "made no progress for 3 s" in err and "(--timeout)" in err
    assert not alive_workers(rank_pids(report))


def test_torchrun_runs_validate_as_its_ranks(prof, tmp_path):
    report = tmp_path / "r"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "nfabric_cli", "validate", str(prof), "--workload", TINY, "--steps", "3",
        "--arms", "fp32,profile", "--tolerance", "1", "--report", str(report), "--json",
    ]  # fmt: skip
    r = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads(r.stdout)  # rank 0 prints the one summary
    assert s == summary(report)
    assert s["world_size"] == 2 and s["passed"] is True
    numel = sum(p.numel() for p in TinyWorkload().build_model(0).parameters())
    assert s["arms"]["fp32"]["bytes_per_step"] == 2 * 4 * numel


def test_torchrun_launcher_two_nodes_on_one_machine(prof, tmp_path):
    port = free_port()
    procs = []
    for node in (0, 1):
        extra = ["--json"] if node else []
        procs.append(subprocess.Popen(
            nfabric_cmd("validate", prof, "--workload", TINY, "--steps", 3, "--arms", "fp32,profile",
                        "--tolerance", 1, "--launcher", "torchrun", "--nnodes", 2, "--node-rank", node,
                        "--nproc-per-node", 1, "--rdzv-endpoint", f"127.0.0.1:{port}",
                        "--report", tmp_path / f"node{node}", *extra),
            cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        ))  # fmt: skip
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-1500:] for o in outs]
    a, b = summary(tmp_path / "node0"), summary(tmp_path / "node1")
    assert a["world_size"] == b["world_size"] == 2
    assert a["arms"] == b["arms"] and json.loads(outs[1][0]) == b  # one world, one report
    assert "fp32" in outs[0][0] and "passed" in outs[0][0]  # human output: the table
