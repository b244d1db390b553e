"""Ctrl-C deferred to a loop's safe points: never lost in a finaliser, never ignored."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from nfabric_cli.interrupt import deferred_sigint


@pytest.fixture(autouse=True)
def _ctrl_c_raises():
    """Python's default SIGINT handling, as under a terminal: a runner started in the
    background (`cmd &`, nohup) passes SIGINT on ignored, and then there is nothing to defer."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _sigint() -> None:
    os.kill(os.getpid(), signal.SIGINT)


def test_the_first_sigint_waits_for_the_check_and_the_handler_is_restored() -> None:
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    reached = []
    with pytest.raises(KeyboardInterrupt), deferred_sigint() as interrupt:
        interrupt.check()  # nothing pending: no-op
        _sigint()
        reached.append("after the signal")  # the default handler would have raised above
        interrupt.check()
        reached.append("after the check")
    assert reached == ["after the signal"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_sigint_raises_at_once() -> None:
    reached = []
    with pytest.raises(KeyboardInterrupt), deferred_sigint():
        _sigint()
        reached.append(1)
        _sigint()
        reached.append(2)
    assert reached == [1]


def test_a_sigint_still_pending_at_the_end_is_raised_not_lost() -> None:
    with pytest.raises(KeyboardInterrupt), deferred_sigint():
        _sigint()
    with deferred_sigint() as interrupt:  # and the next block starts clean
        interrupt.check()


def test_an_ignored_sigint_stays_ignored() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with deferred_sigint() as interrupt:
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        _sigint()
        interrupt.check()  # nothing was deferred


def test_outside_the_main_thread_or_under_another_handler_nothing_changes() -> None:
    seen: list[object] = []

    def worker() -> None:
        with deferred_sigint():
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [signal.default_int_handler]

    def mine(signum, frame) -> None:  # noqa: ANN001
        seen.append("app")

    previous = signal.signal(signal.SIGINT, mine)
    try:
        with deferred_sigint():
            assert signal.getsignal(signal.SIGINT) is mine
            _sigint()
        assert seen[-1] == "app"
    finally:
        signal.signal(signal.SIGINT, previous)
