"""Bad input to `nfabric validate`: exit 2, one line, no traceback, before any rank starts."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from nfabric_cli.app import app
from tests.validation.common import TINY, WIDE, head_fp32_profile

runner = CliRunner()


@pytest.fixture(scope="module")
def prof(tmp_path_factory):
    return head_fp32_profile(tmp_path_factory.mktemp("prof") / "tiny.v1.parquet")


def bad_input(tmp_path, prof, *args, fragment: str) -> None:
    report = tmp_path / "r"
    r = runner.invoke(
        app, ["validate", str(prof), "--workload", TINY, "--report", str(report), *map(str, args)]
    )
    assert r.exit_code == 2, (r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in r.stdout + r.stderr
    assert not (report / "logs").exists()  # nothing was launched


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("--world-size", 0), "--world-size must be >= 1"),
        (("--steps", 0), "--steps must be >= 1"),
        (("--arms", "fp32,dynamic"), "unknown arm 'dynamic'"),
        (("--baselines", "fp16,qsgd"), "unknown baseline 'qsgd'"),
        (("--inject", "nan@x"), "bad injection 'nan@x'"),
        (("--inject", "kill@3:7"), "names rank 7, but world size is 2"),
        (("--launcher", "torchrun", "--rdzv-endpoint", "10.0.0.1"), "bad --rdzv-endpoint"),
        (("--launcher", "torchrun", "--nnodes", 2, "--rdzv-endpoint", "h:70000"), "port must be"),
        (("--world-size", 64), "world size 64 is too large"),
        (("--link-mbit", -5), "--link-mbit must be a positive number"),
        (("--seeds", "4-2"), "--seeds: range '4-2' runs backwards"),
        (("--gate", "timed"), "--gate: model or measure"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, prof, args, fragment):
    bad_input(tmp_path, prof, *args, fragment=fragment)


def test_profile_for_another_model(tmp_path, prof):
    r = runner.invoke(app, ["validate", str(prof), "--workload", WIDE, "--report", str(tmp_path)])
    assert r.exit_code == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "profile was made for another model" in lines[0], r.stderr


def test_missing_profile(tmp_path):
    bad_input(tmp_path, tmp_path / "nope.parquet", fragment="no such file or directory")


def test_unknown_workload(tmp_path, prof):
    r = runner.invoke(
        app, ["validate", str(prof), "--workload", "nosuch", "--report", str(tmp_path)]
    )
    assert r.exit_code == 2 and "unknown workload 'nosuch'" in r.stderr


def test_shaped_link_needs_root(tmp_path, prof, monkeypatch):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    bad_input(tmp_path, prof, "--link-mbit", 20, fragment="--link-mbit needs root")


def test_shaped_link_needs_iproute2(tmp_path, prof, monkeypatch):
    monkeypatch.setattr("os.geteuid", lambda: 0)
    monkeypatch.setenv("PATH", str(tmp_path))
    bad_input(tmp_path, prof, "--link-mbit", 20, fragment="not found: ip, tc")
