"""Error types shared by every layer.

`InputError` means "you gave me something I cannot use": the CLI prints its message as one
line and exits 2. Anything else escaping a command is a bug (exit 3, traceback with --debug).
"""

from __future__ import annotations

import functools
import os
import traceback
from pathlib import Path


class InputError(Exception):
    """Bad input from the user: a missing file, an unknown name, a value out of range."""


class WriteError(InputError, OSError):
    """A path that cannot be written (its parent is a file, no permission, a full disk): one
    line for the CLI, and still an OSError to code that falls back when a write fails."""


class CheckFailed(Exception):
    """A check ran and found a difference or a failure (exit code 1)."""


class PluginError(InputError):
    """The user's own code (a plugin workload or model) raised where nfabric ran it in another
    process: its line, exit 2 like the same error raised here (`user_frame`)."""


def user_frame(exc: BaseException) -> str | None:
    """`file:line in function` of the innermost frame of `exc`'s traceback that is the user's
    own code (a plugin workload's module, say) rather than nfabric's, Python's or an installed
    package's (torch), when that frame is the innermost of nfabric's and the user's: the
    user's code raised, or called torch with what torch refused. None: nfabric raised it (an
    internal error) or nothing in it is the user's."""
    package = str(Path(__file__).resolve().parent)
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = str(Path(frame.filename).resolve())
        if path.startswith(package + os.sep):  # (before the libraries: installed, it is one)
            return None
        if frame.filename.startswith("<") or _library(path):
            continue  # torch, numpy, Python's own: whoever called them decides
        return f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}"
    return None


def _library(path: str) -> bool:
    """Whether `path` is Python's own or an installed package's: the interpreter's paths, the
    site folders (the user's too), or anything under a `site-packages` or `dist-packages`
    folder (Debian's, a virtual environment's elsewhere). A package reached through
    PYTHONPATH from a folder of another name reads as the user's code."""
    if {"site-packages", "dist-packages"} & set(Path(path).parts):
        return True
    return any(path.startswith(root) for root in _library_roots())


@functools.lru_cache(maxsize=1)
def _library_roots() -> tuple[str, ...]:
    """The interpreter's library folders and the site folders, resolved, each with a trailing
    separator (read once, not per frame)."""
    import site
    import sysconfig

    roots = [sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    roots += [*site.getsitepackages(), site.getusersitepackages()]
    return tuple(str(Path(r).resolve()) + os.sep for r in roots)
