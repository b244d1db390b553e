"""Start the replay ranks, optionally behind a shaped link, and collect their results.

Each rank is ``python -m nfabric_cli.replay.worker`` in its own session; the ranks meet
through a FileStore in a temp directory. With ``link_mbit`` they run inside a `ShapedLink`
namespace (every rank's traffic crosses one tbf-shaped loopback, i.e. a shared link). A rank
that exits non-zero, or a run past its deadline, kills every rank this run started and raises
`CheckFailed` with the failing rank's last log line.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from nfabric_cli.atomic import atomic_write_text
from nfabric_cli.ranks.netns import link_wrap
from nfabric_cli.ranks.sessions import kill, rank_env, start
from nfabric_cli.ranks.wait import wait_all
from nfabric_cli.replay.plan import ReplayPlan, estimated_seconds

WORKER_MODULE = "nfabric_cli.replay.worker"
STARTUP_S = 120.0  # importing torch on every rank of a loaded machine


def run_ranks(plan: ReplayPlan) -> list[dict[str, Any]]:
    """Run `plan` on `plan.world_size` processes; every rank's result, in rank order."""
    plan = dataclasses.replace(plan, timeout_s=STARTUP_S + 20 * estimated_seconds(plan))
    with tempfile.TemporaryDirectory(prefix="nfabric-replay-") as tmp, \
            link_wrap(plan.link_mbit) as wrap:
        run = Path(tmp)
        plan_path = run / "plan.json"
        atomic_write_text(plan_path, json.dumps(plan.to_dict()))
        deadline = time.monotonic() + plan.timeout_s
        procs = []
        try:
            for rank in range(plan.world_size):
                cmd = wrap([sys.executable, "-m", WORKER_MODULE, str(plan_path), str(rank),
                            str(run / "store"), str(run)])
                procs.append(start(cmd, rank_env(), run / f"rank{rank}.log", rank))
        except BaseException:
            kill(procs)
            raise
        wait_all(procs, deadline, "replay rank")  # kills every rank on any failure
        return [json.loads((run / f"rank{r}.json").read_text()) for r in range(plan.world_size)]
