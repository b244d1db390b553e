"""`attach(ddp_model, profile_or_bindings, total_steps)`: the one call users make.

`FabricState.create(...)` makes the same state without registering it, for PyTorch's own idiom
``ddp.register_comm_hook(state, fabric_hook)``.

Compiles a profile against `ddp_model.module` (same rules and errors as `compile-profile`) or
loads bindings, checks that they cover the model, creates a dedicated process group for the
fabric's collectives (so they never interleave with DDP's own), registers `fabric_hook`, and
returns the `FabricState` (phase, byte counters, event log, `observe(loss)`).
"""

from __future__ import annotations

import atexit
import logging
import os
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from nfabric_cli.atomic import check_writable
from nfabric_cli.binding.bindings import Bindings
from nfabric_cli.binding.buckets import makes_sparse
from nfabric_cli.binding.compile import check_total_steps, compile_profile, whole_number
from nfabric_cli.binding.fingerprint import model_fingerprint, trainable_parameters
from nfabric_cli.binding.store import load_bindings_or_profile, other_world_size
from nfabric_cli.errors import InputError
from nfabric_cli.profile.operating import OperatingProfile
from nfabric_cli.profile.proven import outside_proven
from nfabric_cli.runtime import groups
from nfabric_cli.runtime.agreement import attach_facts, check_ranks_agree
from nfabric_cli.runtime.controller import check_options
from nfabric_cli.runtime.hook import fabric_hook
from nfabric_cli.runtime.inject import Injection
from nfabric_cli.runtime.state import FROZEN_AFTER_DDP, FabricState
from nfabric_cli.runtime.trace import TraceRecorder
from nfabric_cli.substrate.model import Substrate

_LIVE: weakref.WeakSet[FabricState] = weakref.WeakSet()
_log = logging.getLogger("nfabric")


def attach(
    ddp_model: DistributedDataParallel,
    source: str | os.PathLike[str] | Bindings | OperatingProfile,
    total_steps: int | None = None,
    *,
    substrate: Substrate | dict[str, Any] | None = None,
    monitor: bool = True,
    gate: bool | str = True,
    seed: int = 0,
    dedicated_group: bool = True,
    trace_dir: str | os.PathLike[str] | None = None,
    nonfinite: str = "zero",
) -> FabricState:
    """Register the fabric hook on `ddp_model` and return its state.

    `source` is a profile (file or directory) or bindings file, or an `OperatingProfile` or
    `Bindings` object.
    `total_steps` places the phase boundaries (fractions of the run); it is required when the
    profile has more than one phase and the bindings do not carry it. The hook's collectives
    go on a copy of DDP's process group, a closed state's if there is one
    (`runtime/groups.py`); `dedicated_group=False` sends them on DDP's own.
    `trace_dir` records per-bucket traces for `nfabric replay` (see `runtime/trace.py`).
    `gate`: the capacity gate (False: every bucket as written); ``"measure"``: with no
    substrate, time whole steps on the low-bit and fp32 paths and keep the faster (`probe.py`).
    `nonfinite`: a step whose gradients are not finite is ``"zero"``-ed on every rank (a NaN
    update would wreck the model), or, with a loss scaler (AMP's ``GradScaler``), ``"pass"``-ed
    on not finite as plain DDP does, so that the scaler skips it and lowers its scale.
    The same as ``ddp_model.register_comm_hook(FabricState.create(...), fabric_hook)`` the
    first time; attached again once the model's state is closed, that state hands its buckets
    over to the new one (DDP keeps its first hook for life).

    Example::

        state = nfabric_cli.attach(ddp, "profiles/vision", total_steps=1000)
    """
    return attach_with(ddp_model, source, total_steps, substrate=substrate, monitor=monitor,
                       gate=gate, seed=seed, dedicated_group=dedicated_group, trace_dir=trace_dir,
                       nonfinite=nonfinite)


