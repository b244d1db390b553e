"""Checkpointing the fabric state: what a resumed run needs to decide and send exactly as an
uninterrupted one would.

Shared by every rank (the decisions are agreed): the step controller's state (the step, so
the phase and the stochastic rounding noise continue; the health monitor; the update guard's
windows; the capacity gate's verdicts and revocations; the skipped steps). Per rank: the error-feedback residuals (each rank's own compression
error), its byte counters, its event log and the reduce times not yet agreed (the last
bucket's ride in the next step's statistics round). Three ways to save it, as the framework
writes checkpoints:
- per rank (`all_ranks=False`): each rank returns the shared part and its own, and writes
  its own file (the HF Trainer and Accelerate adapters, beside the frameworks' own per-rank
  RNG files): no collective, and no rank holds more than its own residuals;
- to one writer (`dst=r`): every rank's part is gathered onto group rank r only (one
  `gather_object`; the others get their own part back), for a framework that writes one
  file from one rank (the Lightning adapter): only the writer holds W ranks' residuals;
- to every rank (the default): an all-gather, so any rank may write it, at the price of
  every rank holding W ranks' residuals (in host memory: residuals are saved as CPU copies).
The gathers are collectives: call them on every rank, between steps (a rank that has waited
`WAIT_NOTICE_S` for the others in one says so, and waits on).
A state from other bindings (another model or profile) or a newer version is refused with one
line; a resumed run may be longer or shorter (extending training), with a warning when that
moves the phase boundaries. One saved at another world size is refused too, unless loaded with
`strict=False` (a job resumed on more or fewer ranks; the framework adapters do so): the
shared part goes on, its norms rescaled (`_resized`), and every rank starts without
residuals (they were per rank) and without the saved run's byte counters, events and gate
measurements (its buckets are priced again at this world size).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from nfabric_cli.binding.bindings import Bindings
from nfabric_cli.errors import InputError
from nfabric_cli.routes.memory import ErrorFeedback
from nfabric_cli.runtime.traffic import TrafficMeter

if TYPE_CHECKING:
    from nfabric_cli.runtime.state import FabricState

STATE_VERSION = 1
KIND = "nfabric.fabric_state"


def bindings_key(bindings: Bindings) -> str:
    """A hash of what decides every routing choice: the model, the routes and regions per
    parameter and phase, and the phase boundaries (as fractions of the run)."""
    routes = sorted((name, phase, spec.label(), b.regions[phase])
                    for name, b in bindings.params.items() for phase, spec in b.routes.items())
    phases = [(p.name, p.start, p.end) for p in bindings.phases]
    text = json.dumps([bindings.fingerprint, routes, phases])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fabric_state_dict(state: FabricState, all_ranks: bool = True,
                      dst: int | None = None) -> dict[str, Any]:
    """The checkpoint (module docstring): `all_ranks` gathers every rank's part onto every
    rank, or only onto group rank `dst` when given (the other ranks get their own part)."""
    if state._pending:
        raise RuntimeError("state_dict() during a step: call it between optimizer steps")
    if dst is not None and not all_ranks:
        raise InputError(f"state_dict(all_ranks=False, dst={dst}): dst is where all ranks' "
                         "parts are gathered; without all_ranks each rank keeps its own")
    if dst is not None and (not isinstance(dst, int) or isinstance(dst, bool)):
        raise InputError(f"state_dict(dst={dst!r}): dst is a rank of the fabric's group, an "
                         "integer")
    if dst is not None and not 0 <= dst < state.world_size:
        raise InputError(f"state_dict(dst={dst}): dst is a rank of the fabric's group, "
                         f"0 to {state.world_size - 1}")
    mine = _rank_part(state.ef, state.meter, state.events, state.step_times)
    mine["bucket_seconds"] = [s for _, s in state._bucket_times]
    ranks = {state.rank: mine}
    if all_ranks and state.world_size > 1:
        gathered: list[Any] | None = [None] * state.world_size
        with _waiting_notice(state.rank, "all_ranks=True" if dst is None else f"dst={dst}"):
            if dst is None:
                dist.all_gather_object(gathered, (state.rank, mine), group=state.comm.group)
            else:
                gathered = gathered if state.rank == dst else None
                # `dst` as a global rank: gather_object's `group_dst` is torch >= 2.6 only
                dist.gather_object((state.rank, mine), gathered, group=state.comm.group,
                                   dst=state.comm.global_rank(dst))
        if gathered is not None:
            ranks = dict(gathered)
    return {
        "kind": KIND,
        "version": STATE_VERSION,
        "bindings": bindings_key(state.bindings),
        "world_size": state.world_size,
        "total_steps": state.total_steps,
        **state.controller.state_dict(),  # step, skipped steps, monitor, guard, gate, priced
        # the buckets whose times the next statistics round carries: the same on every rank
        # (each rank's seconds are in its part), so the round has one length everywhere
        "pending_times": [[list(names), phase] for (names, phase), _ in state._bucket_times],
        "ranks": ranks,
    }


#: Seconds a gathering `state_dict` waits for the other ranks before it says why it may be
#: waiting (it goes on waiting: a rank that is only slow, evaluating or writing, is not an error).
WAIT_NOTICE_S = 60.0


@contextlib.contextmanager
def _waiting_notice(rank: int, how: str) -> Iterator[None]:
    """Warn once if the gather inside has not finished after `WAIT_NOTICE_S` seconds.

    The gather is a collective: `if rank == 0: torch.save(state.state_dict(), ...)` waits for
    ranks that never call it, until the process group times out (gloo's: 30 minutes) or
    fails on their next collectives, with nothing said. The notice names the likely cause and
    the two calls that avoid it."""
    def notice() -> None:
        warnings.warn(
            f"nfabric: rank {rank} has waited {WAIT_NOTICE_S:g} s in state_dict({how}) for the "
            "other ranks: it gathers every rank's part, so every rank must call it (between "
            "steps). Called on one rank only it waits until the process group times out or "
            "fails: call state_dict(dst=0) on every rank and save on rank 0, or save "
            "state_dict(all_ranks=False) on each rank", stacklevel=1)

    timer = threading.Timer(WAIT_NOTICE_S, notice)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()  # a notice already under way ends before the call returns


def _resized(sd: dict[str, Any], state: FabricState) -> dict[str, Any]:
    """The shared part of a state saved at another world size, as this run can go on from it.

    Kept: the step, skipped steps, the monitor's holds, trips, events and loss windows (a
    loss is the mean over ranks). Rescaled: the monitor's gradient-norm windows and early
    norms, by sqrt(W / W_saved): an agreed norm is sqrt(sum over ranks of each rank's squared
    norm), which grows as sqrt(W) where the ranks' norms are alike; and the update guard's
    windows by max(1, sqrt(W_saved / W)): they hold norms of the ranks' mean gradient, signal
    plus noise that shrinks as 1/sqrt(W), so they move by a factor between 1 and
    sqrt(W_saved / W), and the larger bound never caps a healthy update tighter than the saved
    run did (emptied, a held scope, which adds nothing to its window, would go uncapped).
    Dropped: what was measured or priced for the saved run's buckets (the gate keeps what it
    holds in this run; no reduce times pending)."""
    saved = sd["world_size"]
    if not isinstance(saved, int) or isinstance(saved, bool) or saved < 1:
        raise InputError(f"fabric state is malformed (world_size {saved!r}): nothing was loaded")
    monitor, grow = dict(sd["monitor"]), (state.world_size / saved) ** 0.5
    for key in ("norm_windows", "early_norms"):
        if key in monitor:
            monitor[key] = {s: [v * grow for v in values] for s, values in monitor[key].items()}
    out = {**sd, "monitor": monitor, "gate": state.controller.gate.state_dict(), "priced": {},
           "pending_times": []}
    if "guard" in out:
        loose = max(1.0, 1.0 / grow)
        out["guard"] = {"windows": {s: [v * loose for v in values]
                                    for s, values in out["guard"]["windows"].items()}}
    return out


def _rank_part(ef: ErrorFeedback, meter: TrafficMeter, events: list[dict[str, Any]],
               step_times: list[float]) -> dict[str, Any]:
    """What differs by rank: residuals, byte counters, the event log, step times."""
    return {"ef": ef.state_dict(), "meter": meter.state_dict(),
            "events": [dict(e) for e in events], "step_times": list(step_times)}


def load_fabric_state(state: FabricState, sd: dict[str, Any], strict: bool = True) -> list[str]:
    """Restore `sd` into `state` (before the first step, or between steps). Returns notes for
    the caller to warn with: moved phase boundaries, and (only with `strict=False`) another
    world size or this rank's missing residuals."""
    if not isinstance(sd, dict) or sd.get("kind") != KIND:
        raise InputError("not an nfabric fabric state (expected FabricState.state_dict())")
    version = sd.get("version", 0)
    if not isinstance(version, int) or isinstance(version, bool):
        raise InputError(f"fabric state is malformed (version {version!r}): nothing was loaded")
    if version > STATE_VERSION:
        raise InputError(f"fabric state version {sd['version']} is newer than this nfabric "
                         f"reads ({STATE_VERSION}): upgrade nfabric")
    if state.closed:  # it reduces nothing more: what it loaded would drive no step
        raise InputError("load_state_dict() into a closed nfabric state: load it into the state "
                         "attach() returned for the resumed run")
    if state._pending:
        raise RuntimeError("load_state_dict() during a step: call it between optimizer steps")
    missing = [k for k in _REQUIRED if k not in sd]
    if missing or not isinstance(sd["ranks"], dict):
        what = f"no {', '.join(missing)}" if missing else "its ranks are not a dict"
        raise InputError(f"fabric state is incomplete ({what}): nothing was loaded")
    key = bindings_key(state.bindings)
    if sd["bindings"] != key:
        raise InputError(
            f"fabric state is from other bindings (key {sd['bindings']}, these {key}): another "
            "model or profile")
    notes: list[str] = []
    resized = sd["world_size"] != state.world_size
    if resized:
        msg = (f"fabric state was saved with {sd['world_size']} ranks, this run has "
               f"{state.world_size}: error-feedback residuals are per rank")
        if strict:
            raise InputError(msg + "; load_state_dict(state, strict=False) resumes the rest "
                             "without them")
        notes.append(msg + ", so every rank starts without them; the step, phase, health "
                     "monitor and update guard go on (their norms rescaled), and the capacity "
                     "gate prices this run's buckets again")
    if sd["total_steps"] != state.total_steps and len(state.bindings.phases) > 1:
        notes.append(f"the run was {sd['total_steps']} steps long and is now {state.total_steps}:"
                     " phase boundaries (fractions of total_steps) move with it")
    mine = None if resized else sd["ranks"].get(state.rank)
    if mine is None:  # no residuals, counters, events or step times of its own
        if not resized:
            saved = sorted(sd["ranks"])
            msg = (f"fabric state holds rank(s) {saved} only, not rank {state.rank}: save it "
                   "with state_dict(all_ranks=True) (the default), or load each rank's own file")
            if strict:
                raise InputError(msg)
            notes.append(msg + "; this rank starts with no error-feedback residuals")
        mine = _rank_part(ErrorFeedback(), TrafficMeter(state.rank), [], [])
    # Everything is read into new objects, and the controller restored if it fails part way:
    # a malformed state leaves the run as it was.
    before, logged, started = state.controller.state_dict(), len(state.events), False
    try:
        if resized:  # (a malformed part of it fails here, as any other: one line)
            sd = _resized(sd, state)
        ef, meter = ErrorFeedback(), TrafficMeter(state.meter.rank)
        ef.load_state_dict(mine["ef"], state.device)
        meter.load_state_dict(mine["meter"])
        events = [dict(e) for e in mine["events"]]
        step_times = [float(t) for t in mine["step_times"]]
        keys = [(tuple(names), phase) for names, phase in sd.get("pending_times", [])]
        seconds = mine.get("bucket_seconds") or [0.0] * len(keys)  # a missing part: no times
        bucket_times = list(zip(keys, seconds, strict=True))
        started = True
        state.controller.load_state_dict(sd)  # may log entering the resumed step's phase
    except Exception as exc:  # noqa: BLE001 - any malformed value: one line, nothing loaded
        if started:  # (its saved form lacks a measured gate's block in progress: re-measured)
            state.controller.load_state_dict(before)
            del state.events[logged:]
        if isinstance(exc, InputError):
            raise
        raise InputError(f"fabric state is malformed ({type(exc).__name__}: {exc}): nothing "
                         "was loaded") from None
    state.ef, state.meter = ef, meter
    state.events[:] = events + state.events[logged:]
    state.step_times[:] = step_times
    state._bucket_times[:] = bucket_times
    state._timing = None  # a step timed before the load is not this run's
    return notes


#: The keys every saved state has (`guard`, `held`, `holding`, `priced` and `pending_times`
#: came later: states saved before them load without).
_REQUIRED = ("bindings", "world_size", "total_steps", "step", "skipped_steps", "monitor", "gate",
             "ranks")
