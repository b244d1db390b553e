"""Run an integration example as users run it (its own launcher or torchrun) and read the
JSON each rank wrote."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "integrations"
# what a launcher of an enclosing run would leave behind must not leak into the example's
LAUNCH_VARS = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK",
               "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_example(script: str, *args: str, torchrun: bool = False, ranks: int = 2,
                timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable]
    if torchrun:
        cmd += ["-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                "--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
    cmd += [str(EXAMPLES / script), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def ranks_of(out: Path, n: int = 2) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


def check_clean(proc: subprocess.CompletedProcess) -> None:
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "Traceback" not in log, log[-4000:]
    assert "nfabric: the run closed at step" not in log, log[-4000:]


def failure_line(proc: subprocess.CompletedProcess, start: str) -> str:
    """The one line of nfabric's error inside the framework's traceback."""
    assert proc.returncode != 0, proc.stdout + proc.stderr
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if start in ln]
    assert lines, (proc.stdout + proc.stderr)[-4000:]
    return lines[-1]
