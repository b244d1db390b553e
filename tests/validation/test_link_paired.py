"""bench.link_paired: arms interleaved in the same ranks, ratios per round."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from bench.link_paired import (
    _rank,
    base_arm,
    main,
    median_interval,
    over_runs,
    per_round,
    pooled,
    report,
    report_runs,
    round_orders,
)
from nfabric_cli.ranks.functions import run_function_ranks
from tests.distutil import agreed


def test_rounds_leave_out_each_arms_first_step_and_ratios_are_per_round(capsys) -> None:
    assert per_round([9.0, 1.0, 3.0, 2.0, 5.0, 4.0], 2, 3) == [2.0, 4.0]  # step 0 left out
    times = {
        "fp32": [9.0] + [0.020] * 5,
        "static": [9.0, 0.010, 0.010, 0.016, 0.016, 0.016],
        "profile": [9.0, 0.011, 0.011, 0.016, 0.016, 0.016],
        "powersgd": [9.0] + [0.020] * 5,
    }
    probe = [{"step": 4, "to": "low-bit", "reason": "measured"}]
    row = report(20.0, {"times": times, "probe": probe}, 2, 3)
    assert row["static/fp32"] == 0.65 and row["static/fp32 range"] == [0.5, 0.8]
    # profile / min(fp32, static), round by round: 0.011 / 0.010, then 0.016 / 0.016
    assert row["profile/min(fp32,static)"] == 1.05
    assert row["profile/min(fp32,static) range"] == [1.0, 1.1]
    assert row["profile/min(fp32,static) of run medians"] == 1.0  # static 0.016, profile 0.016
    assert row["min(fp32,static)"] == "static"
    # the run's total (each arm's first step left out) holds what a median leaves out
    assert row["profile/min(fp32,static) of run totals"] == round(0.07 / 0.068, 3)
    times["profile"][2] = 0.200  # a probe's fp32 step on a slow link
    row = report(20.0, {"times": times, "probe": probe}, 2, 3)
    assert row["profile/min(fp32,static) of run medians"] == 1.0
    assert row["profile/min(fp32,static) of run totals"] == round(0.259 / 0.068, 3)
    times["profile"][2] = 0.011
    # fp32 and static trade wins (a per-round min would take 0.010, then 0.014: 1.121). The
    # min is the arm faster over the run, fp32 (median 0.014 against static's 0.016), in
    # every round: 0.011 / 0.012 and 0.016 / 0.014
    times["fp32"] = [9.0, 0.012, 0.012, 0.014, 0.014, 0.014]
    row = report(20.0, {"times": times, "probe": []}, 2, 3)
    assert row["min(fp32,static)"] == "fp32"
    assert row["profile/min(fp32,static)"] == round((0.011 / 0.012 + 0.016 / 0.014) / 2, 3)
    assert row["profile/min(fp32,static) of run medians"] == 1.143
    assert row["profile/powersgd"] == 0.675
    assert "gate: step 4 -> low-bit: measured" in capsys.readouterr().out
    # the monitor's route changes are printed too (they cost time on a slow link), the first
    # eight of them, and counted in the row
    monitor = [{"step": s, "scope": "head.*", "from": "sign", "to": "fp32", "reason": "spike"}
               for s in range(10)]
    row = report(20.0, {"times": times, "probe": [], "monitor": monitor}, 2, 3)
    out = capsys.readouterr().out
    assert row["monitor events"] == 10 and "monitor: step 7 head.*: sign -> fp32: spike" in out
    assert "monitor: step 8" not in out and "monitor: ... 2 more events" in out
    assert report(20.0, {"times": times, "probe": []}, 2, 3)["monitor events"] == 0  # older
    # a second static arm is reported against the first: the run's own floor
    twice = {**times, "static#2": [9.0, 0.011, 0.011, 0.016, 0.016, 0.016]}
    row = report(20.0, {"times": twice, "probe": []}, 2, 3)
    assert row["static#2/static"] == 1.05 and row["static#2/static range"] == [1.0, 1.1]
    assert base_arm("static#2") == "static" and base_arm("fp32") == "fp32"
    # the profile arm without the gate's probing, in the same run: what probing costs
    beside = {**times, "unprobed": [9.0, 0.010, 0.010, 0.016, 0.016, 0.016]}
    row = report(20.0, {"times": beside, "probe": []}, 2, 3)
    assert row["profile/unprobed"] == round((0.011 / 0.010 + 1.0) / 2, 3)
    assert "unprobed/fp32" in row and "unprobed/unprobed" not in row
    # the same routes with the monitor (unprobed) over static, round by round: what it costs
    slower = {**times, "unprobed": [9.0, 0.012, 0.012, 0.020, 0.020, 0.020]}
    row = report(20.0, {"times": slower, "probe": []}, 2, 3)
    assert row["unprobed/static"] == round((0.012 / 0.010 + 0.020 / 0.016) / 2, 3)
    alone = {n: t for n, t in slower.items() if n != "static"}
    assert "unprobed/static" not in report(20.0, {"times": alone, "probe": []}, 2, 3)


def test_reread_prints_a_saved_runs_report_without_running(tmp_path, monkeypatch, capsys) -> None:
    times = {"fp32": [9.0] + [0.020] * 5, "static": [9.0] + [0.010] * 5,
             "profile": [9.0] + [0.011] * 5}
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"config": {"rounds": 2, "block": 3},
                                 "rates": {"0": {"times": times, "probe": []}}}))
    monkeypatch.setattr("sys.argv", ["link_paired", "--reread", str(saved)])
    main()
    rows = [json.loads(ln) for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    assert [(r["mbit"], r["profile/min(fp32,static)"], r["min(fp32,static)"]) for r in rows] == [
        (0.0, 1.1, "static")]


def test_several_runs_of_a_rate_are_reported_over_the_runs(tmp_path, monkeypatch,
                                                          capsys) -> None:
    """`--repeat`: each run is reported, then per ratio the median over the runs of its
    per-round median, with the runs' values; a saved run of several reads back the same."""
    rows = [{"mbit": 50.0, "profile/min(fp32,static)": r, "min(fp32,static)": "static",
             "profile/min(fp32,static) range": [0.9, 1.2]} for r in (1.07, 1.01, 1.03)]
    assert over_runs(rows) == {"mbit": 50.0, "runs": 3, "profile/min(fp32,static)": 1.03,
                               "profile/min(fp32,static) over runs": [1.07, 1.01, 1.03]}
    runs = [{"times": {"fp32": [9.0] + [0.020] * 5, "static": [9.0] + [0.010] * 5,
                       "profile": [9.0] + [p] * 5}, "probe": []} for p in (0.011, 0.0105)]
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"config": {"rounds": 2, "block": 3}, "rates": {"50": runs}}))
    monkeypatch.setattr("sys.argv", ["link_paired", "--reread", str(saved)])
    main()
    out = capsys.readouterr().out
    assert "== 50 Mbit/s, over 2 runs (fresh processes)" in out
    assert "profile/min(fp32,static)   1.075  [1.050, 1.100]" in out
    (row,) = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    assert row["runs"] == 2 and row["profile/min(fp32,static) over runs"] == [1.1, 1.05]
    # and their rounds pooled: 1.1, 1.1, 1.05, 1.05 (four rounds: no 90 % interval yet)
    assert "== 50 Mbit/s, the 2 runs' 4 rounds pooled:" in out
    assert row["profile/min(fp32,static) pooled"] == 1.075
    assert row["profile/min(fp32,static) pooled range"] == [1.05, 1.1]


