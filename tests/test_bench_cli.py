"""`nfabric bench`: bad sizes and step counts exit 2 with one line, before any buffer is
allocated or any rank started."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from nfabric_cli.app import app


@pytest.mark.parametrize(
    ("size", "message"),
    [("0", "--size and --repeats must be >= 1"),
     ("10000000000000", "--size 10,000,000,000,000: its fp32 buffer alone (37,252.9 GiB) is "
                        "more than this machine's memory (")],
)  # fmt: skip
def test_bench_routes_bad_size_exits_2_with_one_line(size: str, message: str) -> None:
    r = CliRunner().invoke(app, ["bench", "routes", "--size", size, "--repeats", "1"])
    assert r.exit_code == 2, (r.stdout, r.stderr)
    (line,) = r.stderr.splitlines()
    assert line.startswith(f"error: {message}"), line


@pytest.mark.parametrize("steps", ["1", "2"])
def test_bench_runtime_too_few_steps_exits_2_with_one_line(steps: str) -> None:
    # two steps passed this check once and then failed in the ranks: the median of no steps
    r = CliRunner().invoke(app, ["bench", "runtime", "--world-size", "1", "--steps", steps])
    assert r.exit_code == 2, (r.stdout, r.stderr)
    (line,) = r.stderr.splitlines()
    assert line == ("error: --world-size must be >= 1 and --steps >= 3 (the first two steps of "
                    "each arm's round are warm-up, left out)"), line
