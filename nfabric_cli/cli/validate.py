"""`nfabric validate`: prove a profile in short real DDP runs, side by side with fp32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from nfabric_cli.cli.common import console, err_console, handle_errors, print_json
from nfabric_cli.errors import CheckFailed


def register(app: typer.Typer) -> None:
    app.command("validate")(validate)


@handle_errors
def validate(
    source: Path = typer.Argument(..., help="Profile (file or directory) or bindings file."),
    workload: str = typer.Option(..., "--workload", help="vision, transformer, lm, glyphs or MODULE:FN."),
    data_dir: str | None = typer.Option(None, "--data-dir", help="The workload's data directory."),
    world_size: int | None = typer.Option(
        None, "--world-size", help="Ranks in all (default 2; under torchrun, nnodes x "
        "nproc-per-node when that is given)."
    ),
    steps: int | None = typer.Option(
        None, "--steps", help="Steps per arm (default: a bindings file's --total-steps, else the "
        "length the profile was calibrated at, else the workload's)."
    ),
    arms: str = typer.Option("fp32,static,profile", "--arms", help="Arms: fp32, static, profile."),
    baselines: str = typer.Option("", "--baselines", help="PyTorch hooks to add: fp16, powersgd."),
    launcher: str = typer.Option("spawn", "--launcher", help="spawn or torchrun."),
    nnodes: int = typer.Option(1, "--nnodes", help="Nodes (torchrun)."),
    node_rank: int = typer.Option(0, "--node-rank", help="This node's rank (torchrun)."),
    nproc_per_node: int | None = typer.Option(None, "--nproc-per-node", help="Ranks per node."),
    rdzv_endpoint: str | None = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT (torchrun)."),
    link_mbit: float | None = typer.Option(
        None,
        "--link-mbit",
        help="Run the ranks behind a loopback shaped to this many Mbit/s (root).",
    ),
    inject: list[str] = typer.Option(
        [], "--inject", help="Fault KIND@STEP[:RANK] (nan, spike, kill)."
    ),
    seed: int = typer.Option(
        0, "--seed", help="Seed of weights, data order and dropout masks (every arm)."),
    seeds: str | None = typer.Option(
        None, "--seeds", help="Validate on several seeds (0-4, 0,2,5): per arm the mean, worst "
        "seed and 90% interval of the delta vs fp32; passes when the worst seed is within "
        "tolerance. Replaces --seed."),
    tolerance: float | None = typer.Option(
        None, "--tolerance", help="Allowed metric loss vs fp32 (default: the profile's target)."
    ),
    powersgd_rank: int = typer.Option(2, "--powersgd-rank", help="PowerSGD matrix rank."),
    report: Path | None = typer.Option(None, "--report", help="Report directory."),
    record_trace: Path | None = typer.Option(
        None, "--record-trace", help="Record the profile arm's bucket traces here (nfabric replay)."
    ),
    timeout: float = typer.Option(30.0, "--timeout", help="Seconds a rank may make no progress."),
    gate: str = typer.Option("model", "--gate", help="The profile arm's capacity gate: model "
                             "(the profile's substrate prices buckets; none: all admitted) or "
                             "measure (no substrate: time whole steps on low-bit and fp32, keep "
                             "the faster; not reproducible run to run)."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Run fp32, static and profile arms (and baselines) on real ranks; exit 0 pass, 1 fail."""
    from nfabric_cli.validation.config import ValidateConfig, parse_list
    from nfabric_cli.validation.run import run_validation

    cfg = ValidateConfig(
        source=str(source), workload=workload, world_size=world_size, steps=steps,
        arms=parse_list(arms, "--arms"), baselines=parse_list(baselines, "--baselines"),
        seed=seed, tolerance=tolerance, launcher=launcher, nnodes=nnodes, node_rank=node_rank,
        nproc_per_node=nproc_per_node, rdzv_endpoint=rdzv_endpoint, link_mbit=link_mbit,
        inject=[s for item in inject for s in parse_list(item, "--inject")],
        report_dir="" if report is None else str(report), timeout_s=timeout,
        data_dir=data_dir, powersgd_rank=powersgd_rank,
        record_trace=None if record_trace is None else str(record_trace.resolve()),
        gate=gate,
    )  # fmt: skip
    if seeds is not None:
        return _many(cfg, seeds, json_out)
    if json_out:
        result = run_validation(cfg)
    else:
        with ProgressBar(cfg) as on_progress:
            result = run_validation(cfg, on_progress, _warn_lines)
    if result.summary is None:  # a rank under torchrun other than 0: rank 0 reports
        if not result.passed:
            raise typer.Exit(1)
        return
    summary = result.summary
    if json_out:
        print_json(summary)
        if not summary["passed"]:
            raise typer.Exit(1)
        return
    console.print(_table(summary))
    console.print(f"report: {result.report_dir}")
    _warn_outside(summary)
    if not summary["passed"]:
        raise CheckFailed(_verdict(summary))
    console.print(f"[bold green]passed[/]: {_verdict(summary)}")


