"""What the framework adapters share: the attach options, the one-line errors, the metrics,
the per-rank state files."""

from __future__ import annotations

import inspect
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from nfabric_cli.atomic import atomic_path
from nfabric_cli.binding.compile import check_total_steps
from nfabric_cli.errors import InputError
from nfabric_cli.runtime.controller import check_options
from nfabric_cli.runtime.controller import fallbacks as count_fallbacks
from nfabric_cli.runtime.state import FabricState

#: Where a checkpoint keeps the fabric state: a key in a checkpoint dict (every rank's part,
#: gathered onto the writer), or one file per rank in a checkpoint folder, named as the
#: frameworks name their own per-rank RNG files (`rng_state_<rank>.pth`, `random_states_<i>.pkl`)
CHECKPOINT_KEY = "nfabric"
RANK_FILE = "nfabric_state_{rank}.pt"
#: the same for a run's second, third, ... attached model (Accelerate: a GAN's two models)
MODEL_RANK_FILE = "nfabric_model{index}_state_{rank}.pt"
#: a folder saved by nfabric before the per-rank files: every rank's part in one file
GATHERED_FILE = "nfabric_state.pt"


def rank_file(rank: int | str, index: int = 0) -> str:
    """The file of `rank`'s state of the run's `index`-th attached model (rank "*": a glob)."""
    return RANK_FILE.format(rank=rank) if index == 0 else MODEL_RANK_FILE.format(index=index,
                                                                                rank=rank)


def save_rank_state(fabric: FabricState, folder: str | os.PathLike[str], index: int = 0) -> Path:
    """Write this rank's fabric state (the shared part and its own residuals, byte counters
    and events: `state_dict(all_ranks=False)`) to `folder`, atomically; every rank calls it.
    No collective, and no rank holds another's residuals: gathering them (W x the compressed
    parameters in float32 on a rank) would not fit a large model's host memory. `index`: which
    of the run's attached models (each has its own file)."""
    path = Path(folder) / rank_file(fabric.rank, index)
    state = fabric.state_dict(all_ranks=False)
    with atomic_path(path) as tmp:
        torch.save(state, tmp)
    return path


def load_rank_state(fabric: FabricState, folder: str | os.PathLike[str], framework: str,
                    index: int = 0) -> None:
    """Restore this rank's state from `folder` (`save_rank_state`; or the one gathered file
    an earlier nfabric wrote there); every rank calls it. One line when the folder holds
    neither, or a file that is not a saved state. A folder saved by another number of ranks
    resumes (`resume_state`): a rank without a file of its own takes the shared part from
    another rank's. Then the ranks compare what they loaded (one small all-gather): a rank
    that failed fails them all with its line, and ranks that loaded different steps (a folder
    holding files of two runs) are refused, instead of training out of step. A closed state
    (its run ended, and the framework loads a checkpoint to evaluate it) takes nothing: it
    drives no step, and every rank's closes alike; rank 0 says so (a run meant to resume from
    it must attach first, then load)."""
    if fabric.closed:
        if fabric.rank == 0:
            warnings.warn(f"nfabric: {framework} loaded {folder} with the fabric's state closed: "
                          "the fabric's part was not restored (to resume training from it, "
                          "attach first, then load)", stacklevel=3)
        return
    failed: BaseException | None = None
    try:
        saved = _read_rank_state(fabric, Path(folder), framework, index)
        resume_state(fabric, saved)
        outcome: tuple[str | None, int] = (None, fabric.step)
    except Exception as exc:  # noqa: BLE001 - told to every rank below, then raised here
        why = str(exc) if isinstance(exc, InputError) else f"{type(exc).__name__}: {exc}"
        outcome, failed = (why, -1), exc
    if fabric.world_size > 1:
        every: list[Any] = [None] * fabric.world_size
        dist.all_gather_object(every, outcome, group=fabric.comm.group)
    else:
        every = [outcome]
    if failed is not None:
        raise failed
    errors = [(r, err) for r, (err, _) in enumerate(every) if err is not None]
    if errors:
        rank, err = errors[0]
        raise InputError(f"nfabric: rank {rank} could not resume: {err.removeprefix('nfabric: ')}")
    if len({step for _, step in every}) > 1:
        at = ", ".join(f"rank {r} at {step}" for r, (_, step) in enumerate(every))
        raise InputError(f"nfabric: {framework} resumed the ranks at different steps from "
                         f"{folder} ({at}): it holds rank files of more than one run")


def _read_rank_state(fabric: FabricState, folder: Path, framework: str, index: int) -> Any:
    """The saved state this rank resumes from (`load_rank_state`)."""
    path = folder / rank_file(fabric.rank, index)
    if not path.is_file() and index == 0 and (folder / GATHERED_FILE).is_file():
        path = folder / GATHERED_FILE
    if path.is_file():
        return _torch_load(path)
    # saved by another number of ranks? every rank's file holds the shared part; decided by
    # the world size it records, not by how many files this node's folder holds
    present = sorted(folder.glob(rank_file("*", index)))  # the same file on every run
    if present:
        other = _torch_load(present[0])
        if isinstance(other, dict) and other.get("world_size") != fabric.world_size:
            return other
    saved = len(list(folder.glob(rank_file("*"))))
    order = f"the run's attached model {index + 1} has its own files: attach the models in "
    why = (order + "the order they were saved" if saved and index and not present else
           f"it holds {len(present)} of this world size's files: saved on another node, or "
           "cut short; each rank reads its own file" if present else
           "saved without nfabric, or on another node: each rank reads its own file")
    raise InputError(f"nfabric: {framework} resumes from {folder}, which holds no "
                     f"{rank_file(fabric.rank, index)} for this rank ({why})")


