"""Start the ranks (spawn or torchrun), watch them, and never leave one behind.

- spawn: one ``python -m nfabric_cli.validation.worker CONFIG RANK`` process per rank, each in
  its own session; they meet through a FileStore in a temp directory (no port to race for,
  and it works from inside a network namespace).
- torchrun: ``python -m torch.distributed.run`` on the same worker module, single node
  (``--standalone``, or a given ``--rdzv-endpoint``) or one node of several (c10d rendezvous).

`supervise` polls the processes and the ranks' progress files. A rank that exits non-zero, or
whose progress stands still for `timeout_s` (until every rank has done one step: at least
`STARTUP_GRACE_S`), fails the run: every process is killed (its
whole session) and `CheckFailed` names the rank, the arm and the step. Kill order favours the
root cause: an injected kill, then a rank killed by a signal, then the first rank to report
an exception (its peers fail after it, on a closed connection).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

from nfabric_cli.errors import CheckFailed
from nfabric_cli.ranks import sessions
from nfabric_cli.ranks.sessions import Launched
from nfabric_cli.validation.config import ValidateConfig
from nfabric_cli.validation.progress import DONE, FAILED, KILLED, Progress, read_progress

WORKER_MODULE = "nfabric_cli.validation.worker"
POLL_S = 0.1
#: Start-up (importing torch, rendezvous, the first step) may take this long even with a
#: shorter --timeout.
STARTUP_GRACE_S = 120.0

ProgressCallback = Callable[[dict[int, Progress]], None]


def rank_env(cfg: ValidateConfig) -> dict[str, str]:
    env = sessions.rank_env(loopback=cfg.link_mbit is not None)  # a shaped link is loopback
    if cfg.nnodes == 1:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine: loopback, never a real NIC
    return env


def spawn_ranks(
    cfg: ValidateConfig, config_path: Path, logs: Path, wrap: Callable[[list[str]], list[str]]
) -> list[Launched]:
    env = rank_env(cfg)
    return [
        sessions.start(
            wrap([sys.executable, "-m", WORKER_MODULE, str(config_path), str(rank)]),
            env,
            logs / f"rank{rank}.log",
            rank,
        )  # fmt: skip
        for rank in range(cfg.world_size)
    ]


def torchrun_command(cfg: ValidateConfig, config_path: Path) -> list[str]:
    """The torchrun command line for this node."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(cfg.nnodes), "--nproc-per-node", str(cfg.nproc_per_node),
        "--max-restarts", "0",
    ]  # fmt: skip
    if cfg.rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        cmd += [
            "--node-rank", str(cfg.node_rank), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", cfg.rdzv_endpoint, "--rdzv-id", "nfabric-validate",
        ]  # fmt: skip
    return [*cmd, "-m", WORKER_MODULE, str(config_path)]


def start_torchrun(
    cfg: ValidateConfig, config_path: Path, logs: Path, wrap: Callable[[list[str]], list[str]]
) -> list[Launched]:
    cmd = wrap(torchrun_command(cfg, config_path))
    return [sessions.start(cmd, rank_env(cfg), logs / f"torchrun.node{cfg.node_rank}.log", None)]


# -- supervision ---------------------------------------------------------------------------------
class _Watch:
    """What the supervisor has seen: last progress change per rank, exits."""

    def __init__(self, expected: list[int]) -> None:
        start = time.monotonic()
        self.key: dict[int, tuple] = {}
        self.changed: dict[int, float] = {r: start for r in expected}
        self.exits: dict[int, tuple[float, int]] = {}  # index in `procs` -> (time, code)

    def see(self, progress: dict[int, tuple[Progress, float]]) -> None:
        t = time.monotonic()
        for rank, (p, _) in progress.items():
            key = (p.state, p.arm_index, p.step)
            if self.key.get(rank) != key:
                self.key[rank], self.changed[rank] = key, t