def test_pooled_rounds_are_not_the_median_of_the_runs_medians(capsys) -> None:
    """Three runs whose rounds read 1.0, 1.0 / 1.2, 1.2 / 1.1, 1.3: the runs' medians are
    1.0, 1.2, 1.2 (their median 1.2), the six rounds' median 1.15. Each run divides by its
    own faster arm (run 3: fp32, faster than static there)."""
    def run(p1: float, p2: float, fp32: float = 0.020) -> dict:
        return {"times": {"fp32": [9.0] + [fp32] * 5, "static": [9.0] + [0.010] * 5,
                          "profile": [9.0, p1, p1, p2, p2, p2]}, "probe": []}

    runs = [run(0.010, 0.010), run(0.012, 0.012), run(0.0099, 0.0117, fp32=0.009)]
    assert pooled(runs, 2, 3)["profile/min(fp32,static)"] == pytest.approx(
        [1.0, 1.0, 1.2, 1.2, 1.1, 1.3])
    row = report_runs(50.0, runs, 2, 3)
    assert row["profile/min(fp32,static)"] == 1.2 and row["profile/min(fp32,static) pooled"] == 1.15
    assert row["profile/min(fp32,static) pooled interval"] == [1.0, 1.3, 0.969]  # n = 6
    assert "profile/fp32 pooled" in row  # every ratio the runs have
    out = capsys.readouterr().out
    assert "profile/min(fp32,static) pooled median 1.150  [1.000, 1.300] over rounds" in out


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_arm_orders_balance_position_and_predecessor(n: int) -> None:
    names = ["fp32", "static", "profile", "powersgd", "fp16"][:n]
    rows = [round_orders(names, r) for r in range(2 * n)]
    assert all(sorted(row) == sorted(names) for row in rows)
    # over 2n rounds every arm sits in every position twice, and follows every other arm twice
    assert Counter((a, i) for row in rows for i, a in enumerate(row)) == {
        (a, i): 2 for a in names for i in range(n)}
    follows = Counter((row[i], row[i + 1]) for row in rows for i in range(n - 1))
    assert follows == {(a, b): 2 for a in names for b in names if a != b}
    assert round_orders(names, 0) == round_orders(names, 2 * n)