def _many(cfg: Any, seeds_text: str, json_out: bool) -> None:
    from nfabric_cli.cli.validate_seeds import render_seeds
    from nfabric_cli.validation.seeds import parse_seeds, run_seeds

    seeds = parse_seeds(seeds_text)

    def on_seed(seed: int, done: int, total: int) -> None:
        if not json_out:
            err_console.print(f"seed {seed} ({done + 1}/{total})", highlight=False)

    if json_out:
        result = run_seeds(cfg, seeds, None, on_seed)
    else:
        with ProgressBar(cfg) as on_progress:
            result = run_seeds(cfg, seeds, on_progress, on_seed, _warn_lines)
    if json_out:
        print_json(result.summary)
        if not result.passed:
            raise typer.Exit(1)
        return
    render_seeds(result.summary, console)
    console.print(f"report: {result.report_dir} (per seed: seed-<s>/)")
    _warn_outside(result.summary)
    if not result.passed:
        raise CheckFailed(_seeds_verdict(result.summary))
    console.print(f"[bold green]passed[/]: {_seeds_verdict(result.summary)}")


def _warn_outside(summary: dict[str, Any]) -> None:
    _warn_lines(summary.get("outside_proven") or [])


def _warn_lines(lines: list[str]) -> None:
    """Proven-range warnings: before anything is launched (so a long run outside that range
    can be stopped at once; under torchrun, rank 0 of the report warns at the end only) and
    again beside the verdict."""
    for line in lines:
        err_console.print(f"[yellow]warning[/]: {line}", highlight=False, soft_wrap=True)


def _seeds_verdict(doc: dict[str, Any]) -> str:
    worst = doc["worst_profile_delta"]
    shown = "not finite" if worst is None else f"{worst:+.4f}"
    return (f"worst seed's profile delta vs fp32 {shown} over seeds {doc['seeds']}, "
            f"tolerance {doc['tolerance']:g}")


def _verdict(summary: dict[str, Any]) -> str:
    profile = summary["arms"].get("profile")
    if profile is None:
        return "no profile arm: nothing to judge"
    delta = profile["metric_delta"]
    shown = "not finite" if delta is None else f"{delta:+.4f}"
    return f"profile metric delta vs fp32 {shown}, tolerance {summary['tolerance']:g}"


def _table(summary: dict[str, Any]) -> Table:
    arrow = "↑" if summary["higher_is_better"] else "↓"
    linked = "link_mbit" in summary
    table = Table(
        title=f"{summary['workload']}: {summary['world_size']} ranks, {summary['steps']} steps",
        caption="bytes: per rank and step, sent + received; time: median step (slowest rank); "
        "fb: fallbacks to fp32" + ("; link claimed / measured: bytes sent by all ranks, as the "
                                   "routes count them / as loopback's tx counter does"
                                   if linked else ""),
    )
    columns = ["arm", f"metric {arrow}", "Δ fp32", "bytes", "traffic", "time", "fb"]
    if linked:
        columns += ["link claimed", "measured"]
    for col in columns:
        table.add_column(col, justify="left" if col == "arm" else "right", no_wrap=True)
    for name, arm in summary["arms"].items():
        cells = [
            name,
            "diverged" if arm["metric"] is None else f"{arm['metric']:.4f}",
            "-" if arm["metric_delta"] is None else f"{arm['metric_delta']:+.4f}",
            f"{arm['bytes_per_step']:,.0f}",
            f"{100 * arm['traffic_fraction']:.2f}%",
            f"{1000 * arm['step_time_s']:.1f}ms",
            str(arm["fallbacks"]),
        ]
        if linked:
            link = arm.get("link_bytes") or {}
            cells += [f"{link.get('claimed', 0):,}", f"{link.get('measured_tx', 0):,}"]
        table.add_row(*cells)
    return table


class ProgressBar:
    """Context manager yielding the launcher's progress callback: steps done by the slowest rank."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.bar = Progress(
            TextColumn("validate"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
            TimeElapsedColumn(), console=err_console, transient=True,
        )  # fmt: skip
        self.task = self.bar.add_task("starting", total=None)

    def __enter__(self) -> Any:
        return self.update  # the bar appears once the input is checked, not before its error

    def update(self, progress: dict[int, Any]) -> None:
        if not self.bar.live.is_started:
            self.bar.start()
        steps = self.cfg.steps or 0
        arms = self.cfg.all_arms()
        if not progress or not steps:
            return
        slowest = min(progress.values(), key=lambda p: p.position())
        done = max(0, slowest.arm_index) * steps + slowest.step
        label = f"{slowest.arm or 'start-up'} step {slowest.step}"
        self.bar.update(self.task, total=len(arms) * steps, completed=done, description=label)

    def __exit__(self, *exc: object) -> None:
        if self.bar.live.is_started:  # (stopping one never started prints a blank line)
            self.bar.stop()
