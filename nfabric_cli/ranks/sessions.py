"""One worker process per rank, each in its own session, and how to stop them all.

A rank started here is `start_new_session=True`: its pid is its process-group id, so one
``killpg`` takes the rank and everything it started (torchrun's agent and workers, a
`ip netns exec` wrapper). Logs go to one file per process (stdout and stderr together).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Launched:
    """A started process: which rank it is (None: a launcher such as torchrun's agent) and its
    log file."""

    proc: subprocess.Popen
    rank: int | None
    log: Path


def rank_env(loopback: bool = True) -> dict[str, str]:
    """The environment of a rank process: one intra-op thread (W ranks share the machine's
    cores), unbuffered output (the log is the post mortem), and with `loopback` gloo bound to
    ``lo`` (one machine: never a real NIC)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if loopback:
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def start(cmd: list[str], env: dict[str, str], log: Path, rank: int | None) -> Launched:
    """Start `cmd` in a session of its own, its output into `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Launched(proc, rank, log)


def kill(procs: Iterable[Launched], extra_pids: Iterable[int] = ()) -> None:
    """SIGKILL the session of every process still alive (and of `extra_pids`: ranks that a
    launcher put in sessions of their own), then reap them all."""
    procs = list(procs)
    pids = {p.proc.pid for p in procs if p.proc.poll() is None} | set(extra_pids)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.proc.wait(timeout=10)


def last_line(log: Path) -> str:
    """The last non-empty line of a log ("no log" / "no output" when there is none)."""
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    return lines[-1].strip() if lines else "no output"
