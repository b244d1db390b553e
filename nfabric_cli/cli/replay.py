"""`nfabric replay`: replay a recorded bucket trace on real ranks and fit the substrate."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import typer
from rich import box
from rich.table import Table

from nfabric_cli.cli.common import (
    check_replace,
    console,
    err_console,
    handle_errors,
    print_json,
)


def register(app: typer.Typer) -> None:
    app.command("replay")(replay)


@handle_errors
def replay(
    trace_dir: Path = typer.Argument(..., help="Trace directory (attach(trace_dir=...))."),
    topology: str | None = typer.Option(
        None, "--topology", help="What-if reducer for compressed routes: sharded or central."
    ),
    world_size: int | None = typer.Option(
        None, "--world-size", help="Replay at N ranks (default: the recorded world size)."
    ),
    link_mbit: float | None = typer.Option(
        None, "--link-mbit", help="Ranks behind one tbf-shaped loopback at F Mbit/s (root)."
    ),
    repeats: int = typer.Option(5, "--repeats", help="Timed repeats per case (median)."),
    out: Path | None = typer.Option(
        None, "--out", help="Fitted substrate TOML (default: TRACE_DIR/substrate.toml)."
    ),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Replay a trace through the real reducers, fit α, β, codec and endpoint, write a substrate."""
    from nfabric_cli.replay import replay_trace

    target = out if out is not None else trace_dir / "substrate.toml"
    if out is not None:  # (the default is in the trace directory, which replay checks)
        check_replace(out, "--out", "substrate TOML file", _is_substrate)
    busy = (
        err_console.status(f"replaying {trace_dir} ...")
        if err_console.is_terminal and not json_out
        else contextlib.nullcontext()
    )
    with busy:
        report = replay_trace(trace_dir, world_size, topology, link_mbit, repeats, target)
    if json_out:
        print_json(report.to_dict())
    else:
        _render(report.to_dict())


def _is_substrate(path: Path) -> bool:
    from nfabric_cli.errors import InputError
    from nfabric_cli.substrate.model import load_substrate

    try:
        load_substrate(path)
    except InputError:
        return False
    return True


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3g}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.0f}%"


def _render(r: dict[str, Any]) -> None:
    fit = r["fit"]
    link = f"shaped {r['link_mbit']:g} Mbit/s" if r["link_mbit"] else "unshaped loopback"
    console.print(
        f"trace {r['trace']} ({r['trace_world_size']} ranks) replayed at {r['world_size']} ranks, "
        f"{link}, topology {r['topology'] or 'as recorded'}, {r['repeats']} repeats"
    )
    console.print(
        f"fit: α {fit['alpha_s'] * 1e6:.4g} us/hop, link {fit['link_gbps'] * 1e3:.4g} Mbit/s "
        f"({'shared by all ranks' if r['shared_link'] else 'per rank'}), fp32 rms error "
        f"{fit['rms_rel_error'] * 100:.1f}% over {fit['samples']} all-reduces"
        + (f", endpoint {fit['endpoint_gbps'] * 1e3:.4g} Mbit/s" if fit["endpoint_gbps"] else "")
    )
    for table in ("encode_gbps", "reduce_gbps", "decode_gbps"):
        if fit[table]:
            rates = ", ".join(f"{k} {v:.3g}" for k, v in fit[table].items())
            console.print(f"codec {table.split('_')[0]} GB/s: {rates}")
    if fit["codec_call_us"]:
        fixed = ", ".join(f"{k} {v:.0f}" for k, v in fit["codec_call_us"].items())
        console.print(f"codec fixed cost per call, us: {fixed}")
    if fit["latency_us_by_kind"]:
        kinds = ", ".join(f"{k} {v:.0f}" for k, v in fit["latency_us_by_kind"].items())
        console.print(f"latency per round, us: {kinds} (all_gather: W-1 rounds, others: 1)")
    t = Table(title="per group, ms: trace, measured, predicted after the fit; gate vs measured",
              box=box.SIMPLE_HEAD)
    for col in ("route", "numel", "trace", "meas", "pred", "err", "fp32", "fp32 pred", "gate"):
        t.add_column(col, justify="left" if col in ("route", "gate") else "right")
    for g in r["groups"]:
        gate = "-"
        if "agrees" in g:
            mark = "[green]ok[/]" if g["agrees"] else f"[red]measured {g['measured_verdict']}[/]"
            gate = f"{g['verdict']} {mark}"
        t.add_row(g["route"], f"{g['numel']:,}", _ms(g["recorded_s"]), _ms(g["measured_s"]),
                  _ms(g["predicted_s"]), _pct(g["error"]), _ms(g.get("fp32_measured_s")),
                  _ms(g.get("fp32_predicted_s")), gate)
    console.print(t)
    real = sum(g["inputs"].get("payload", 0) for g in r["groups"])
    total = sum(sum(g["inputs"].values()) for g in r["groups"])
    console.print(f"inputs: recorded payloads on {real} of {total} rank-groups (random data "
                  "of the recorded size elsewhere)")
    for warning in r["warnings"]:
        console.print(f"[yellow]warning:[/] {warning}", soft_wrap=True, highlight=False)
    console.print(f"substrate: {r['out']}", soft_wrap=True)
