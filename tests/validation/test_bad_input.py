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
    assert r.stderr.startswith("error: ")  # no blank line of a progress bar before it
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
        (("--steps", 5, "--inject", "nan@5"), "injection nan@5 is at step 5, but the run's steps "
                                              "are 0-4"),
        (("--seed", -1), "--seed must be in [0, 2**63 - 1], got -1"),
        (("--seeds", "0,99999999999999999999"), "--seeds: a seed must be in [0, 2**63 - 1]"),
        (("--arms", ","), "--arms names no arm (choose from fp32, static, profile)"),
        (("--launcher", "torchrun", "--world-size", 2, "--nproc-per-node", 3),
         "--world-size 2 is not --nnodes 1 x --nproc-per-node 3: give one or the other"),
        (("--record-trace", "/proc/nfabric-trace"), "--record-trace /proc/nfabric-trace: cannot "
                                                    "write in /proc"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, prof, args, fragment):
    bad_input(tmp_path, prof, *args, fragment=fragment)


@pytest.mark.parametrize("where", ["/proc/nfabric-report", "file"])
def test_a_report_folder_nothing_can_be_written_in_exits_2_before_any_rank(tmp_path, prof, where):
    report = tmp_path / "file" if where == "file" else where
    (tmp_path / "file").write_text("not a folder")
    r = runner.invoke(app, ["validate", str(prof), "--workload", TINY, "--report", str(report)])
    assert r.exit_code == 2, (r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    why = "cannot write in /proc" if where != "file" else "is a file, not a folder"
    assert len(lines) == 1 and f"--report {report}: {why}" in lines[0], r.stderr
    assert (tmp_path / "file").read_text() == "not a folder"


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
