"""Per-rank progress files: how the launcher knows where each rank is, and where one died.

Each rank rewrites `progress.<rank>.json` (atomically, a few hundred bytes) when it starts,
after every training step, and when it fails; the launcher polls the files. A rank that exits
with a non-zero code, or whose file stops changing for `--timeout` seconds, fails the run, and
the message names the rank, the arm and the step from this file. No torch import here: a rank
writes its first progress before paying for `import torch`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

STARTING, RUNNING, DONE, FAILED, KILLED = "starting", "running", "done", "failed", "killed"


@dataclass
class Progress:
    """Where one rank is: the arm (and its index in run order), the steps it has finished."""

    rank: int
    pid: int
    state: str = STARTING
    arm: str = ""
    arm_index: int = -1
    step: int = 0
    exit_code: int | None = None
    error: str = ""

    def position(self) -> tuple[int, int]:
        return (self.arm_index, self.step)

    def where(self) -> str:
        """'step 5 of arm fp32' (or 'start-up' before the first arm)."""
        if self.arm_index < 0:
            return "start-up"
        return f"step {self.step} of arm {self.arm}"


def progress_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(run_dir) / f"progress.{rank}.json"


class ProgressWriter:
    """What a rank calls; `run_dir=None` writes nothing (a rank run without a supervisor)."""

    def __init__(self, run_dir: str | os.PathLike[str] | None, rank: int) -> None:
        self.path = None if run_dir is None else progress_path(run_dir, rank)
        self.current = Progress(rank=rank, pid=os.getpid())
        self._write()

    def update(self, arm: str, arm_index: int, step: int, state: str = RUNNING) -> None:
        c = self.current
        c.arm, c.arm_index, c.step, c.state = arm, arm_index, step, state
        self._write()

    def finish(self, state: str, exit_code: int | None = None, error: str = "") -> None:
        c = self.current
        c.state, c.exit_code, c.error = state, exit_code, " ".join(error.split())[:300]
        self._write()

    def _write(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(self.current)))
        os.replace(tmp, self.path)


def read_progress(run_dir: str | os.PathLike[str]) -> dict[int, tuple[Progress, float]]:
    """rank -> (its progress, the file's mtime) for every rank that has written one."""
    out: dict[int, tuple[Progress, float]] = {}
    for path in Path(run_dir).glob("progress.*.json"):
        try:
            mtime = path.stat().st_mtime
            prog = Progress(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue  # replaced between glob and read, or not ours: next poll sees it
        out[prog.rank] = (prog, mtime)
    return out
