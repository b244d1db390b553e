"""Start the replay ranks, optionally behind a shaped link, and collect their results.

Each rank is ``python -m nfabric_cli.replay.worker`` in its own session; the ranks meet
through a FileStore in a temp directory. With ``link_mbit`` they run inside a `ShapedLink`
namespace (every rank's traffic crosses one tbf-shaped loopback, i.e. a shared link). A rank
that exits non-zero, or a run past its deadline, kills every rank this run started and raises
`CheckFailed` with the failing rank's last log line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from nfabric_cli.atomic import atomic_write_text
from nfabric_cli.errors import CheckFailed
from nfabric_cli.replay.plan import ReplayPlan, estimated_seconds

WORKER_MODULE = "nfabric_cli.replay.worker"
STARTUP_S = 120.0  # importing torch on every rank of a loaded machine


def run_ranks(plan: ReplayPlan) -> list[dict[str, Any]]:
    """Run `plan` on `plan.world_size` processes; every rank's result, in rank order."""
    plan = dataclasses.replace(plan, timeout_s=STARTUP_S + 20 * estimated_seconds(plan))
    with tempfile.TemporaryDirectory(prefix="nfabric-replay-") as tmp, _link(plan) as wrap:
        run = Path(tmp)
        plan_path = run / "plan.json"
        atomic_write_text(plan_path, json.dumps(plan.to_dict()))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   GLOO_SOCKET_IFNAME="lo")
        procs = []
        try:
            for rank in range(plan.world_size):
                cmd = wrap([sys.executable, "-m", WORKER_MODULE, str(plan_path), str(rank),
                            str(run / "store"), str(run)])
                with open(run / f"rank{rank}.log", "wb") as log:
                    procs.append(subprocess.Popen(
                        cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                        env=env, start_new_session=True,
                    ))  # fmt: skip
            _wait(procs, run, time.monotonic() + plan.timeout_s)
        finally:
            _kill(procs)
        return [json.loads((run / f"rank{r}.json").read_text()) for r in range(plan.world_size)]


def _wait(procs: list[subprocess.Popen], run: Path, deadline: float) -> None:
    while True:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            r = failed[0]
            raise CheckFailed(f"replay rank {r} exited with code {codes[r]}: "
                              f"{_last_line(run / f'rank{r}.log')}")
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            raise CheckFailed("replay ranks did not finish in time (a rank hung); killed them")
        time.sleep(0.1)


def _kill(procs: list[subprocess.Popen]) -> None:
    """SIGKILL the sessions of the ranks this run started that are still alive; reap all."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)


def _last_line(log: Path) -> str:
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    return lines[-1].strip() if lines else "no output"


@contextlib.contextmanager
def _link(plan: ReplayPlan) -> Iterator[Callable[[list[str]], list[str]]]:
    if plan.link_mbit is None:
        yield lambda cmd: cmd
        return
    from nfabric_cli.validation.netns import ShapedLink

    with ShapedLink(plan.link_mbit) as link:
        yield link.wrap
