"""Summary numbers, pass/fail and report files from hand-made per-rank records."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from nfabric_cli.validation.report import (
    MARKER,
    STEP_COLUMNS,
    claim_report,
    judge,
    step_frame,
    summarize,
    write_report,
)


def record(arm, rank, *, sent, received, times, metric=None, events=(), link=None):
    n = len(times)
    return {
        "arm": arm, "rank": rank, "loss": [1.0 - 0.1 * i for i in range(n)],
        "step_time_s": list(times), "sent": [sent] * n, "received": [received] * n,
        "fp32_reference": None, "events": list(events), "metric": metric, "link": link,
    }  # fmt: skip


EVENT = {"step": 2, "scope": "all", "from": "sign", "to": "fp32", "reason": "loss spike"}
SKIP = {"step": 2, "scope": "all", "from": "update", "to": "skipped", "reason": "nonfinite"}


def gathered():
    """Two ranks, three steps; fp32 100+100 bytes/step, profile 4+6 on rank 0 and 6+4 on rank 1."""
    ranks = []
    for rank in (0, 1):
        m = (lambda v: v) if rank == 0 else (lambda v: None)
        ranks.append([
            record("fp32", rank, sent=100, received=100, times=[9.0, 0.2, 0.4], metric=m(0.90),
                   link={"tx": 700, "packets": 9} if rank == 0 else None),
            record("profile", rank, sent=4 + 2 * rank, received=6 - 2 * rank,
                   times=[5.0, 0.05 + rank * 0.01, 0.03], metric=m(0.895),
                   events=[{**EVENT, "rank": rank}, {**SKIP, "rank": rank}],
                   link={"tx": 40, "packets": 2, "retransmits": 1} if rank == 0 else None),
            record("static", rank, sent=3, received=3, times=[1.0, 1.0, 1.0], metric=m(float("nan"))),
        ])  # fmt: skip
    return ranks


def test_summary_numbers():
    s = summarize(gathered(), workload="w", higher_is_better=True, tolerance=0.01, link_mbit=20.0)
    assert list(s) == [
        "passed", "workload", "world_size", "steps", "higher_is_better", "tolerance", "arms",
        "events", "link_mbit",
    ]  # fmt: skip
    assert (s["world_size"], s["steps"], s["link_mbit"]) == (2, 3, 20.0)
    fp32, prof, static = s["arms"]["fp32"], s["arms"]["profile"], s["arms"]["static"]
    assert set(fp32) == {
        "metric", "metric_delta", "bytes_per_step", "traffic_fraction", "step_time_s",
        "fallbacks", "link_bytes",
    }  # fmt: skip
    assert fp32["bytes_per_step"] == 200.0 and fp32["traffic_fraction"] == 1.0
    assert prof["bytes_per_step"] == 10.0
    assert prof["traffic_fraction"] == pytest.approx(60 / 1200)
    # median over steps 1.. of the slowest rank: fp32 [0.2, 0.4] -> 0.3, profile [0.06, 0.03]
    assert fp32["step_time_s"] == pytest.approx(0.3)
    assert prof["step_time_s"] == pytest.approx(0.045)
    assert prof["metric_delta"] == pytest.approx(-0.005)
    assert prof["fallbacks"] == 1  # the skip is an event, not a fallback
    assert static["metric"] is None and static["metric_delta"] is None  # diverged
    assert prof["link_bytes"] == {"claimed": 30, "measured_tx": 40, "packets": 2,
                                  "retransmits": 1, "ratio": pytest.approx(40 / 30)}  # fmt: skip
    assert [(e["step"], e["rank"], e["to"]) for e in s["events"]] == [
        (2, 0, "fp32"), (2, 0, "skipped"), (2, 1, "fp32"), (2, 1, "skipped"),
    ]  # fmt: skip
    assert s["passed"] is True
    json.dumps(s, allow_nan=False)  # strict JSON: no NaN anywhere


@pytest.mark.parametrize(
    ("higher", "delta", "tol", "passed"),
    [(True, -0.01, 0.01, True), (True, -0.0101, 0.01, False), (True, 0.2, 0.01, True),
     (False, 0.05, 0.05, True), (False, 0.0501, 0.05, False), (False, -1.0, 0.05, True),
     (True, None, 0.01, False)],
)  # fmt: skip
def test_judge(higher, delta, tol, passed):
    assert judge({"profile": {"metric_delta": delta}}, higher, tol) is passed


def test_no_profile_arm_has_nothing_to_judge():
    assert judge({"fp32": {"metric_delta": 0.0}}, True, 0.0) is True


def test_failed_summary_when_profile_outside_tolerance():
    s = summarize(gathered(), workload="w", higher_is_better=True, tolerance=0.001)
    assert s["passed"] is False and "link_mbit" not in s
    assert "link_bytes" not in s["arms"]["fp32"]


def test_report_files(tmp_path):
    g = gathered()
    s = summarize(g, workload="w", higher_is_better=True, tolerance=0.01)
    paths = write_report(tmp_path / "r", s, step_frame(g))
    frame = pd.read_parquet(paths["steps"])
    assert list(frame.columns) == STEP_COLUMNS
    assert len(frame) == 2 * 3 * 3  # ranks x arms x steps
    row = frame[(frame.arm == "profile") & (frame["rank"] == 1) & (frame.step == 2)].iloc[0]
    assert (row["bytes"], row["step_time_s"]) == (10, 0.03)
    assert math.isclose(row["loss"], 0.8)
    assert json.loads(paths["summary"].read_text()) == json.loads(json.dumps(s))
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_report_folder_used_again_loses_only_the_earlier_runs_outputs(tmp_path):
    ours = ["steps.parquet", "summary.json", "report.png", "records.json", "config.json",
            "logs/rank3.log", "logs/torchrun.node0.log", "seed-2/summary.json",
            "seed-11/steps.parquet"]
    theirs = ["notes.txt", "seed-x/keep.txt", "seed-5/mine.txt", "logs/mine.txt",
              ".run-node0/config.json"]
    for rel in ours + theirs:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    for marked in ("seed-2", "seed-11"):  # reports of earlier seeds; seed-5 is not one
        (tmp_path / marked / MARKER).write_text("")
    claim_report(tmp_path)  # not a report folder yet: nothing is removed, it is marked
    kept = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()}
    assert kept == {*ours, *theirs, MARKER, f"seed-2/{MARKER}", f"seed-11/{MARKER}"}
    claim_report(tmp_path)  # used again: the earlier run's outputs go
    kept = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()}
    assert kept == {*theirs, MARKER}
    assert not (tmp_path / "seed-2").exists() and not (tmp_path / "seed-11").exists()
    claim_report(tmp_path / "new")  # a new folder: made and marked
    assert (tmp_path / "new" / MARKER).is_file()
