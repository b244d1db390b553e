"""The search at a glance: traffic fraction vs metric degradation per trial, the tolerance
line, the chosen point, and each candidate that failed confirmation drawn down to its worst
cell (a trial can sit inside tolerance on the search's cell and fail elsewhere: glyphs.v7's
three cheapest did at two ranks), saved as a PNG next to the profile."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from nfabric_cli.atomic import atomic_path
from nfabric_cli.calibration.outcome import trial_rows
from nfabric_cli.calibration.study import StudyRun
from nfabric_cli.profile.target import degradation

_COLOURS = {"sweep": "tab:orange", "derived": "tab:green", "warm": "tab:purple",
             "repair": "tab:red",
            "search": "tab:blue"}


def failed_confirmation(found: list[dict[str, Any]]) -> list[tuple[float, float, float]]:
    """(search traffic, degradation on the search's cell, worst cell's degradation) of each
    candidate that failed confirmation (`choice.verdicts`), in the candidates' order."""
    return [(v["traffic_fraction"], v["cells"][0]["degradation"], v["worst_degradation"])
            for v in found if v["status"] == "fails"]


def plot_search(run: StudyRun, best: dict[str, Any], path: Path) -> Path:
    """The plot of `run`'s study with the choice `build_outcome` made (`Outcome.best`: the
    winner, and the confirmation's verdicts where there is a grid), written to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in trial_rows(run)
            if r["traffic_fraction"] is not None and r["degradation"] is not None
            and math.isfinite(r["degradation"])]
    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=110)
    for kind, colour in _COLOURS.items():
        for state, marker, alpha in (("COMPLETE", "o", 0.9), ("PRUNED", "x", 0.5)):
            pts = [r for r in rows if r["kind"] == kind and r["state"] == state]
            if pts:
                label = f"{kind}" + (" (pruned, last checkpoint)" if state == "PRUNED" else "")
                ax.scatter([r["traffic_fraction"] for r in pts], [r["degradation"] for r in pts],
                           c=colour, marker=marker, alpha=alpha, label=label)
    ax.scatter([1.0], [0.0], c="black", marker="s", label="fp32 reference")
    found = best.get("confirmation", {}).get("candidates", [])
    for i, (traffic, own, worst) in enumerate(failed_confirmation(found)):
        ax.plot([traffic, traffic], [own, worst], color="tab:red", linestyle=":", linewidth=1)
        ax.scatter([traffic], [worst], marker="v", facecolors="none", edgecolors="tab:red",
                   label=None if i else "failed confirmation: its worst cell")
    if best["trial"] is not None:
        d = degradation(best["metric"], best["reference"], run.workload.higher_is_better)
        ax.scatter([best["traffic_fraction"]], [d], s=260, marker="*", facecolors="gold",
                   edgecolors="black", zorder=5, label=f"chosen (trial {best['trial']})")
    untrained = sum(1 for t in run.study.trials if "traffic_bound" in t.user_attrs)
    if untrained:
        ax.text(0.99, 0.01, f"{untrained} trial(s) pruned before training (traffic bound)",
                transform=ax.transAxes, ha="right", va="bottom", fontsize=7, color="grey")
    tol = run.spec.tolerance
    ax.axhline(tol, color="red", linestyle="--", linewidth=1, label=f"tolerance {tol:g}")
    ax.set_xlabel("traffic fraction of fp32 (measured)")
    ax.set_ylabel(f"{run.workload.metric_name} degradation vs fp32 (positive = worse)")
    ax.set_xscale("log")
    ax.set_title(f"nfabric calibrate {run.workload.name}: {run.study.study_name}")
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return path
