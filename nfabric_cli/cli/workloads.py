"""`nfabric workloads`: list the built-in workloads, or check and describe a plugin."""

from __future__ import annotations

from typing import Any

import typer
from rich.table import Table

from nfabric_cli.cli.common import console, handle_errors, print_json


def register(app: typer.Typer) -> None:
    app.command("workloads")(workloads)


@handle_errors
def workloads(
    workload: str = typer.Option(
        None, "--workload", "-w", help="Describe one workload: a built-in name or MODULE:FN."
    ),
    data_dir: str = typer.Option(
        None, "--data-dir", help="Data directory for --workload (CIFAR binaries for vision)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """List the built-in workloads (metric, default steps, batch size, parameters)."""
    from nfabric_cli.errors import InputError
    from nfabric_cli.workloads.registry import describe, get_workload, list_workloads

    if workload is None:
        if data_dir is not None:
            raise InputError("--data-dir needs --workload")
        rows = list_workloads()
    else:
        rows = [describe(get_workload(workload, data_dir))]
    if as_json:
        print_json(rows)
    else:
        console.print(_table(rows))


def _table(rows: list[dict[str, Any]]) -> Table:
    table = Table(caption="batch is per rank; ↑/↓: higher/lower metric is better")
    table.add_column("name", no_wrap=True)
    table.add_column("metric", no_wrap=True)
    for column in ("steps", "batch", "params"):  # batch: per rank
        table.add_column(column, justify="right", no_wrap=True)
    table.add_column("description", ratio=1)
    for row in rows:
        arrow = "↑" if row["higher_is_better"] else "↓"  # which way is better
        table.add_row(
            row["name"],
            f"{row['metric']} {arrow}",
            str(row["default_steps"]),
            str(row["batch_size"]),
            f"{row['params']:,}",
            row["description"],
        )
    return table
