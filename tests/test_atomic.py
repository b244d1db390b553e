"""Atomic writes: a path that cannot be written is one line for the CLI, and still an OSError
for code that falls back when a write fails (the glyphs cache on a read-only home)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nfabric_cli.atomic import atomic_write_text
from nfabric_cli.errors import InputError


def test_an_unwritable_path_is_an_input_error_and_an_os_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    for bad, why in ((tmp_path / "file" / "out.txt", "file is a file"),
                     (tmp_path, "is a directory, not a file to write")):
        with pytest.raises(InputError, match=why) as caught:
            atomic_write_text(bad, "y")
        assert isinstance(caught.value, OSError)  # `except OSError` fallbacks still catch it
    try:
        atomic_write_text(tmp_path / "file" / "cache.npz", "y")
    except OSError:
        pass  # glyphs_data's fallback: the run goes on without its cache
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing half-written
