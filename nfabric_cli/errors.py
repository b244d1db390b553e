"""Error types shared by every layer.

`InputError` means "you gave me something I cannot use": the CLI prints its message as one
line and exits 2. Anything else escaping a command is a bug (exit 3, traceback with --debug).
"""

from __future__ import annotations


class InputError(Exception):
    """Bad input from the user: a missing file, an unknown name, a value out of range."""


class WriteError(InputError, OSError):
    """A path that cannot be written (its parent is a file, no permission, a full disk): one
    line for the CLI, and still an OSError to code that falls back when a write fails."""


class CheckFailed(Exception):
    """A check ran and found a difference or a failure (exit code 1)."""
