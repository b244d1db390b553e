"""`run_validation(cfg)`: check the input, launch the ranks, build the report.

The parent checks everything it can before any rank starts (a bad arm, a profile compiled
for another model, a world size the data cannot shard: exit 2 in a second, not a crash in
N processes), writes the config into the run directory, launches (spawn or torchrun,
optionally inside a shaped-link namespace), and turns rank 0's results into the report.

Under ``torchrun ... -m nfabric_cli validate ...`` the CLI process *is* a rank
(`torchrun_worker()`): it runs its arms in-process and rank 0 writes the report.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nfabric_cli.atomic import atomic_write_text, check_writable
from nfabric_cli.errors import CheckFailed, InputError
from nfabric_cli.profile.proven import calibrated_steps
from nfabric_cli.ranks.exit import env_rank
from nfabric_cli.ranks.netns import link_wrap
from nfabric_cli.runtime.inject import check_steps, parse_injections
from nfabric_cli.runtime.trace import clear_trace
from nfabric_cli.validation.config import ValidateConfig, resolve_tolerance
from nfabric_cli.validation.launch import ProgressCallback, spawn_ranks, start_torchrun, supervise
from nfabric_cli.validation.report import claim_report, step_frame, summarize, write_report
from nfabric_cli.validation.worker import RESULTS_FILE, run_rank

RUNS_DIR = Path(".nfabric") / "runs"
RECORDS_FILE = "records.json"


@dataclass
class RunPlan:
    """A checked config plus the workload facts the report needs."""

    cfg: ValidateConfig
    workload: str
    higher_is_better: bool
    profile_meta: dict[str, Any] = field(default_factory=dict)
    data_fingerprint: str | None = None  # the workload's data here
    world_size_notes: list[str] = field(default_factory=list)  # `other_world_size`'s

    def outside_proven(self, seeds: list[int]) -> list[str]:
        """Where these seeds, the run's length or world size leave the profile's proven range,
        whether its proof leaves room for the new seeds' worst, and whether the data or the
        CPU here is other than the one it was calibrated on; and whether a bindings file was
        compiled for another world size."""
        from nfabric_cli.profile.proven import other_data, other_host, outside_proven, thin_margin
        from nfabric_cli.profile.provenance import host

        return outside_proven(self.profile_meta, seeds=seeds, steps=self.cfg.steps,
                              world_size=self.cfg.world_size) + thin_margin(
            self.profile_meta, seeds, self.cfg.tolerance) + other_data(
            self.profile_meta, self.data_fingerprint) + other_host(
            self.profile_meta, host()) + self.world_size_notes


@dataclass
class ValidationResult:
    """What the CLI renders. `summary` is None on a node or rank that does not report."""

    summary: dict[str, Any] | None
    report_dir: Path
    paths: dict[str, Path] = field(default_factory=dict)
    verdict: bool | None = None  # a non-reporting torchrun rank: rank 0's verdict

    @property
    def passed(self) -> bool:
        if self.summary is not None:
            return bool(self.summary["passed"])
        return self.verdict is None or self.verdict


def torchrun_worker() -> tuple[int, int] | None:
    """(rank, world size) when this process was started by torchrun, else None."""
    return env_rank() if "TORCHELASTIC_RUN_ID" in os.environ else None


def default_report_dir(workload: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", workload).strip("_") or "run"
    return RUNS_DIR / f"{time.strftime('%Y%m%d-%H%M%S')}-{safe}"


def default_steps(kind: str, meta: dict[str, Any], workload_steps: int) -> int:
    """The run length when `--steps` is not given: a bindings file's planned one
    (`compile-profile --total-steps`), else the length the profile was calibrated and proven
    at (`profile/proven.py`), else the workload's default. A calibrated profile is then
    validated, by default, where calibration vouches for it."""
    if kind == "bindings":
        if meta.get("total_steps"):
            return int(meta["total_steps"])
        meta = meta.get("profile") or {}
    return calibrated_steps(meta) or workload_steps


def plan(cfg: ValidateConfig) -> RunPlan:
    """Check `cfg` against the workload and the profile; fill steps, bucket cap, tolerance."""
    from nfabric_cli.binding import read_bindings
    from nfabric_cli.binding.store import other_world_size
    from nfabric_cli.profile.parquet import read_metadata
    from nfabric_cli.profile.store import resolve_profile
    from nfabric_cli.validation.arms import profile_bindings
    from nfabric_cli.workloads.base import find_unused
    from nfabric_cli.workloads.registry import get_workload

    cfg.check()
    if cfg.link_mbit is not None:
        from nfabric_cli.ranks.netns import link_available

        reason = link_available()
        if reason:
            raise InputError(reason)
    workload = get_workload(cfg.workload, cfg.data_dir)
    source = resolve_profile(cfg.source)
    kind, meta = read_metadata(source)
    cfg.steps = cfg.steps or default_steps(kind, meta, workload.default_steps)
    check_steps(parse_injections(cfg.inject), cfg.steps)
    steps_per_epoch = getattr(workload, "steps_per_epoch", None)
    if steps_per_epoch is not None:
        steps_per_epoch(cfg.world_size)  # InputError when a rank's shard is below one batch
    cfg.source = str(source.resolve())
    cfg.bucket_cap_mb = read_bindings(source).bucket_cap_mb if kind == "bindings" else None
    model = workload.build_model(cfg.seed)
    bindings = profile_bindings(cfg.source, model, cfg.world_size, cfg.steps, cfg.bucket_cap_mb,
                                find_unused(workload))
    higher = bool(workload.higher_is_better)
    cfg.tolerance = resolve_tolerance(cfg.tolerance, bindings.meta.get("target"), higher)
    if not cfg.report_dir:
        cfg.report_dir = str(default_report_dir(workload.name))
    check_writable(cfg.report_dir, "--report", folder=True)
    if cfg.record_trace is not None:
        check_writable(cfg.record_trace, "--record-trace", folder=True)
    return RunPlan(cfg, workload.name, higher, dict(bindings.meta), workload.data_fingerprint(),
                   other_world_size(bindings, cfg.world_size))


def run_validation(
    cfg: ValidateConfig, on_progress: ProgressCallback | None = None,
    on_outside: Callable[[list[str]], None] | None = None,
) -> ValidationResult:
    """Run every arm on real ranks and return the report (see module doc). `on_outside` gets
    the proven-range warnings once the input is checked, before anything is launched."""
    in_torchrun = torchrun_worker()
    if in_torchrun is not None:
        return _run_as_rank(cfg, *in_torchrun)
    run = plan(cfg)
    if on_outside is not None:
        on_outside(run.outside_proven([cfg.seed]))
    if on_progress is not None:
        on_progress({})  # checked: nothing has run yet (a progress bar may appear)
    report_dir = Path(cfg.report_dir)
    run_dir = report_dir / f".run-node{cfg.node_rank}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    if cfg.nnodes == 1:  # an earlier run's outputs (on several nodes: one node's might go)
        claim_report(report_dir)
        if cfg.record_trace is not None:
            clear_trace(cfg.record_trace)
    cfg.run_dir = str(run_dir.resolve())
    store_dir = tempfile.mkdtemp(prefix="nfabric-store-") if cfg.launcher == "spawn" else None
    try:
        cfg.store_path = None if store_dir is None else os.path.join(store_dir, "store")
        config_path = cfg.save(run_dir / "config.json")
        cfg.save(report_dir / "config.json")
        with _sigterm_as_exit(), link_wrap(cfg.link_mbit) as wrap:
            start = spawn_ranks if cfg.launcher == "spawn" else start_torchrun
            procs = start(cfg, config_path, report_dir / "logs", wrap)
            supervise(procs, run_dir, cfg.timeout_s, on_progress)
        results = run_dir / RESULTS_FILE
        if not results.exists():
            raise CheckFailed(f"every rank exited 0 but none wrote {results}")
        gathered = json.loads(results.read_text())
        result = _report(run, gathered, report_dir)
        shutil.rmtree(run_dir, ignore_errors=True)
        return result
    finally:
        if store_dir is not None:
            shutil.rmtree(store_dir, ignore_errors=True)


def _report(run: RunPlan, gathered: list[Any], report_dir: Path) -> ValidationResult:
    cfg = run.cfg
    assert cfg.tolerance is not None
    summary = summarize(
        gathered, workload=run.workload, higher_is_better=run.higher_is_better,
        tolerance=cfg.tolerance, link_mbit=cfg.link_mbit,
    )  # fmt: skip
    summary["outside_proven"] = run.outside_proven([cfg.seed])
    paths = write_report(report_dir, summary, step_frame(gathered))
    paths["records"] = report_dir / RECORDS_FILE  # the raw per-rank records, kept
    atomic_write_text(paths["records"], json.dumps(gathered))
    return ValidationResult(summary, report_dir, paths)


def _run_as_rank(cfg: ValidateConfig, rank: int, world_size: int) -> ValidationResult:
    """This process is one rank under torchrun: run in-process; rank 0 reports."""
    from nfabric_cli.validation.progress import ProgressWriter

    if cfg.launcher != "spawn" or cfg.link_mbit is not None:
        raise InputError("under torchrun, validate is already a rank: drop --launcher/--link-mbit")
    cfg.world_size = world_size
    run = plan(cfg)
    holder: dict[str, ValidationResult] = {}

    def finalize(gathered: list[Any]) -> bool:
        holder["result"] = _report(run, gathered, Path(cfg.report_dir))
        return bool(holder["result"].summary and holder["result"].summary["passed"])

    passed = run_rank(cfg, rank, world_size, ProgressWriter(None, rank), finalize, rank == 0)
    if rank == 0:
        return holder["result"]
    return ValidationResult(None, Path(cfg.report_dir), verdict=passed)


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so ranks are killed and the namespace deleted."""
    try:
        previous = signal.signal(signal.SIGTERM, _raise_exit)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
