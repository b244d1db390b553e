"""The console entry point: usage errors as one line (exit 2), `--version` alone, help."""

from __future__ import annotations

import subprocess
import sys

from nfabric_cli import __version__


def nfabric(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nfabric_cli", *args], capture_output=True,
                          text=True, timeout=120)


def test_a_usage_error_is_one_line_and_exit_2() -> None:
    """A value of the wrong type, an unknown option, a missing argument, an unknown command:
    one line naming the help to read, as the commands' own bad-input errors are."""
    cases = [
        (("validate", "p.parquet", "--workload", "vision", "--world-size", "abc"),
         "error: Invalid value for '--world-size': "),
        (("validate", "p.parquet", "--workload", "vision", "--bogus"),
         "error: No such option: --bogus"),
        (("validate",), "error: Missing argument 'source'."),
        (("nosuch",), "error: No such command 'nosuch'."),
    ]  # fmt: skip
    for args, start in cases:
        done = nfabric(*args)
        assert done.returncode == 2, (args, done.stderr)
        lines = done.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(start), (args, done.stderr)
        command = "validate " if args[0] == "validate" else ""
        assert lines[0].endswith(f" -m nfabric_cli {command}--help)"), lines[0]


def test_version_alone_and_help_without_a_command() -> None:
    done = nfabric("--version")
    assert (done.returncode, done.stdout, done.stderr) == (0, f"{__version__}\n", "")
    done = nfabric()  # (exit 2 under click >= 8.2, which Typer >= 0.2x vendors; 0 before)
    assert done.returncode in (0, 2) and "Usage:" in done.stdout and "validate" in done.stdout
    assert done.stderr == ""
