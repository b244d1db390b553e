"""Provenance every profile records: package versions, the git revision it was made at and
the CPU it was made on.

Provenance says where a profile came from, never what it decides; `diff-profile
--ignore-provenance` leaves it out. No wall-clock time is recorded, so rewriting the same
profile gives the same bytes.
"""

from __future__ import annotations

import functools
import subprocess
from importlib import metadata
from typing import Any

_PACKAGES = ("nfabric_cli", "torch", "optuna", "pyarrow")


def calibrated(meta: dict[str, Any]) -> bool:
    """Whether a profile's metadata says `nfabric calibrate` wrote it (provenance source)."""
    provenance = meta.get("provenance")
    return isinstance(provenance, dict) and provenance.get("source") == "calibrate"


def package_versions() -> dict[str, str]:
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def host() -> dict[str, str]:
    """The CPU a profile was made on (`_host`, read once a process; a copy, the caller's)."""
    return dict(_host())


@functools.lru_cache(maxsize=1)
def _host() -> dict[str, str]:
    """The CPU this process runs on: its architecture, ATen's kernel level on it (`AVX512`,
    `AVX2`, ...) and its model ('' where /proc/cpuinfo names none, as on ARM: the BLAS
    libraries pick their own code paths by model). Training's last bits can follow them, and
    after hundreds of steps its trajectory: the same code, packages and data gave
    `transformer.v12`'s proven cell seed 6, 600 steps, two ranks, 0.9556 here against 0.9667
    where it was calibrated (docs/calibration.md, "`transformer.v13`")."""
    import platform

    import torch

    model = ""  # (platform.processor() says "unknown", or the architecture again, on Linux)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f
                          if ln.startswith("model name")), model)
    except OSError:
        pass
    return {"machine": platform.machine(), "kernels": torch.backends.cpu.get_cpu_capability(),
            "cpu": model}


def git_revision(cwd: str | None = None) -> str | None:
    """HEAD of the git checkout at `cwd` (suffix '+dirty' with local changes), else None."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def base_provenance(**extra: Any) -> dict[str, Any]:
    """{"packages": {...}, "git_revision": ..., "host": {...}, **extra}: the part every
    producer shares."""
    return {"packages": package_versions(), "git_revision": git_revision(), "host": host(),
            **extra}
