"""PNG figures of the capacity model (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

from nfabric_cli.atomic import atomic_path
from nfabric_cli.substrate.project import Projection
from nfabric_cli.substrate.report import StepTimes


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)


def plot_link_sweep(
    links_gbps: list[float], times: list[StepTimes], world_size: int, path: str | Path
) -> None:
    """Predicted step communication time vs link bandwidth: fp32, profile, profile + gate."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.loglog(links_gbps, [t.fp32_s * 1e3 for t in times], label="fp32 (DDP all-reduce)")
    ax.loglog(links_gbps, [t.profile_s * 1e3 for t in times], "--", label="profile as written")
    ax.loglog(links_gbps, [t.gated_s * 1e3 for t in times], label="profile + capacity gate")
    ax.set_xlabel("link bandwidth (Gbit/s)")
    ax.set_ylabel("predicted gradient communication per step (ms)")
    ax.set_title(f"nfabric capacity, {world_size} ranks")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def plot_projection(proj: Projection, path: str | Path) -> None:
    """One panel per link speed: step time vs world size per arm, saturation marked."""
    plt = _pyplot()
    links = sorted(proj.saturation)
    cols = min(3, len(links))
    nrows = (len(links) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    for ax, link in zip(axes.flat, links, strict=False):
        rows = [r for r in proj.rows if r.link_gbps == link]
        ws = [r.world_size for r in rows]
        for attr, style, label in (
            ("fp32_ring_s", "o-", "fp32 ring"),
            ("sign_sharded_s", "s-", "sign sharded"),
            ("sign_central_s", "^-", "sign central"),
        ):
            pts = [(r.world_size, getattr(r, attr)) for r in rows if getattr(r, attr) is not None]
            ax.loglog([w for w, _ in pts], [t * 1e3 for _, t in pts], style, label=label)
        sat = proj.saturation[link]
        if sat is not None and ws and sat <= max(ws) * 2:
            ax.axvline(sat, color="red", linestyle=":", label=f"central saturates (W={sat})")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{link:g} Gbit/s")
        ax.set_xlabel("world size")
        ax.set_ylabel("ms per step")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(links):]:
        ax.set_visible(False)
    fig.suptitle(f"gradient communication per step, {proj.params / 1e6:.1f}M parameters")
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
