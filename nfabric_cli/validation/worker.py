"""One rank of a validation run: every arm in turn on a fresh model, then the results to rank 0.

Entry points:
- ``python -m nfabric_cli.validation.worker CONFIG RANK``: a spawned rank; rendezvous through
  the run's FileStore (no ports).
- ``python -m nfabric_cli.validation.worker CONFIG`` under torchrun: rank and world size from
  the environment (``RANK``, ``WORLD_SIZE``, torchrun's store).
- `run_rank` in-process, for ``torchrun ... -m nfabric_cli validate ...``.

Each arm: build the model from the run's seed (same initial weights), wrap it in DDP with the
run's bucket cap, set the arm up (`arms.make_arm`), train `steps` steps on the workload's
batches for this rank (same data order; dropout masks from the seed's `RankRng`), then rank 0
evaluates. Step time is the wall time of forward + backward + optimizer step. Loopback
counters (shaped link only) are read by rank 0 between barriers around the training loop, so
DDP's start-up broadcast is not counted.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from nfabric_cli.ranks.exit import env_rank, exit_rank
from nfabric_cli.validation.config import ValidateConfig
from nfabric_cli.validation.progress import DONE, FAILED, KILLED, ProgressWriter

RESULTS_FILE = "results.json"


@dataclass
class ArmRecord:
    """What one rank measured in one arm."""

    arm: str
    rank: int
    loss: list[float]
    step_time_s: list[float]
    sent: list[int]
    received: list[int]
    fp32_reference: int | None
    events: list[dict[str, Any]] = field(default_factory=list)
    metric: float | None = None  # rank 0 only
    link: dict[str, int] | None = None  # loopback bytes during the loop (rank 0, shaped link)


def run_rank(
    cfg: ValidateConfig,
    rank: int,
    world_size: int,
    progress: ProgressWriter,
    finalize: Callable[[list[list[dict[str, Any]]]], bool],
    reports: bool,
) -> bool:
    """Run every arm on this rank. Every rank receives all ranks' records; those with
    `reports` set call `finalize(records per rank)`; rank 0's verdict is returned everywhere."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _init_group(cfg, rank, world_size)
    try:
        records = [asdict(r) for r in _run_arms(cfg, rank, world_size, progress)]
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, records)  # every node can write the full report
        verdict = [finalize(gathered) if reports else None]
        dist.broadcast_object_list(verdict, src=0)
        return bool(verdict[0])
    finally:
        dist.destroy_process_group()


def _init_group(cfg: ValidateConfig, rank: int, world_size: int) -> None:
    import datetime

    import torch.distributed as dist

    # Peers wait for rank 0's evaluation between arms; a dead peer is the launcher's job.
    timeout = datetime.timedelta(seconds=cfg.timeout_s + 60)
    if cfg.store_path:
        store = dist.FileStore(cfg.store_path, world_size)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timeout
        )
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)


def _run_arms(
    cfg: ValidateConfig, rank: int, world_size: int, progress: ProgressWriter
) -> list[ArmRecord]:
    from nfabric_cli.runtime.inject import parse_injections
    from nfabric_cli.validation.arms import ArmContext
    from nfabric_cli.workloads.registry import get_workload

    workload = get_workload(cfg.workload, cfg.data_dir)
    injections = tuple(parse_injections(cfg.inject))
    ctx = ArmContext(
        world_size=world_size, rank=rank, steps=int(cfg.steps),  # `plan` resolved it
        seed=cfg.seed, source=cfg.source, bucket_cap_mb=cfg.bucket_cap_mb,
        injections=tuple(i for i in injections if i.kind != "kill"),
        powersgd_rank=cfg.powersgd_rank, powersgd_start=cfg.powersgd_start_iter(),
        trace_dir=cfg.record_trace, measure_gate=cfg.gate == "measure",
    )  # fmt: skip
    kills = tuple(i for i in injections if i.kind == "kill")
    return [
        _run_arm(name, index, ctx, workload, kills, progress, cfg.link_mbit is not None)
        for index, name in enumerate(cfg.all_arms())
    ]