def attach_with(
    ddp_model: DistributedDataParallel,
    source: str | os.PathLike[str] | Bindings | OperatingProfile,
    total_steps: int | None = None,
    *,
    injections: tuple[Injection, ...] = (),
    direct_fp32: bool = True,
    **options: Any,
) -> FabricState:
    """`attach` with the validation harness's knobs: injected faults (`validate --inject`,
    tests) and `direct_fp32=False` (all-fp32 phases through the worker path too: tests,
    tracing)."""
    previous = _closed_fabric(ddp_model)
    state = create_state(ddp_model, source, total_steps, injections=injections,
                         direct_fp32=direct_fp32, _rehook=previous is not None, **options)
    if previous is None:
        ddp_model.register_comm_hook(state, fabric_hook)
    else:  # DDP keeps its first hook for life: the closed state passes the buckets on
        previous.hand_over(state)
    return state


def _closed_fabric(ddp_model: Any) -> FabricState | None:
    """The nfabric state registered on `ddp_model` when it, and the state it hands over to if
    any, are closed: it can hand over to a new one (`FabricState.hand_over`); else None."""
    for hook, registered in getattr(ddp_model, "_comm_hooks", None) or []:
        if hook is fabric_hook and isinstance(registered, FabricState):
            current = registered._successor or registered
            return registered if current.closed else None
    return None


def create_state(
    ddp_model: DistributedDataParallel,
    source: str | os.PathLike[str] | Bindings | OperatingProfile,
    total_steps: int | None = None,
    *,
    substrate: Substrate | dict[str, Any] | None = None,
    monitor: bool = True,
    gate: bool | str = True,
    seed: int = 0,
    dedicated_group: bool = True,
    trace_dir: str | os.PathLike[str] | None = None,
    injections: tuple[Injection, ...] = (),
    direct_fp32: bool = True,
    nonfinite: str = "zero",
    _rehook: bool = False,
) -> FabricState:
    """The state `attach` registers, not yet registered (`FabricState.create`); `_rehook`
    (`attach_with` only): the model's own closed nfabric state hands its buckets over to it.

    Every check that can fail on one rank alone (a file missing on one node, a total_steps
    of 0 from one rank's loader) runs before one all-gather that every rank joins
    (`agreement.py`): a rank that failed raises its own error there, the others raise that it
    failed, and none waits for it in a later collective."""
    if not isinstance(ddp_model, DistributedDataParallel):
        raise InputError(f"attach needs a DistributedDataParallel model, got {type(ddp_model).__name__}")
    module = ddp_model.module
    pg = ddp_model.process_group
    trainable = trainable_parameters(module)  # the all-gather goes on their device (NCCL)
    device = trainable[0].param.device if trainable else torch.device("cpu")
    try:
        bindings, steps, seed, sizes = _bind(ddp_model, source, total_steps, substrate, seed, monitor,
                                      gate, nonfinite, trace_dir, _rehook)
    except Exception:  # (any failure: the other ranks must not wait for this one)
        check_ranks_agree(pg, None, device)  # the other ranks learn it, and raise
        raise
    reuse = groups.reusable(pg) if dedicated_group else None
    check_ranks_agree(pg, attach_facts(bindings, steps, (monitor, gate, nonfinite, dedicated_group),
                                       groups.name(reuse)), device)
    world_size = dist.get_world_size(pg)
    if dist.get_rank(pg) == 0:
        notes = other_world_size(bindings, world_size)
        if steps is not None:
            notes = outside_proven(bindings.meta, steps=steps, world_size=world_size) + notes
        for note in notes:
            warnings.warn(f"nfabric: {note}", stacklevel=3)
    group = groups.lend(pg, reuse) if dedicated_group else pg  # (a closed state's, or new)
    try:
        trace = None
        if trace_dir is not None:  # (checked writable in `_bind`)
            trace = TraceRecorder(trace_dir, dist.get_rank(group), dist.get_world_size(group),
                                  dist.get_backend(group))
        state = FabricState(
            bindings, module, steps, group,
            monitor=monitor, gate=gate, injections=tuple(injections), seed=seed, trace=trace,
            direct_fp32=direct_fp32, nonfinite=nonfinite,
        )
    except BaseException:
        groups.give_back(group)  # (no state holds it)
        raise
    state.first_step_check = watch_static_graph(ddp_model, sizes)
    _LIVE.add(state)
    return state