def supervise(
    procs: list[Launched],
    run_dir: Path,
    timeout_s: float,
    on_progress: ProgressCallback | None = None,
) -> None:
    """Return when every process exited 0; else kill them all and raise `CheckFailed`."""
    expected = [p.rank for p in procs if p.rank is not None]
    watch = _Watch(expected)
    try:
        while True:
            progress = read_progress(run_dir)
            watch.see(progress)
            if on_progress is not None:
                on_progress({r: p for r, (p, _) in progress.items()})
            for i, launched in enumerate(procs):
                code = launched.proc.poll()
                if code is not None and i not in watch.exits:
                    watch.exits[i] = (time.time(), code)
            failure = _failure(procs, watch, progress)
            if failure:
                raise CheckFailed(failure)
            if len(watch.exits) == len(procs):
                return
            stalled = _stalled(watch, progress, timeout_s)
            if stalled:
                raise CheckFailed(stalled)
            time.sleep(POLL_S)
    finally:
        kill_all(procs, run_dir)


def _failure(
    procs: list[Launched], watch: _Watch, progress: dict[int, tuple[Progress, float]]
) -> str | None:
    """The root cause among failed ranks, as one line; None while nothing failed."""
    suspects: list[tuple[int, float, int, str]] = []  # (priority, time, rank, message)
    for rank, (p, mtime) in progress.items():
        if p.state in (FAILED, KILLED):
            prio = 0 if p.state == KILLED else 2
            suspects.append((prio, mtime, rank, _rank_line(rank, p, p.exit_code, procs)))
    for i, (t, code) in watch.exits.items():
        launched = procs[i]
        if code == 0:
            continue
        if launched.rank is None:  # torchrun exited non-zero; a rank's file may say why
            suspects.append(
                (3, t, 1 << 30, f"torchrun exited with code {code}; log: {launched.log}")
            )
            continue
        p = progress.get(launched.rank, (Progress(launched.rank, launched.proc.pid), 0.0))[0]
        prio = 0 if p.state == KILLED else (1 if code < 0 else 2)
        suspects.append((prio, t, launched.rank, _rank_line(launched.rank, p, code, procs)))
    if not suspects:
        return None
    return min(suspects)[3]


def _rank_line(rank: int, p: Progress, code: int | None, procs: list[Launched]) -> str:
    where = f"step {p.step}" + (f" (arm {p.arm}" if p.arm else " (start-up")
    code_text = f"exit code {code}" if code is None or code >= 0 else f"signal {-code}"
    detail = f": {p.error}" if p.error else ""
    return f"rank {rank} failed at {where}, {code_text}){detail}; log: {_log_of(rank, procs)}"


def _log_of(rank: int, procs: list[Launched]) -> Path:
    for launched in procs:
        if launched.rank == rank:
            return launched.log
    return procs[0].log


def _stalled(
    watch: _Watch, progress: dict[int, tuple[Progress, float]], timeout_s: float
) -> str | None:
    now = time.monotonic()
    # Start-up lasts until every rank has finished one step: until then a rank that is ready
    # legitimately waits (in DDP's first broadcast) for one still importing torch.
    started = all(r in progress and progress[r][0].position() >= (0, 1) for r in watch.changed)
    limit = timeout_s if started else max(timeout_s, STARTUP_GRACE_S)
    late = []
    for r, changed in watch.changed.items():
        p = progress[r][0] if r in progress else None
        if p is not None and p.state == DONE:
            continue
        if now - changed > limit:
            late.append((p.position() if p else (-2, 0), changed, r, limit))
    if not late:
        return None
    _, _, rank, limit = min(late)
    where = progress[rank][0].where() if rank in progress else "start-up"
    return f"rank {rank} made no progress for {limit:g} s at {where} (--timeout); killed every rank"


def kill_all(procs: list[Launched], run_dir: Path) -> None:
    """SIGKILL every started session, and any rank (torchrun's workers have their own
    sessions) whose progress file names a live nfabric worker; reap them all."""
    workers = [p.pid for p, _ in read_progress(run_dir).values() if _is_worker(p.pid)]
    sessions.kill(procs, workers)


def _is_worker(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return WORKER_MODULE.encode() in cmdline
