"""Rendering of `nfabric validate --seeds`: over-seed statistics per arm, then per seed."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def _d(value: float | None) -> str:
    return "-" if value is None else f"{value:+.4f}"


def render_seeds(doc: dict[str, Any], console: Console) -> None:
    arrow = "↑" if doc["higher_is_better"] else "↓"
    table = Table(title=f"{doc['workload']}: {doc['world_size']} ranks, {doc['steps']} steps, "
                        f"{len(doc['seeds'])} seeds (metric {arrow})",
                  caption=f"Δ: metric - fp32 per seed; pass rule: {doc['rule']}")
    for col in ("arm", "Δ mean", "Δ worst", "90% CI", "traffic", "time", "fb"):
        table.add_column(col, justify="left" if col == "arm" else "right")
    for name, arm in doc["arms"].items():
        d = arm["metric_delta"]
        ci = "-" if d["ci90"] is None else f"[{d['ci90'][0]:+.3f}, {d['ci90'][1]:+.3f}]"
        worst = "diverged" if d["diverged"] else _d(d["worst"])
        table.add_row(name, _d(d["mean"]), worst, ci,
                      f"{100 * arm['traffic_fraction']['mean']:.2f}%",
                      f"{1000 * arm['step_time_s']:.1f}ms", str(arm["fallbacks"]))
    console.print(table)
    arms = list(doc["arms"])
    seeds = Table(title="per seed: Δ vs fp32")
    for col in ("seed", *arms, "pass"):
        seeds.add_column(col, justify="right")
    for row in doc["per_seed"]:
        seeds.add_row(str(row["seed"]), *(_d(row["arms"][a]["metric_delta"]) for a in arms),
                      "yes" if row["passed"] else "NO")
    console.print(seeds)
    if doc.get("pairing_note"):
        console.print(f"note: {doc['pairing_note']}", highlight=False, soft_wrap=True)
