"""Ctrl-C at safe points in long loops.

Python raises KeyboardInterrupt wherever the main thread is when SIGINT arrives; inside a
finaliser (a ``__del__``, a weakref callback, a logging lock's release) it is printed as
"Exception ignored in ..." and lost, and a training loop runs on as if nothing happened.
Inside `deferred_sigint()` the first SIGINT only sets a flag that the loop checks between
units of work (`Deferred.check`, which raises KeyboardInterrupt there); a second SIGINT
raises at once, as the default handler would, for a loop stuck inside one unit.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class Deferred:
    """A SIGINT noticed but not yet raised."""

    def __init__(self) -> None:
        self.pending = False

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.pending:  # asked twice: do not wait for the loop
            raise KeyboardInterrupt
        self.pending = True

    def check(self) -> None:
        """Raise KeyboardInterrupt here if SIGINT came since the last check."""
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt


@contextmanager
def deferred_sigint() -> Iterator[Deferred]:
    """Defer SIGINT to the loop's `check()` calls while inside; one still pending when the
    block ends normally is raised then (never lost). Changes nothing outside the main thread
    or where SIGINT already has a handler other than Python's default (the application's)."""
    deferred = Deferred()
    ours = (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    if not ours:
        yield deferred
        return
    previous = signal.signal(signal.SIGINT, deferred.handle)
    try:
        yield deferred
    finally:
        signal.signal(signal.SIGINT, previous)
    deferred.check()
