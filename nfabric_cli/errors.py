"""Error types shared by every layer.

`InputError` means "you gave me something I cannot use": the CLI prints its message as one
line and exits 2. Anything else escaping a command is a bug (exit 1, traceback with --debug).
"""

from __future__ import annotations


class InputError(Exception):
    """Bad input from the user: a missing file, an unknown name, a value out of range."""


class CheckFailed(Exception):
    """A check ran and found a difference or a failure (exit code 1)."""