def _bind(ddp_model: DistributedDataParallel, source: Any, total_steps: int | None,
          substrate: Any, seed: Any, monitor: bool, gate: bool | str, nonfinite: str,
          trace_dir: Any, rehook: bool
          ) -> tuple[Bindings, int | None, int, list[int] | None]:
    """`create_state`'s checks and the bindings: (bindings, the run's steps, the seed, DDP's
    bucket sizes as `_bucket_sizes` read them)."""
    if getattr(ddp_model, "_comm_hooks", None) and not rehook:  # one hook, for DDP's lifetime
        raise InputError("this DDP model already has a communication hook (another, or an "
                         "nfabric state still open): attach once per DDP model, before any "
                         "other hook, or attach again once its nfabric state is closed")
    total_steps = check_total_steps(total_steps)
    whole = whole_number(seed)
    if whole is None:
        raise InputError(f"seed must be an integer, got {seed!r}")
    check_options(monitor, gate, nonfinite)  # (before any group or trace folder is made)
    if not isinstance(source, (str, os.PathLike, Bindings, OperatingProfile)):
        raise InputError("attach takes a profile or bindings (a path, an OperatingProfile or "
                         f"Bindings), got {type(source).__name__}")
    if substrate is not None and not isinstance(substrate, (dict, Substrate)):
        raise InputError(f"substrate must be a Substrate or its dict, got {substrate!r}")
    if trace_dir is not None:
        check_writable(trace_dir, "trace_dir", folder=True)
    module = ddp_model.module
    _check_dense(module)
    sizes = _bucket_sizes(ddp_model)
    _check_static_graph(ddp_model, sizes, at_attach=True)
    _check_frozen_after_ddp(ddp_model, sizes)
    world_size = dist.get_world_size(ddp_model.process_group)
    if isinstance(source, Bindings):
        bindings = source
        if model_fingerprint(module) != bindings.fingerprint:  # as a bindings file is checked
            raise InputError(
                f"these bindings were compiled for another model (fingerprint "
                f"{bindings.fingerprint}, this model {model_fingerprint(module)}): compile the "
                "profile against this model")
    else:
        bind = (compile_profile if isinstance(source, OperatingProfile)
                else load_bindings_or_profile)
        bindings = bind(
            source, module, world_size=world_size, total_steps=total_steps,
            bucket_cap_mb=_bucket_cap_mb(ddp_model), substrate=substrate,
            find_unused_parameters=bool(ddp_model.find_unused_parameters),
        )
    _check_coverage(bindings, module)
    for note in (bindings.meta.get("model_match") or {}).get("notes", []):
        _log.info("nfabric: the profile matched this model after a rename: %s", note)
    steps = total_steps or bindings.total_steps
    if steps is None and len(bindings.phases) > 1:
        raise InputError("the profile has several phases: pass total_steps to attach")
    return bindings, steps, whole, sizes


def _bucket_cap_mb(ddp_model: DistributedDataParallel) -> float | None:
    """The `bucket_cap_mb` this DDP was built with; None for DDP's default (small first bucket).

    The bucket plan is only a forecast (the hook keys everything by parameter name), but a
    matching plan makes the modelled bytes and verdicts describe the real buckets.
    """
    cap = ddp_model.bucket_bytes_cap
    default = getattr(ddp_model, "bucket_bytes_cap_default", None)
    if default is None:
        cfg = getattr(ddp_model, "_bucket_config", None)
        default = cfg is not None and cfg.first_bucket_bytes_cap < cfg.bucket_bytes_cap
    return None if default else cap / (1024 * 1024)


def _check_dense(module: Any) -> None:
    """The hook slices dense buckets; DDP hands a sparse gradient over in a bucket of its own
    that cannot be sliced, and the run would fail at its first backward, in a torch error."""
    sparse = [f"{name!r} ({type(m).__name__})" for name, m in module.named_modules()
              if makes_sparse(m)]
    if sparse:
        more = f" (+{len(sparse) - 3} more)" if len(sparse) > 3 else ""
        raise InputError(
            f"nfabric reduces dense gradients only, and module {', '.join(sparse[:3])}{more} "
            "makes sparse ones (sparse=True): build it with sparse=False to attach")