def test_median_interval_is_the_binomial_order_statistics() -> None:
    # n = 12: P(B <= 2) = 0.0193 <= 0.05 < P(B <= 3) = 0.073, so [x_(3), x_(10)]
    lo, hi, cover = median_interval([float(x) for x in range(12, 0, -1)])
    assert (lo, hi) == (3.0, 10.0) and cover == pytest.approx(1 - 2 * 79 / 4096)
    # n = 16: P(B <= 4) = 0.0384, P(B <= 5) = 0.105: [x_(5), x_(12)]; 75 %: [x_(6), x_(11)]
    assert median_interval([float(x) for x in range(1, 17)])[:2] == (5.0, 12.0)
    assert median_interval([float(x) for x in range(1, 17)], level=0.75)[:2] == (6.0, 11.0)
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) == (1.0, 5.0, 1 - 2 / 32)
    assert median_interval([1.0, 2.0, 3.0, 4.0]) is None  # 1 - 2/16 < 0.9


@pytest.mark.slow
def test_every_arm_trains_its_blocks_in_the_same_ranks() -> None:
    cfg = {"workload": "vision", "seed": 0, "profile": "profiles/vision/vision.v5.parquet",
           "gate": "measure", "arms": ["fp32", "static", "profile", "unprobed", "static#2"],
           "rounds": 2, "block": 3}
    out = run_function_ranks(_rank, 2, cfg)
    assert out[0]["times"] == out[1]["times"]  # the slowest rank's time per step, agreed

    # the gate's probe may decide inside these 6 steps or not (it times them): when it does,
    # both ranks log the same decision, each under its own rank
    for kind in ("probe", "monitor"):
        assert agreed(out[0][kind]) == agreed(out[1][kind])
        assert all(e["rank"] == r for r in (0, 1) for e in out[r][kind] if "rank" in e)
    assert {k: len(v) for k, v in out[0]["times"].items()} == {
        "fp32": 6, "static": 6, "profile": 6, "unprobed": 6, "static#2": 6}
    assert all(t > 0 for v in out[0]["times"].values() for t in v)
    assert isinstance(out[0]["monitor"], list)  # the profile arm's other events
