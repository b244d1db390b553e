"""The `nfabric` command-line app. Commands live in `nfabric_cli/cli/*`, one module per stage."""

from __future__ import annotations

import importlib
import os

import typer

from nfabric_cli import __version__

app = typer.Typer(
    name="nfabric",
    help="Safe, measurable low-bit gradient communication for PyTorch DDP.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Each module exposes `register(app)`. Order is the order of `nfabric --help`.
_COMMAND_MODULES = (
    "calibrate",
    "profile",
    "validate",
    "capacity",
    "replay",
    "workloads",
    "bench",
)


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks on errors."),
    version: bool = typer.Option(False, "--version", help="Print the version and exit."),
) -> None:
    if debug:
        os.environ["NFABRIC_DEBUG"] = "1"
    if version:
        typer.echo(__version__)
        raise typer.Exit(0)


def _register_all() -> None:
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(f"nfabric_cli.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"nfabric_cli.cli.{name}":
                continue  # stage not built yet
            raise
        module.register(app)


_register_all()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
