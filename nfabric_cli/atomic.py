"""Atomic file writes: a reader never sees a half-written artefact."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from nfabric_cli.errors import WriteError


def _umask() -> int:
    """The process umask, read without changing it (os.umask would, racing other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], exclusive: bool = False) -> Iterator[Path]:
    """Yield a temp path beside `path`; on success rename it over `path`, else delete it.

    `exclusive`: never replace an existing `path` (FileExistsError instead): the temp file is
    hard-linked to its name, which fails if another writer got there first."""
    target = Path(path)
    if target.is_dir():
        raise WriteError(f"{target}: is a directory, not a file to write")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:  # a parent that is a file, no permission, a full disk: one line
        blocked = next((p for p in target.parents if p.exists() and not p.is_dir()), None)
        why = f"{blocked} is a file" if blocked is not None else exc.strerror or str(exc)
        raise WriteError(f"{target}: cannot write it ({why})") from None
    os.close(fd)
    # mkstemp creates 0600; artefacts (profiles, reports) get the usual umask-based mode.
    os.chmod(tmp, 0o666 & ~_umask())
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        if exclusive:
            os.link(tmp_path, target)
            tmp_path.unlink()
        else:
            os.replace(tmp_path, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def check_writable(path: str | os.PathLike[str], option: str, folder: bool = False) -> None:
    """Refuse, before any work, a destination nothing can be written to (a file where a
    folder is needed, a folder that takes no file, /proc): found after a long run, it would
    lose the run. `folder`: `path` is a folder the command writes into (it may not exist
    yet); else a file written in its parent. Probes the nearest existing folder with a
    temporary file, removed at once; creates nothing."""
    path = Path(path)
    existing = (path if folder else path.parent).absolute()
    try:  # (a folder on the way that cannot be searched raises from exists() too)
        if folder and path.exists() and not path.is_dir():
            raise WriteError(f"{option} {path}: is a file, not a folder")
        if not folder and path.is_dir():
            raise WriteError(f"{option} {path}: is a folder, not a file to write")
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir():
            raise WriteError(f"{option} {path}: {existing} is a file, not a folder")
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".nfabric-probe-")
        os.close(fd)
        os.unlink(probe)
    except WriteError:
        raise
    except OSError as exc:
        raise WriteError(f"{option} {path}: cannot write in {existing} "
                         f"({exc.strerror or type(exc).__name__})") from None