def _torch_load(path: Path) -> Any:
    try:
        return torch.load(path, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises several kinds for a damaged file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InputError(f"nfabric: {path} is not a readable fabric state ({first[:200]})") \
            from None


def resume_state(fabric: FabricState, saved: Any) -> None:
    """Load `saved` into `fabric`. One saved at another world size (a job resumed on more or
    fewer ranks) goes on without its per-rank part, with a warning (`strict=False`,
    `runtime/checkpoint.py`); at the same world size this rank's part must be there."""
    other = isinstance(saved, dict) and saved.get("world_size") != fabric.world_size
    fabric.load_state_dict(saved, strict=not other)


@dataclass
class AttachOptions:
    """`attach`'s options as an adapter forwards them (see `nfabric_cli.attach`)."""

    source: Any  # profile file or folder, bindings file, OperatingProfile or Bindings
    total_steps: int | None = None  # default: the framework's count of optimizer steps
    extra: dict[str, Any] = field(default_factory=dict)  # substrate, monitor, gate, seed

    def __post_init__(self) -> None:
        """The user's own values, checked where they are given (not after the ranks start)."""
        self.total_steps = check_total_steps(self.total_steps)
        named = sorted({"total_steps", "source", "ddp_model"} & set(self.extra))
        if named:
            raise InputError(f"nfabric: {', '.join(named)} in the attach options: pass "
                             "total_steps= (and the profile) to the adapter itself")
        from nfabric_cli import attach

        known = [p.name for p in inspect.signature(attach).parameters.values()
                 if p.kind is inspect.Parameter.KEYWORD_ONLY]
        unknown = sorted(set(self.extra) - set(known))
        if unknown:
            raise InputError(f"nfabric: unknown attach option(s) {', '.join(unknown)} (choose "
                             f"from {', '.join(known)})")
        check_options(self.extra.get("monitor", True), self.extra.get("gate", True),
                      self.extra.get("nonfinite", "zero"))
        if isinstance(self.source, (str, os.PathLike)):
            from nfabric_cli.profile.store import resolve_profile

            resolve_profile(self.source)  # a missing profile: now, not once the ranks start

    def attach(self, ddp: Any, total_steps: int | None, framework: str,
               hint: str = "", scaler: Any = None) -> FabricState:
        """`attach` as the framework set the run up; `scaler`: its loss scaler, if any."""
        from nfabric_cli import attach

        require_ddp(ddp, framework, hint)
        steps = self.total_steps if self.total_steps is not None else total_steps
        if not steps or steps < 1 or steps == float("inf"):
            raise InputError(f"nfabric: {framework} does not know how many optimizer steps the "
                             f"run takes (got {steps!r}): pass total_steps=")
        return attach(ddp, self.source, int(steps), **self.options(scaler))

    def options(self, scaler: Any = None) -> dict[str, Any]:
        """The keyword arguments for `attach`: the user's, and where the framework scales the
        loss (fp16 mixed precision: a `GradScaler`) and the user did not say otherwise,
        ``nonfinite="pass"``, so that the scaler sees an overflowing step and lowers its
        scale (a zeroed one looks finite to it)."""
        if scaler is None or "nonfinite" in self.extra:
            return dict(self.extra)
        return {**self.extra, "nonfinite": "pass"}


def require_ddp(model: Any, framework: str, hint: str = "") -> None:
    """One line when there is no multi-rank DDP model to attach to (training would silently
    run uncompressed)."""
    if not isinstance(model, DistributedDataParallel):
        world = os.environ.get("WORLD_SIZE", "1")
        raise InputError(
            f"nfabric: {framework} did not wrap the model in DistributedDataParallel (got "
            f"{type(model).__name__}, WORLD_SIZE={world}): start 2 or more processes"
            + (f"; {hint}" if hint else ""))
    if dist.get_world_size(model.process_group) < 2:
        raise InputError(f"nfabric: {framework} started a single process: nothing crosses the "
                         "network, so nothing would be compressed; start 2 or more")


def require_one_sync_per_step(accelerator: Any, accumulation: int, framework: str) -> None:
    """One line for Accelerate's `sync_each_batch` with gradient accumulation (the HF
    Trainer's too, through its accelerator): DDP then reduces on every micro-batch, so the
    hook would count micro-batches as steps (the phases squeezed into the run's first part)
    and compress again the part of `.grad` already reduced."""
    state = getattr(accelerator, "gradient_state", None)
    kwargs = getattr(state, "plugin_kwargs", None) or {}
    if accumulation > 1 and kwargs.get("sync_each_batch", False):
        raise InputError(
            f"nfabric: {framework} accumulates {accumulation} micro-batches with "
            "sync_each_batch=True, so DDP reduces on every one of them: nfabric counts and "
            "compresses one reduction per optimizer step; drop sync_each_batch")


def close_run(fabric: FabricState | None) -> None:
    """End a framework's run, once the framework and its callbacks are done with it: close
    the state and free its error-feedback residuals (a parameter's size each, on its device).
    The state still reads (bytes, events, routes); the adapters checkpoint only an open one
    (`is_open`)."""
    if fabric is not None:
        fabric.close()
        fabric.ef.reset()


def is_open(fabric: FabricState | None) -> bool:
    """Whether an adapter's state is attached and not yet closed (not a finished run's)."""
    return fabric is not None and not fabric.closed


def fabric_metrics(state: FabricState) -> dict[str, float]:
    """Scalars for a framework's logger: bytes so far, traffic vs full precision, fallbacks."""
    summary = state.meter.summary()
    fallbacks = count_fallbacks(state.events)
    return {"nfabric/traffic_fraction": float(summary["traffic_fraction"]),
            "nfabric/bytes": float(summary["bytes"]),
            "nfabric/fallbacks": float(fallbacks),
            "nfabric/skipped_steps": float(len(state.skipped_steps))}