def _check_static_graph(ddp_model: DistributedDataParallel, sizes: list[int] | None,
                        at_attach: bool) -> None:
    """`static_graph=True` reduces its first step's buckets at the end of backward
    (`Reducer::delay_all_reduce`), each labelled with the same bucket index, so none is the
    last: with more than one bucket on that step (one per dtype, or `bucket_cap_mb_list`),
    the step never completes (measured: two ranks, a float32 and a bfloat16 layer, killed
    after 60 s; one bucket trains, `tests/runtime/test_hook.py`). Past its first step the
    buckets are indexed as usual. Checked at attach and again at the first step's first
    bucket (`watch_static_graph`), for `ddp._set_static_graph()` called in between (torch
    refuses it once training has started). At attach, a DDP that has enqueued its delayed
    reduce is past its first step; during that reduce the flag is set already."""
    if not getattr(ddp_model, "static_graph", False) or (at_attach and getattr(
            ddp_model, "_static_graph_delay_allreduce_enqueued", False)):
        return
    buckets = len(sizes) if sizes is not None else len(
        {p.dtype for p in ddp_model.module.parameters() if p.requires_grad})
    if buckets > 1:
        late = "" if at_attach else ", set after attach"
        raise InputError(f"DDP(static_graph=True{late}) reduces its first step's {buckets} buckets "
                         "with none marked last, and nfabric would wait for it: build DDP "
                         "without static_graph (or with one bucket: one parameter dtype, no "
                         "bucket_cap_mb_list)")


def watch_static_graph(ddp_model: DistributedDataParallel,
                       sizes: list[int] | None) -> Callable[[], None] | None:
    """The check `FabricState` runs at its first step's first bucket (`_check_static_graph`,
    for a static graph set after attach), holding the model weakly; measured: the same two
    ranks as at attach, `_set_static_graph()` called after it, hung at the first step. None
    when the graph is static already: that passed attach's check (or DDP was past its first
    step then), and torch refuses the call once training has started. `sizes`: attach's
    `_bucket_sizes`."""
    if getattr(ddp_model, "static_graph", False):
        return None
    ref = weakref.ref(ddp_model)

    def check() -> None:
        ddp = ref()
        if ddp is not None:
            _check_static_graph(ddp, sizes, at_attach=False)
    return check


def _bucket_sizes(ddp_model: DistributedDataParallel) -> list[int] | None:
    """The bytes of each bucket DDP holds now (before its first step: that step's), from its
    logging data (a private API: None where it is unavailable; under `static_graph` the first
    step's buckets are then one per dtype)."""
    try:
        sizes = ddp_model._get_ddp_logging_data().get("bucket_sizes")
        return [int(x) for x in str(sizes).split(",")] if sizes else None
    except Exception:  # noqa: BLE001 - a private API: the callers fall back
        return None


def _check_frozen_after_ddp(ddp_model: DistributedDataParallel,
                            sizes: list[int] | None) -> None:
    """DDP fixes which parameters its buckets hold when it is built; one frozen after that
    (`requires_grad_(False)`) stays in them, and nfabric, which binds trainable parameters
    only, would meet it in a bucket (`FabricState._foreign` says the same line there where
    DDP's logging data is missing). Caught here when DDP's buckets hold more bytes than the
    trainable parameters it
    does not ignore; fewer (one made trainable after DDP was built, which DDP never reduces,
    as in plain DDP: its replicas drift apart) is warned about. `sizes`: `_bucket_sizes`."""
    if sizes is None:
        return
    ignored = getattr(ddp_model, "parameters_to_ignore", set())
    trainable = sum(p.numel() * p.element_size() for n, p in ddp_model.module.named_parameters()
                    if p.requires_grad and n not in ignored)
    if sum(sizes) > trainable:
        raise InputError(FROZEN_AFTER_DDP)
    if sum(sizes) < trainable:
        warnings.warn("nfabric: the model has trainable parameters DDP's buckets do not hold "
                      "(made trainable after DDP was built?): DDP never reduces them, so "
                      "their replicas drift apart, as in plain DDP; set requires_grad before "
                      "wrapping the model in DDP", stacklevel=3)


def _check_coverage(bindings: Bindings, module: Any) -> None:
    names = {p.name for p in trainable_parameters(module)}
    missing = sorted(names - set(bindings.params))
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise InputError(f"bindings do not cover {len(missing)} trainable parameter(s): {shown}")


@atexit.register
def _close_all() -> None:
    # Join worker threads before interpreter teardown destroys the process groups under them.
    for state in list(_LIVE):
        state.close()
