"""Shared CLI plumbing: error handling with stable exit codes, JSON output, the console."""

from __future__ import annotations

import functools
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich.markup import escape

from nfabric_cli.cli.tables import FittingConsole
from nfabric_cli.errors import CheckFailed, InputError, user_frame

console = FittingConsole()
err_console = FittingConsole(stderr=True)

F = TypeVar("F", bound=Callable[..., Any])


def debug_enabled() -> bool:
    return os.environ.get("NFABRIC_DEBUG", "") not in ("", "0")


def handle_errors(fn: F) -> F:
    """Turn library exceptions into one-line messages and exit codes: 2 bad input (the user's
    own plugin code raising counts: `errors.user_frame`), 1 a verdict (a validation that failed,
    profiles that differ), 3 a bug (an internal error, kept apart from 1 so that CI does not
    read a crash as a verdict)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except InputError as exc:
            if debug_enabled():
                traceback.print_exc()
            err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False,
                              soft_wrap=True)
            raise typer.Exit(2) from None
        except CheckFailed as exc:
            err_console.print(f"[bold red]failed:[/] {escape(str(exc))}", highlight=False,
                              soft_wrap=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            err_console.print("interrupted")
            raise typer.Exit(130) from None
        except Exception as exc:  # a bug: still one line unless --debug
            if debug_enabled():
                traceback.print_exc()
            where = user_frame(exc)
            if where is not None:  # the user's own code raised it (a plugin workload, model)
                if not debug_enabled():
                    err_console.print(
                        f"[bold red]error:[/] the plugin's code raised "
                        f"{type(exc).__name__}: {escape(str(exc))} ({escape(where)}; run with "
                        "--debug for the traceback)", highlight=False, soft_wrap=True)
                raise typer.Exit(2) from None
            if not debug_enabled():
                err_console.print(
                    f"[bold red]internal error:[/] {type(exc).__name__}: {escape(str(exc))} "
                    "(run with --debug for the traceback)",
                    highlight=False,
                    soft_wrap=True,
                )
            raise typer.Exit(3) from None

    return wrapper  # type: ignore[return-value]


def print_json(obj: Any) -> None:
    """Print machine output: stable keys, no colour, one document on stdout."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def check_out(out: Path, kind: str) -> None:
    """Refuse, before any work, an `--out` that would overwrite something other than an
    nfabric `kind` file (the profile a bindings file is compiled from, a report, data) or
    that is a directory: one line, exit 2."""
    from nfabric_cli.profile.parquet import read_metadata

    if out.is_dir():
        raise InputError(f"--out {out}: is a directory, not a {kind} file to write")
    if not out.exists():
        return
    try:
        found: str | None = read_metadata(out)[0]
    except InputError:
        found = None
    if found != kind:
        what = f"a {found} file" if found else "not an nfabric file"
        raise InputError(f"--out {out}: exists and is {what}; refusing to overwrite it with a "
                         f"{kind} file")


def check_replace(out: Path, option: str, kind: str, is_kind: Callable[[Path], bool]) -> None:
    """Refuse, before any work, an output file that cannot be written, or that exists and is
    not a `kind` (`is_kind` tells): a mistyped path would lose the file (a profile, a spec)."""
    from nfabric_cli.atomic import check_writable

    check_writable(out, option)
    try:
        other = out.exists() and not is_kind(out)
    except OSError as exc:  # (exists, but cannot be read)
        raise InputError(f"{option} {out}: cannot read it ({exc.strerror})") from None
    if other:
        raise InputError(f"{option} {out}: exists and is not a {kind}; refusing to overwrite it")


def is_png(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"

