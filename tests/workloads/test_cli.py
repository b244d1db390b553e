"""`nfabric workloads`: the table, --json, and exit-2 one-line errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from nfabric_cli.app import app

runner = CliRunner()


def _one_line_error(result, *fragments: str) -> None:
    assert result.exit_code == 2, (result.stdout, result.stderr)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0]
    assert "Traceback" not in result.stderr + result.stdout


def test_json_lists_builtins() -> None:
    result = runner.invoke(app, ["workloads", "--json"])
    assert result.exit_code == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [r["name"] for r in rows] == ["vision", "transformer", "lm", "glyphs"]
    assert list(rows[0]) == [
        "name",
        "metric",
        "higher_is_better",
        "default_steps",
        "batch_size",
        "params",
        "head_selector",
        "description",
        "data_fingerprint",
    ]
    assert rows[2]["metric"] == "val_loss" and rows[2]["higher_is_better"] is False
    assert rows[0]["params"] == 77290


def test_table_and_one_workload() -> None:
    result = runner.invoke(app, ["workloads"])
    assert result.exit_code == 0, result.stderr
    for text in ("vision", "transformer", "lm", "accuracy ↑", "val_loss ↓", "167,360"):
        assert text in result.stdout
    one = runner.invoke(app, ["workloads", "--workload", "lm", "--json"])
    assert one.exit_code == 0 and [r["name"] for r in json.loads(one.stdout)] == ["lm"]


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["-w", "resnet"], ["unknown workload 'resnet'", "vision, transformer, lm"]),
        (["-w", "no_such_mod_xyz:make"], ["cannot import module 'no_such_mod_xyz'"]),
        (["-w", "json:nosuch"], ["module 'json' has no attribute 'nosuch'"]),
        (["-w", "json:dumps"], ["json:dumps() raised TypeError"]),
        (
            ["-w", "vision", "--data-dir", "/nonexistent"],
            ["--data-dir /nonexistent: not a directory"],
        ),
        (["--data-dir", "/tmp"], ["--data-dir needs --workload"]),
    ],
)
def test_bad_input_exits_2_with_one_line(args: list[str], fragments: list[str]) -> None:
    _one_line_error(runner.invoke(app, ["workloads", *args]), *fragments)


def test_missing_cifar_files(tmp_path) -> None:
    (tmp_path / "data_batch_1.bin").write_bytes(b"")
    _one_line_error(
        runner.invoke(app, ["workloads", "-w", "vision", "--data-dir", str(tmp_path)]),
        "neither CIFAR-10 binaries (data_batch_1.bin .. data_batch_5.bin, test_batch.bin)",
    )
