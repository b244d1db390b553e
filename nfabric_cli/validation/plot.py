"""report.png: training loss per step and bytes per step, one line per arm (mean over ranks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from nfabric_cli.atomic import atomic_path


def plot_report(frame: pd.DataFrame, summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_bytes) = plt.subplots(1, 2, figsize=(12, 4.5))
    mean = frame.groupby(["arm", "step"], sort=False)[["loss", "bytes"]].mean().reset_index()
    for arm in summary["arms"]:
        rows = mean[mean["arm"] == arm]
        if rows.empty:
            continue
        loss = rows["loss"].rolling(max(1, len(rows) // 50), min_periods=1).mean()
        ax_loss.plot(rows["step"], loss, label=arm, linewidth=1.2)
        ax_bytes.plot(rows["step"], rows["bytes"], label=arm, linewidth=1.2)
    ax_loss.set(xlabel="step", ylabel="training loss (mean over ranks, smoothed)")
    ax_loss.set_title(f"{summary['workload']}, world size {summary['world_size']}")
    ax_bytes.set(xlabel="step", ylabel="bytes per rank per step (sent + received)")
    if (frame["bytes"] > 0).any():
        ax_bytes.set_yscale("log")
    verdict = "passed" if summary["passed"] else "FAILED"
    ax_bytes.set_title(f"traffic per arm; profile {verdict} (tolerance {summary['tolerance']:g})")
    for ax in (ax_loss, ax_bytes):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
