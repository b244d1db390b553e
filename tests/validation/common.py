"""Helpers for validation tests: run the CLI in a subprocess, a profile for the tiny workload."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from nfabric_cli.binding import static_profile
from nfabric_cli.profile import write_profile
from nfabric_cli.validation.launch import WORKER_MODULE
from tests.validation.tiny import TinyWorkload

REPO = Path(__file__).resolve().parents[2]
TINY = "tests.validation.tiny:build"
WIDE = "tests.validation.tiny:build_wide"


def env() -> dict[str, str]:
    out = dict(os.environ)
    out["OMP_NUM_THREADS"] = "1"
    out["PYTHONPATH"] = str(REPO) + os.pathsep + out.get("PYTHONPATH", "")
    return out


def nfabric_cmd(*args: object) -> list[str]:
    return [sys.executable, "-m", "nfabric_cli", *[str(a) for a in args]]


def nfabric(*args: object, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        nfabric_cmd(*args), cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout
    )


def head_fp32_profile(path: Path, workload: TinyWorkload | None = None,
                      proven: dict | None = None) -> Path:
    """The tiny workload's `head.*` on fp32, everything else on sign (like `profile init`);
    `proven`: the range a calibrated profile records (`meta["proven"]`)."""
    model = (workload or TinyWorkload()).build_model(0)
    profile = static_profile(model, "sign", [("head.*", "fp32")], workload="tiny")
    if proven is not None:
        profile.meta["proven"] = proven
    write_profile(profile, path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def summary(report: Path) -> dict:
    return json.loads((report / "summary.json").read_text())


def rank_pids(report: Path) -> list[int]:
    """Pids the ranks wrote into their progress files (kept when a run fails)."""
    pids = []
    for path in report.glob(".run-node*/progress.*.json"):
        pids.append(json.loads(path.read_text())["pid"])
    return pids


def alive_workers(pids: list[int]) -> list[int]:
    """Those of `pids` that are still a live validation worker (not gone, not a zombie)."""
    alive = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if WORKER_MODULE.encode() in cmdline or b"nfabric_cli" in cmdline:
            alive.append(pid)
    return alive
