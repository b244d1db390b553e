"""The `nfabric` command-line app. Commands live in `nfabric_cli/cli/*`, one module per stage."""

from __future__ import annotations

import os
import sys

import typer

from nfabric_cli import __version__

app = typer.Typer(
    name="nfabric",
    help="Safe, measurable low-bit gradient communication for PyTorch DDP.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

def _print_version(value: bool) -> None:
    """`--version` alone: eager, so it answers before a command is asked for."""
    if value:
        typer.echo(__version__)
        raise typer.Exit(0)


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks on errors."),
    version: bool = typer.Option(False, "--version", help="Print the version and exit.",
                                 is_eager=True, callback=_print_version),
) -> None:
    if debug:
        os.environ["NFABRIC_DEBUG"] = "1"


def _register_all() -> None:
    """Every command, explicitly: a module that is missing is an import error, not a command
    that silently disappears. Order is the order of `nfabric --help`."""
    from nfabric_cli.cli import bench, calibrate, capacity, profile, replay, validate, workloads

    for module in (calibrate, profile, validate, capacity, replay, workloads, bench):
        module.register(app)


def _flags_take_no_value() -> None:
    """Typer 0.29's rich help prints `<bool>` beside every flag (`--json <bool>`), which reads
    as if the flag took a value. A flag's type column is left empty, as click prints it."""
    from typer.core import TyperOption

    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "_nfabric", False):
        return

    def display_type_rich(self: TyperOption, ctx: typer.Context) -> str | None:
        return None if self.is_flag else shown(self, ctx)

    display_type_rich._nfabric = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


_flags_take_no_value()
_register_all()


def main() -> None:
    """The console entry point. Run as a torchrun rank, the process ends without the
    interpreter's teardown, which can abort a gloo rank after its work (`ranks/exit.py`)."""
    from nfabric_cli.ranks.exit import env_rank, exit_rank

    if env_rank() is None:
        _run()
    try:
        _run()
    except SystemExit as done:
        exit_rank(done.code)  # type: ignore[arg-type]
    exit_rank(0)


def _run() -> None:
    """`app()`, exiting with its status, except that a usage error (an unknown option, a
    value of the wrong type) prints one line, ``error: ... (see CMD --help)``, and exits 2,
    as the commands' own bad-input errors do: Typer prints a boxed panel of several lines."""
    try:  # Typer >= 0.2x runs its own copy of click
        from typer._click import exceptions as click_errors
    except ImportError:
        from click import exceptions as click_errors

    try:
        code = app(standalone_mode=False)
    except click_errors.UsageError as exc:
        if type(exc).__name__ != "NoArgsIsHelpError":  # (the help is printed already)
            where = exc.ctx.command_path if exc.ctx is not None else "nfabric"
            message = " ".join(exc.format_message().split())
            print(f"error: {message} (see {where} --help)", file=sys.stderr)
        sys.exit(exc.exit_code)
    except click_errors.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except typer.Abort:
        print("Aborted!", file=sys.stderr)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) and not isinstance(code, bool) else 0)


if __name__ == "__main__":
    main()
