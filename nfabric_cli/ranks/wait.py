"""Wait for every rank to finish, before a deadline, or stop them all and say which failed."""

from __future__ import annotations

import time

from nfabric_cli.errors import CheckFailed
from nfabric_cli.ranks.sessions import Launched, kill, last_line

POLL_S = 0.1


def wait_all(procs: list[Launched], deadline: float, what: str = "rank") -> None:
    """Return once every process exited 0. A non-zero exit, or `time.monotonic()` passing
    `deadline`, kills every process (their sessions) and raises `CheckFailed` naming the first
    failed rank with its exit code and last log line. The processes are reaped either way."""
    try:
        while True:
            codes = [p.proc.poll() for p in procs]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                p = procs[failed[0]]
                raise CheckFailed(f"{what} {p.rank} exited with code {codes[failed[0]]}: "
                                  f"{last_line(p.log)}")
            if all(c == 0 for c in codes):
                return
            if time.monotonic() > deadline:
                late = [p for p, c in zip(procs, codes, strict=True) if c is None]
                raise CheckFailed(f"{what} {late[0].rank} did not finish in time (last output: "
                                  f"{last_line(late[0].log)}); killed every {what}")
            time.sleep(POLL_S)
    finally:
        kill(procs)
