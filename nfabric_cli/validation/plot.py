"""report.png: training loss per step and bytes per step, one line per arm (mean over ranks);
with several seeds, the training loss of every arm on every seed."""

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
        ax_loss.plot(rows["step"], _smoothed(rows["loss"]), label=arm, linewidth=1.2)
        ax_bytes.plot(rows["step"], rows["bytes"], label=arm, linewidth=1.2)
    ax_loss.set(xlabel="step", ylabel="training loss (mean over ranks, smoothed)")
    ax_loss.set_title(f"{summary['workload']}, world size {summary['world_size']}")
    ax_bytes.set(xlabel="step", ylabel="bytes per rank per step (sent + received)")
    if (frame["bytes"] > 0).any():
        ax_bytes.set_yscale("log")
    verdict = "passed" if summary["passed"] else "FAILED"
    ax_bytes.set_title(f"traffic per arm; profile {verdict} (tolerance {summary['tolerance']:g})")
    _save(fig, (ax_loss, ax_bytes), path)


def plot_seeds(frames: dict[int, pd.DataFrame], doc: dict[str, Any], path: Path) -> None:
    """Training loss per step, one line per arm and seed (`frames`: seed -> steps frame)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, arm in enumerate(doc["arms"]):
        for k, frame in enumerate(frames.values()):
            rows = frame[frame["arm"] == arm].groupby("step")["loss"].mean()
            ax.plot(rows.index, _smoothed(rows), color=colours[i % len(colours)],
                    linewidth=0.9, alpha=0.75, label=arm if k == 0 else None)
    verdict = "passed" if doc["passed"] else "FAILED"
    ax.set(xlabel="step", ylabel="training loss (mean over ranks, smoothed)",
           title=f"{doc['workload']}: {len(frames)} seeds, one line per arm and seed; "
                 f"profile {verdict} on the worst seed")
    _save(fig, (ax,), path)


def _smoothed(loss: pd.Series) -> pd.Series:
    return loss.rolling(max(1, len(loss) // 50), min_periods=1).mean()


def _save(fig: Any, axes: tuple[Any, ...], path: Path) -> None:
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
