"""The validation report: summary (the `--json` document), per-step Parquet, PNG.

From every rank's `ArmRecord`s:
- ``metric``: rank 0's evaluation after the arm's last step (None if not finite: diverged);
- ``metric_delta``: metric minus the fp32 arm's metric;
- ``bytes_per_step``: bytes one rank sends plus receives per step, mean over ranks;
- ``traffic_fraction``: the arm's bytes over the fp32 arm's bytes on the same steps, all ranks;
- ``step_time_s``: per step the slowest rank's wall time, median over steps after the first
  (the first step carries DDP's bucket rebuild and warm-up);
- ``fallbacks``: switches to fp32 (health monitor trips, capacity-gate revocations) on rank 0.
``events`` are the profile arm's events from every rank: switches, skips, and the
measured gate's decisions (a close call's "probe on" among them).
With a shaped link each arm also has ``link_bytes``: the bytes the ranks claim to have sent
(sum over ranks) next to what crossed the namespace's loopback (bytes and packets; the
difference is TCP/IP headers, ACKs and gloo's framing, a few dozen bytes per packet).
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
from pathlib import Path
from typing import Any

import pandas as pd

from nfabric_cli.atomic import atomic_path, atomic_write_text
from nfabric_cli.profile.target import within_tolerance
from nfabric_cli.runtime.controller import fallbacks

STEP_COLUMNS = ["arm", "rank", "step", "loss", "step_time_s", "bytes"]


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def by_arm(gathered: list[list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """arm -> its records, one per rank in rank order; arms in run order."""
    out: dict[str, list[dict[str, Any]]] = {}
    for rank_records in gathered:
        for rec in rank_records:
            out.setdefault(rec["arm"], []).append(rec)
    for recs in out.values():
        recs.sort(key=lambda r: r["rank"])
    return out


def arm_summary(recs: list[dict[str, Any]], reference: list[dict[str, Any]]) -> dict[str, Any]:
    """One arm's row of the summary (see module doc), against the fp32 arm's records."""
    steps = len(recs[0]["loss"])
    totals = [sum(r["sent"]) + sum(r["received"]) for r in recs]
    ref_total = sum(sum(r["sent"]) + sum(r["received"]) for r in reference)
    slowest = [max(r["step_time_s"][i] for r in recs) for i in range(steps)]
    timed = slowest[1:] or slowest
    rank0 = recs[0]
    return {
        "metric": _finite(rank0["metric"]),
        "metric_delta": None,
        "bytes_per_step": sum(totals) / len(recs) / max(steps, 1),
        "traffic_fraction": sum(totals) / ref_total if ref_total else 1.0,
        "step_time_s": statistics.median(timed) if timed else 0.0,
        "fallbacks": fallbacks(rank0["events"]),
    }


def link_bytes(recs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Claimed bytes sent (all ranks) vs the loopback's tx counters over the same loop."""
    link = recs[0].get("link")
    if link is None:
        return None
    claimed = sum(sum(r["sent"]) for r in recs)
    return {
        "claimed": claimed,
        "measured_tx": link["tx"],
        "packets": link.get("packets"),
        "retransmits": link.get("retransmits"),
        "ratio": link["tx"] / claimed if claimed else None,
    }


def judge(arms: dict[str, dict[str, Any]], higher_is_better: bool, tolerance: float) -> bool:
    """Pass when the profile arm's metric is within `tolerance` of fp32 in the bad direction
    (no profile arm: pass, nothing to judge)."""
    profile = arms.get("profile")
    if profile is None:
        return True
    delta = profile["metric_delta"]
    if delta is None:
        return False
    worse = -delta if higher_is_better else delta
    return within_tolerance(worse, tolerance)