def _run_arm(
    name: str,
    index: int,
    ctx: Any,
    workload: Any,
    kills: tuple[Any, ...],
    progress: ProgressWriter,
    count_link: bool,
) -> ArmRecord:
    import torch.distributed as dist

    from nfabric_cli.ranks.loop import workload_ddp, workload_steps
    from nfabric_cli.ranks.netns import read_lo_counters
    from nfabric_cli.runtime.inject import KILL_EXIT_CODE, should_kill
    from nfabric_cli.validation.arms import make_arm
    from nfabric_cli.workloads.base import held_out_metric

    progress.update(name, index, 0)
    ddp = workload_ddp(workload, ctx.seed, ctx.bucket_cap_mb)
    arm = make_arm(name, ddp, ctx)
    optimizer, scheduler = workload.make_optimizer(ddp.parameters(), ctx.steps)
    losses: list[float] = []
    times: list[float] = []
    dist.barrier()
    before = read_lo_counters() if count_link and ctx.rank == 0 else None

    def before_step(step: int) -> None:
        if should_kill(kills, step, ctx.rank):
            progress.update(name, index, step)
            progress.finish(KILLED, KILL_EXIT_CODE, f"injected kill@{step}:{ctx.rank}")
            os._exit(KILL_EXIT_CODE)

    for step, loss, seconds in workload_steps(ddp, arm, workload, optimizer, scheduler,
                                              ctx.steps, ctx.rank, ctx.world_size, ctx.seed,
                                              before_step):
        times.append(seconds)
        losses.append(loss)
        progress.update(name, index, step + 1)
    dist.barrier()
    link = None
    if before is not None:
        after = read_lo_counters()
        link = {k: after[k] - before[k] for k in after}
    arm.close()
    sent, received = arm.step_bytes()
    metric = held_out_metric(workload, ddp.module) if ctx.rank == 0 else None
    return ArmRecord(
        name, ctx.rank, losses, times, sent, received, arm.fp32_reference(),
        list(arm.events), metric, link,
    )  # fmt: skip


def write_results(cfg: ValidateConfig, gathered: list[list[dict[str, Any]]]) -> bool:
    """A launched run: hand every rank's records to this node's launcher (results.json)."""
    import json

    from nfabric_cli.atomic import atomic_write_text

    atomic_write_text(os.path.join(cfg.run_dir, RESULTS_FILE), json.dumps(gathered))
    return True


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the launcher dies, even by SIGKILL (no orphaned ranks)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the launcher died before the call above
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    _die_with_parent()
    args = sys.argv[1:] if argv is None else argv
    cfg = ValidateConfig.load(args[0])
    from_env = env_rank()
    if len(args) > 1:
        rank, world_size = int(args[1]), cfg.world_size
    elif from_env is not None:
        rank, world_size = from_env
    else:
        print("usage: python -m nfabric_cli.validation.worker CONFIG [RANK]", file=sys.stderr)
        return 2
    progress = ProgressWriter(cfg.run_dir, rank)
    # One rank per node hands the records to that node's launcher (all of them under torchrun).
    reports = int(os.environ.get("LOCAL_RANK", rank)) == 0
    try:
        run_rank(cfg, rank, world_size, progress, lambda g: write_results(cfg, g), reports)
    except BaseException as exc:
        traceback.print_exc()
        progress.finish(FAILED, 1, f"{type(exc).__name__}: {exc}")
        sys.stderr.flush()
        # Not sys.exit: at-exit handlers would join threads blocked in a collective whose
        # peer is gone; the launcher has what it needs (this file, the exit code).
        os._exit(1)
    progress.finish(DONE, 0)
    return 0


if __name__ == "__main__":
    exit_rank(main())
