"""Every table reads at 80 columns: nothing is cut to "pha…" (issue 18)."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table
from typer.testing import CliRunner

from nfabric_cli.app import app
from nfabric_cli.cli import common
from nfabric_cli.cli.tables import FittingConsole, fit

PROFILES = Path(__file__).resolve().parents[1] / "profiles"


def wide() -> Table:
    t = Table("phase", "span", "prio", "region", "route", "tau", "ef", "reducer", "traffic",
              "Δmetric", "trials", title="rows")
    t.add_row("warmup", "[0, 0.05)", "0", "head.*", "sign", "-", "false", "sharded",
              "0.0478601", "-0.0111111", "2")
    t.add_row("main", "[0.05, 1)", "1", "*", "sign", "-", "false", "sharded", "0.0615", "-0.01", "2")
    return t


def render(console: Console, *objects) -> str:
    with console.capture() as cap:
        console.print(*objects)
    return cap.get()


def test_a_table_too_wide_for_80_columns_prints_one_block_per_row_uncut():
    console = FittingConsole(width=80, color_system=None)
    out = render(console, wide())
    assert "…" not in out
    assert max(len(line) for line in out.splitlines()) <= 80
    for text in ("warmup", "[0, 0.05)", "head.*", "sharded", "0.0478601", "-0.0111111"):
        assert text in out
    assert out.index("warmup") < out.index("main")  # rows in order
    plain = render(Console(width=80, color_system=None), wide())
    assert "…" in plain  # what rich alone does at 80 columns


def test_a_table_that_fits_is_left_as_it_is():
    console = FittingConsole(width=200, color_system=None)
    assert fit(wide(), console).columns[0].header == "phase"
    assert render(console, wide()) == render(Console(width=200, color_system=None), wide())


def test_a_key_value_table_folds_a_long_value_instead_of_cutting_it():
    t = Table("key", "value", show_header=False)
    t.add_row("provenance", "data_fingerprint=" + "ab" * 40)
    out = render(FittingConsole(width=80, color_system=None), t)
    assert "…" not in out and "".join(out.split()).count("ab" * 20) >= 1


@pytest.mark.parametrize("args", [
    ["profile", "show", str(PROFILES / "vision")],
    ["profile", "show", str(PROFILES / "lm")],
    ["diff-profile", str(PROFILES / "lm" / "lm.v2.parquet"), str(PROFILES / "lm" / "lm.v3.parquet")],
    ["workloads"],
    ["compile-profile", str(PROFILES / "vision"), "--workload", "vision", "--world-size", "4",
     "--total-steps", "300", "--out", "{tmp}/b.parquet"],
], ids=["show-vision", "show-lm", "diff-lm", "workloads", "compile"])
def test_commands_read_at_80_columns(args, monkeypatch, tmp_path):
    monkeypatch.setattr(common.console, "width", 80)
    result = CliRunner().invoke(app, [a.replace("{tmp}", str(tmp_path)) for a in args])
    assert result.exit_code in (0, 1), result.output  # diff-profile exits 1 on a difference
    assert "…" not in result.stdout, result.stdout
    assert max(len(line) for line in result.stdout.splitlines()) <= 80
