"""Rendering of `nfabric calibrate --status`: the study's counts, trials, best and workers."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def _num(value: Any, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def render_status(state: dict[str, Any], console: Console) -> None:
    counts = state["counts"]
    ref = state["reference"]
    ref_text = (f"done (metric {ref['metric']:.4f})" if ref["state"] == "done"
                else f"running on {ref.get('worker') or '?'}" if ref["state"] == "running"
                else "not started")
    head = Table(title=f"study {state['study']} ({state['workload']})", show_header=True)
    for col in ("finished", "pruned", "running", "waiting", "failed", "dropped"):
        head.add_column(col, justify="right")
    head.add_row(str(counts["complete"] + counts["pruned"]), str(counts["pruned"]),
                 str(counts["running"]), str(counts["waiting"]), str(counts["fail"]),
                 str(counts["dropped"]))
    console.print(head)
    console.print(f"reference: {ref_text}; tolerance {_num(state['tolerance'], 'g')}",
                  highlight=False)
    trials = Table(title="trials")
    for col, justify in (("#", "right"), ("kind", "left"), ("state", "left"),
                         ("worker", "left"), ("traffic", "right"), ("degr.", "right"),
                         ("steps", "right")):
        trials.add_column(col, justify=justify, overflow="fold")
    for row in state["trials"]:
        label = "DROPPED" if row["dropped"] else row["state"]
        trials.add_row(str(row["trial"]), row["kind"], label, row["worker"] or "",
                       _num(row["traffic_fraction"], ".4f"), _num(row["degradation"], "+.4f"),
                       str(row["steps_run"]))
    console.print(trials)
    best = state["best"]
    if best is None:
        console.print("best admissible: none yet", highlight=False)
    else:
        routes = ", ".join(f"{k}={v}" for k, v in (best["routes"] or {}).items())
        console.print(f"best admissible on the search's own seed: trial {best['trial']}, traffic "
                      f"{best['traffic_fraction']:.4f}, degradation {best['degradation']:+.4f}"
                      f" ({routes})", highlight=False, soft_wrap=True)
    conf = state.get("confirmation") or {}
    if conf.get("runs"):
        console.print(f"confirmation: {conf['runs']} runs so far ({conf['train_steps']:,} steps, "
                      f"{conf['wall_s'] / 60:.1f} min); the profile names the candidate that "
                      "held", highlight=False, soft_wrap=True)
    workers = Table(title="workers")
    for col in ("worker", "state", "doing", "last seen"):
        workers.add_column(col, overflow="fold")
    for w in state["workers"]:
        ago = max(0.0, state["now"] - float(w.get("seen", state["now"])))
        workers.add_row(w["worker"], "running" if w["live"] else "gone", w.get("doing", ""),
                        f"{ago:.0f} s ago")
    console.print(workers)
    for p in state["profiles"]:
        console.print(f"profile after {p['trials']} trials: {p['path']} (by {p['worker']})",
                      highlight=False, soft_wrap=True)
