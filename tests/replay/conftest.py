"""One real 2-rank trace for every replay test (recording spawns processes: do it once)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.replay.record import record_trace


@pytest.fixture(scope="session")
def recorded(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trace") / "t"
    record_trace(str(out))
    return out


@pytest.fixture()
def trace_copy(recorded: Path, tmp_path: Path) -> Path:
    """A private copy a test may damage."""
    return Path(shutil.copytree(recorded, tmp_path / "t"))