def summarize(
    gathered: list[list[dict[str, Any]]],
    *,
    workload: str,
    higher_is_better: bool,
    tolerance: float,
    link_mbit: float | None = None,
) -> dict[str, Any]:
    """The summary document (`--json` and summary.json)."""
    records = by_arm(gathered)
    reference = records["fp32"]
    arms = {name: arm_summary(recs, reference) for name, recs in records.items()}
    base = arms["fp32"]["metric"]
    for name, row in arms.items():
        if row["metric"] is not None and base is not None:
            row["metric_delta"] = row["metric"] - base
        if link_mbit is not None:
            row["link_bytes"] = link_bytes(records[name])
    events = sorted(
        (e for r in records.get("profile", []) for e in r["events"]),
        key=lambda e: (e["step"], e["rank"]),
    )
    summary: dict[str, Any] = {
        "passed": judge(arms, higher_is_better, tolerance),
        "workload": workload,
        "world_size": len(gathered),
        "steps": len(reference[0]["loss"]),
        "higher_is_better": higher_is_better,
        "tolerance": tolerance,
        "arms": arms,
        "events": [
            {k: e.get(k) for k in ("step", "rank", "scope", "from", "to", "reason")} for e in events
        ],
    }
    if link_mbit is not None:
        summary["link_mbit"] = link_mbit
    return summary


def step_frame(gathered: list[list[dict[str, Any]]]) -> pd.DataFrame:
    """Per-step metrics: arm, rank, step, loss, step_time_s, bytes (sent + received)."""
    rows = []
    for rank_records in gathered:
        for rec in rank_records:
            for i, (loss, dt) in enumerate(zip(rec["loss"], rec["step_time_s"], strict=True)):
                sent = rec["sent"][i] if i < len(rec["sent"]) else 0
                received = rec["received"][i] if i < len(rec["received"]) else 0
                rows.append((rec["arm"], rec["rank"], i, loss, dt, sent + received))
    frame = pd.DataFrame(rows, columns=STEP_COLUMNS)
    return frame.astype({"rank": "int32", "step": "int32", "bytes": "int64"})


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    """summary.json: the `--json` document, indented, atomically."""
    atomic_write_text(path, json.dumps(summary, indent=2) + "\n")


#: Marks a folder as a validation report (`claim_report`): only a marked folder is cleared.
MARKER = ".nfabric-report"


def claim_report(report_dir: str | Path) -> None:
    """Ready `report_dir` for a run: a folder an earlier validation reported into (its
    `MARKER`) loses that run's outputs (`clear_report`), then is marked as a report."""
    root = Path(report_dir)
    if (root / MARKER).is_file():
        clear_report(root)
    root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(root / MARKER, "nfabric validate report\n")


def clear_report(report_dir: str | Path) -> None:
    """Remove an earlier validation's outputs from `report_dir`: its steps, summary, plot,
    records and config, rank logs, and per-seed folders that are reports themselves (marked),
    so a report folder used again holds one run's results, never a single-seed run's steps
    beside a multi-seed run's summary, or seeds another run chose. Anything else stays."""
    root = Path(report_dir)
    for name in ("steps.parquet", "summary.json", "report.png", "records.json", "config.json"):
        (root / name).unlink(missing_ok=True)
    for log in [*root.glob("logs/rank*.log"), *root.glob("logs/torchrun.node*.log")]:
        log.unlink(missing_ok=True)
    for d in root.glob("seed-*"):
        if (d.name[len("seed-"):].isdigit() and not d.is_symlink()
                and (d / MARKER).is_file()):
            shutil.rmtree(d)


def write_report(
    report_dir: str | Path, summary: dict[str, Any], frame: pd.DataFrame
) -> dict[str, Path]:
    """Write steps.parquet, summary.json and report.png atomically; return their paths."""
    from nfabric_cli.validation.plot import plot_report

    root = Path(report_dir)
    paths = {
        "steps": root / "steps.parquet",
        "summary": root / "summary.json",
        "plot": root / "report.png",
    }
    with atomic_path(paths["steps"]) as tmp:
        frame.to_parquet(tmp, index=False)
    write_summary(paths["summary"], summary)
    plot_report(frame, summary, paths["plot"])
    return paths
