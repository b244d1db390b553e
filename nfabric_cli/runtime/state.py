"""`FabricState`: everything the hook needs across buckets and steps.

Per bucket (on the state's worker thread, the step's last one on the calling thread once the
worker is done; every bucket of a step with nothing on a low-bit route, as when the monitor
holds the whole model, on the calling thread too: `_on_calling_thread`): inject faults
(tests), measure per-scope gradient norms, pick each parameter's effective route (profile
route unless the health monitor forces fp32 for its region or the capacity gate refuses the
bucket), reduce the bucket (`runtime/bucket.py`: encoding it while the previous bucket's
results are on the wire),
meter the bytes, take the reduced update's norms. Per step (after the
last bucket): the health statistics agreed (riding on the last bucket's all-gather,
`runtime/agree.py`), the step controller's decision
(`runtime/controller.py`, shared with the calibration simulator; identical on every rank,
since it only sees agreed numbers): neutralise a non-finite step, scale down a held scope's
update, then complete the step's futures and advance the phase.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import math
import numbers
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from nfabric_cli.binding.bindings import Bindings
from nfabric_cli.binding.fingerprint import trainable_parameters
from nfabric_cli.errors import InputError
from nfabric_cli.profile.phases import Phase
from nfabric_cli.routes import FP32, Comm, ErrorFeedback, make_route
from nfabric_cli.routes.device import current_stream, on_stream, to_device
from nfabric_cli.routes.exchange import WHOLE
from nfabric_cli.routes.fp32 import ddp_mean_
from nfabric_cli.routes.groups import BucketGroup, bucket_groups, spec_numels, whole_bucket
from nfabric_cli.routes.spec import RouteSpec
from nfabric_cli.runtime import groups
from nfabric_cli.runtime.accumulation import (
    NO_SYNC_HINT,
    AccumulationWarning,
    StepWitness,
    accumulation_warning,
)
from nfabric_cli.runtime.agree import StatsRound, host_read
from nfabric_cli.runtime.bucket import BucketJob
from nfabric_cli.runtime.controller import StepController, StepDecision
from nfabric_cli.runtime.gate import CapacityGate
from nfabric_cli.runtime.health import HealthMonitor
from nfabric_cli.runtime.inject import Injection, apply_injection
from nfabric_cli.runtime.probe import FP32 as FP32_PATH
from nfabric_cli.runtime.probe import LOWBIT as LOWBIT_PATH
from nfabric_cli.runtime.trace import TraceRecorder
from nfabric_cli.runtime.traffic import TrafficMeter

#: consecutive zeroed steps after which a run is told about ``nonfinite="pass"`` (`_neutralise`)
SCALER_HINT = 3
#: The line for a parameter frozen after DDP was built (refused at attach, or in a bucket).
FROZEN_AFTER_DDP = ("a DDP model's bucket holds a parameter frozen (requires_grad=False) after "
                    "DDP was built: DDP keeps it in its buckets, and nfabric binds trainable "
                    "parameters only; freeze before wrapping the model in DDP (mid-run: wrap "
                    "it in a new DDP after freezing), then attach to that")


def _agreement(step_stats: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """"agree_sum:<scope>" / "agree_n:<scope>" of each region's sums, as `StatsRound` takes
    them."""
    return {f"{k}:{region}": st[k] for region, st in step_stats.items()
            for k in ("agree_sum", "agree_n") if k in st}


class _Routing(NamedTuple):
    """A bucket's routing at a step (`FabricState._routing`): its parameters' names and
    regions, its route groups, what the gate prices (empty: nothing low-bit now) and its
    groups were the gate to refuse it (every parameter on fp32); `planned`: the phase's
    profile routes something in it low-bit (held or not: what `controller.gated_off` asks)."""

    names: tuple[str, ...]
    regions: tuple[str, ...]
    groups: tuple[BucketGroup, ...]
    priced: tuple[tuple[RouteSpec, int], ...]
    refused: tuple[BucketGroup, ...]
    planned: bool
    sends: frozenset[str]  # the regions it sends low-bit unless the gate refuses it
    lowbit_names: frozenset[str]  # and the parameters


_HALF = (torch.float16, torch.bfloat16)


def _norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each tensor's 2-norm, stacked: one call for a bucket's parameters (on CPU the same
    bits as `vector_norm` one by one, which the simulator takes). A half-precision bucket's
    norms come out in float32: an fp16 norm overflows past 65504 (a million elements of
    |g| ~ 66), which would read as a non-finite step and zero a finite one."""
    ts = list(tensors)
    wide = torch.float32 if ts and ts[0].dtype in _HALF else None
    return torch.stack(torch._foreach_norm(ts, dtype=wide))


def _full(dtype: torch.dtype):  # noqa: ANN202
    """The full-precision route for a bucket of `dtype` (its own dtype on the wire)."""
    return make_route(FP32, dtype)


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every element of `tensors` is finite, in one host read. From each tensor's
    min and max, which a NaN or an infinity anywhere reaches (torch's min/max propagate NaN):
    one pass and no allocation, where `isfinite(t).all()` made three temporaries (0.5 ms per
    200k floats here, against 0.03 ms: 1.3 ms of a 4 ms plain-DDP step of a 0.4M model)."""
    ends = _ends(tensors)
    return not ends or bool(torch.isfinite(torch.stack(ends)).all())


def _ends(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each non-empty tensor's min and max (a NaN or an infinity anywhere reaches them)."""
    return [v for t in tensors if t.numel() for v in torch.aminmax(t)]


class FabricState:
    """Routing state of one DDP model: `nfabric_cli.attach(...)`, or `FabricState.create(...)`
    and `ddp.register_comm_hook(state, fabric_hook)`.

    Thread safety: `observe` may be called from any thread; the reduction runs on the state's
    own worker thread (the step's last bucket on DDP's thread, after the worker's; every
    bucket of a step with nothing on a low-bit route, the monitor holding it all, on DDP's;
    a step the gate sends as plain DDP's is judged and closed where its last all-reduce
    completes, before DDP's futures are set: `_judge_direct`);
    `state_dict` / `load_state_dict` / `close` / `hand_over` belong between steps."""

    def __init__(
        self,
        bindings: Bindings,
        module: torch.nn.Module,
        total_steps: int | None,
        group: dist.ProcessGroup | None,
        *,
        monitor: bool = True,
        gate: bool | str = True,
        injections: tuple[Injection, ...] = (),
        seed: int = 0,
        trace: TraceRecorder | None = None,
        direct_fp32: bool = True,
        nonfinite: str = "zero",
    ) -> None:
        self.bindings = bindings
        self.trace = trace
        # None: a one-phase run whose length nobody said (nothing to place, nothing to warn of)
        self.steps_known = total_steps is not None
        self.total_steps = max(1, int(total_steps)) if total_steps is not None else 1
        self.comm = Comm(group)
        self.rank = self.comm.rank
        self.world_size = self.comm.world_size
        self.seed = seed
        self.injections = tuple(injections)
        self.events: list[dict[str, Any]] = []
        self.meter = TrafficMeter(rank=dist.get_rank())
        self.ef = ErrorFeedback()
        self.step_times: list[float] = []
        params = trainable_parameters(module)
        self._names = {id(tp.param): tp.name for tp in params}
        # whether optimizer steps follow the reductions (accumulation without no_sync)
        self._step_witness = StepWitness(tp.param for tp in params)
        self._accumulation_found: list[int] | None = None
        self.device = params[0].param.device if params else torch.device("cpu")
        self.controller = StepController(bindings, self.total_steps, self.world_size, self._log,
                                         monitor=monitor, gate=gate, nonfinite=nonfinite)
        # a plain phase's steps by `_fp32_direct`; a recorded trace times them on the worker
        # (the same numerics: `whole_bucket_fp32`, nothing judged or skipped)
        self._direct = direct_fp32 and trace is None
        self._scopes = self.controller.scopes
        # every parameter's route, per phase (bindings order): what the sets below read
        routing = {p.name: tuple(b.routes[p.name] for b in bindings.params.values())
                   for p in bindings.phases}
        # phases with a low-bit route somewhere: the only ones the measured gate probes
        self._lowbit_phases = {name for name, specs in routing.items()
                               if any(s.lowbit for s in specs)}
        # The measured gate's probe cycle per phase: phases that route every parameter alike
        # share the first one's (timing the same two paths again at a phase boundary costs a
        # step on the slower path and learns nothing: vision.v5's warmup and main phase).
        first: dict[tuple[RouteSpec, ...], str] = {}
        self._probe_cycle = {name: first.setdefault(specs, name)
                             for name, specs in routing.items()}
        self._loss: torch.Tensor | float | None = None
        self._loss_fed: list[bool] | None = None  # whether backward ran through it (`observe`)
        self._late_warned = False
        self._witness: Any = None  # the hook `observe` set on the loss's graph (a handle)
        # per bucket of the step: its future, its buffer, and (name, slice) per parameter
        # (and the names it sent low-bit: a ramp's clip spares them, `StepDecision.apply_`)
        self._pending: list[tuple[torch.futures.Future, torch.Tensor,
                                  list[tuple[str, torch.Tensor]], frozenset[str]]] = []
        # the step's statistics, kept as tensors until the step's one host read (agree.py):
        # per bucket, its parameters' scopes and gradient norms, and names and update norms
        self._grad_norms: list[tuple[Sequence[str], torch.Tensor]] = []
        self._update_norms: list[tuple[list[str], torch.Tensor]] = []
        self._step_stats: dict[str, dict[str, Any]] = {}  # per region: agreement sums
        self._routings: dict[tuple, _Routing] = {}  # per (bucket, phase, held scopes)
        # low-bit buckets' reduce times, agreed in the next statistics round that starts
        # after they land (the step's last bucket: the next step's), for the model gate
        self._bucket_times: list[tuple[tuple, float]] = []
        self._step_started: float | None = None
        # the measured gate (`probe.py`): the last step's first bucket, and (phase, path) when
        # its period is being timed
        self._period_start = 0.0
        self._timing: tuple[str, str] | None = None
        self._lock = threading.Lock()
        self._saved_at: int | None = None  # the step of the last state_dict(): a resumable stop
        self._inflight: BucketJob | None = None  # the bucket whose all-gather is on the wire
        self._issued: list[BucketJob] = []  # buckets issued on DDP's thread (`submit`)
        self._held_step = False  # nothing of this step low-bit (`controller.all_held`)
        self._step_keys: list[tuple] = []  # this step's planned low-bit buckets (`controller.priced`)
        # the regions routed low-bit this step sent on fp32 in a bucket the gate refused
        self._step_refused: set[str] = set()
        self._direct_step = False
        self._scaler_warned = False  # `_neutralise`'s hint, said once
        # a gated-off step's buckets: (all-reduce future, buffer, DDP's future, its
        # parameters), completed together once the step is judged (`_judge_direct`)
        self._direct_pending: list[tuple[Any, torch.Tensor, torch.futures.Future,
                                         list[torch.Tensor]]] = []
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="nfabric")
        self._queued: concurrent.futures.Future | None = None  # the worker's last job
        # the state attached to this DDP model after this one closed (`hand_over`): DDP keeps
        # the hook it was first given, for its lifetime
        self._successor: FabricState | None = None
        self._failed = False  # a reduce failed: its group may hold unmatched collectives
        # run at the first step's first bucket (`attach.watch_static_graph`); None: none
        self.first_step_check: Callable[[], None] | None = None

    @classmethod
    def create(cls, ddp_model: Any, source: Any, total_steps: int | None = None,
               **options: Any) -> FabricState:
        """The state for `ddp_model`, not yet registered: the PyTorch idiom for comm hooks.

        Example::

            state = FabricState.create(ddp, "profiles/vision", total_steps=1000)
            ddp.register_comm_hook(state, fabric_hook)

        Arguments and errors as `nfabric_cli.attach` (which is these two lines)."""
        from nfabric_cli.runtime.attach import create_state

        return create_state(ddp_model, source, total_steps, **options)

    # -- public ----------------------------------------------------------------------------
    @property
    def phase(self) -> Phase:
        return self.controller.phase

    @property
    def step(self) -> int:
        """Steps completed (the next step's index)."""
        return self.controller.step

    @property
    def monitor(self) -> HealthMonitor:
        return self.controller.monitor

    @property
    def monitor_enabled(self) -> bool:
        return self.controller.monitor_enabled

    @property
    def gate(self) -> CapacityGate:
        return self.controller.gate

    @property
    def skipped_steps(self) -> list[int]:
        return self.controller.skipped_steps

    def observe(self, loss: torch.Tensor | float) -> None:
        """Feed this step's local training loss to the health monitor (call before backward;
        the last call of a step counts). A tensor is not read here: it is read with the step's
        other statistics, once."""
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise InputError(f"observe() takes the step's loss as one number, got a tensor of "
                                 f"shape {tuple(loss.shape)}: reduce it first (loss.mean())")
            value: torch.Tensor | float = loss.detach()
        elif isinstance(loss, numbers.Real) and not isinstance(loss, bool):
            value = float(loss)
        else:
            raise InputError(f"observe() takes the step's loss (a tensor or a number), got "
                             f"{type(loss).__name__}")
        fed: list[bool] | None = None
        if self._witness is not None:  # the last step's, had its backward not run
            self._witness.remove()
            self._witness = None
        if isinstance(loss, torch.Tensor) and loss.requires_grad and not self._late_warned:
            fed = [False]  # set when backward passes through this loss (`_check_observed`)
            node = _backward_witness(loss)
            self._witness = (node.register_prehook(lambda grad_outputs: fed.__setitem__(0, True))
                             if node is not None else
                             loss.register_hook(lambda grad: fed.__setitem__(0, True)))
        with self._lock:
            self._loss, self._loss_fed = value, fed

    def _check_observed(self, fed: list[bool] | None) -> None:
        """A loss observed after its backward reaches the monitor one step late: a spike is
        then judged, and its update held, on the step after it. Said once, on rank 0."""
        if fed is None or fed[0] or self._late_warned:
            return
        self._late_warned = True
        if self.rank == 0:
            warnings.warn(
                "nfabric: the loss given to observe() was not the one this step's backward ran "
                "through (observed after backward?): the health monitor judges each loss one "
                "step late. Call state.observe(loss) between the forward and loss.backward()",
                stacklevel=2)

    def bytes_per_route(self) -> dict[str, int]:
        return self.meter.per_route()

    def traffic_frame(self):  # -> pandas.DataFrame
        return self.meter.frame()

    def effective_routes(self) -> dict[str, str]:
        """Parameter -> route label in force now (after health fallbacks)."""
        return {n: self._effective(n).label() for n in self.bindings.params}

    def state_dict(self, all_ranks: bool = True, dst: int | None = None) -> dict[str, Any]:
        """The fabric's checkpoint: step (hence phase), health monitor, capacity gate,
        error-feedback residuals, byte counters and events (`runtime/checkpoint.py`). With
        `all_ranks` (default) every rank's part is gathered onto every rank, or only onto
        group rank `dst` when given, so that rank alone may save it: a collective, so call it
        on every rank, between optimizer steps. `all_ranks=False`: this rank's part only, for
        a checkpoint each rank writes itself (no rank then holds the others' residuals)."""
        from nfabric_cli.runtime.checkpoint import fabric_state_dict

        self._saved_at = self.step
        return fabric_state_dict(self, all_ranks, dst)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Restore a `state_dict()` (after `attach`, before the resumed run's first step); at
        the same world size the resumed run is bit-identical to an uninterrupted one, except
        under the measured gate (`gate="measure"`), whose decisions follow wall-clock times
        and whose probe does not save the period in progress, a block's steps so far or the
        fp32 time a phase's first cycle carries over (`probe.py`). Refuses,
        with one line, a state from other bindings, and (strict) one from another world size
        or without this rank's part; `strict=False` resumes those without this rank's
        residuals, with a warning (`runtime/checkpoint.py`)."""
        from nfabric_cli.runtime.checkpoint import load_fabric_state

        for note in load_fabric_state(self, state_dict, strict):
            warnings.warn(f"nfabric: {note}", stacklevel=2)

    @property
    def closed(self) -> bool:
        """Whether `close` has run: the state still reads (bytes, events, routes), and
        reduces nothing more."""
        return self._pool is None

    def hand_over(self, successor: FabricState) -> None:
        """Send the buckets of this state's DDP model to `successor` from now on: attaching to
        a DDP model again once its state is closed (a second `trainer.train()` on the DDP
        wrapper the HF Trainer keeps), where DDP would not take a second hook. Called on the
        state DDP holds; it points at the newest one only (the ones between are freed)."""
        if successor is self or successor.closed:
            raise InputError("hand_over takes a new, open nfabric state")
        if not self.closed or (self._successor is not None and not self._successor.closed):
            raise InputError("this DDP model's nfabric state is still open: close() it before "
                             "attaching again")
        self._successor = successor

    def close(self) -> None:
        """Stop the worker thread (idempotent). Call before destroying the process group.
        Warns when the run stopped short of `total_steps` (its last phases never ran) or ran
        past it, unless the state was checkpointed at this step (a run stopped to resume)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
            self._step_witness.close()
            self.comm.release()  # the wire buffers (a bucket's size each): nothing is sent now
            if not self._failed and self._step_started is None:
                # the next attach takes it (`runtime/groups.py`); not after a failed reduce or
                # mid-step: a collective of it may be unmatched on some rank, and the next
                # state's first one would meet it (a hang)
                groups.give_back(self.comm.group)
            if self.trace is not None:
                self.trace.close()
            if (self.steps_known and self.step != self.total_steps and self.step > 0
                    and self.step != self._saved_at):
                warnings.warn(
                    f"nfabric: the run closed at step {self.step} of total_steps="
                    f"{self.total_steps}: phases are placed by total_steps, so pass the number "
                    f"of optimizer steps the run really takes ({NO_SYNC_HINT})", stacklevel=2)

    # -- hook entry --------------------------------------------------------------------------
    def submit(
        self, buffer: torch.Tensor, params: list[torch.Tensor], is_last: bool
    ) -> torch.futures.Future:
        """Start reducing one bucket; the returned future completes with the reduced buffer."""
        if self._successor is not None:  # attached again after close (`hand_over`)
            return self._successor.submit(buffer, params, is_last)
        if self._pool is None:
            raise RuntimeError("nfabric state is closed")
        if id(params[0]) not in self._names:  # (its steps would be counted twice, or fail)
            raise self._foreign(params)
        if self._step_started is None:
            if self.first_step_check is not None:  # (raises on every rank alike: no hang)
                self.first_step_check()
                self.first_step_check = None
            self._step_started = time.perf_counter()
            found = self._step_witness.reduction()
            if found is not None:  # said at the step's end, after its collectives (`_advance`)
                self._accumulation_found = found
            self._held_step = self.controller.all_held()  # (read by `_measured_path` too)
            self._direct_step = self._gated_off()
        # a plain phase (every parameter on fp32: the controller's rule, which the simulator
        # drives too) or a gated-off step takes plain DDP's direct path
        if self._plain_direct() or self._direct_step:
            return self._fp32_direct(buffer, params, is_last)
        names = self._bucket_names(params)
        fut = _future(buffer)
        args = (buffer, names, [p.numel() for p in params], is_last, fut)
        if is_last:
            self._on_calling_thread(args)
            return fut
        if self._held_step and self.trace is None:
            # Nothing of the step on a low-bit route (the monitor holds every scope that has
            # one): each bucket's all-reduce is issued now, on DDP's thread, as plain DDP
            # issues it, and all land with the last bucket. Handed to the worker a bucket
            # went out 2-3.5 ms later (the thread's wake-up behind backward). Decided per
            # step on agreed holds, so every rank issues in the same order; a step with a
            # low-bit bucket keeps the worker, so no low-bit reduce's timed stages (which the
            # gate judges) wait behind buckets still on the wire.
            self._on_calling_thread(args, inline=True)
            return fut
        stream = current_stream(buffer)  # DDP's thread's: the worker issues on it (`on_stream`)
        self._queued = self._pool.submit(on_stream, stream, self._reduce_bucket, *args)
        self._queued.add_done_callback(lambda j: self._fail_step(j, fut))
        return fut

    def _bucket_names(self, params: list[torch.Tensor]) -> list[str]:
        try:
            return [self._names[id(p)] for p in params]
        except KeyError:
            raise self._foreign(params) from None

    def _foreign(self, params: list[torch.Tensor]) -> InputError:
        """The one line for a bucket holding parameters without a route here."""
        if any(not p.requires_grad for p in params if id(p) not in self._names):
            # DDP fixes its buckets when it is built: a parameter frozen after that stays in
            # them (zeros, with find_unused_parameters), and attach binds trainable ones only
            return InputError(FROZEN_AFTER_DDP)
        return InputError("a DDP model's bucket holds parameters this fabric state was not "
                          "made for: one state per DDP model (FabricState.create for each), "
                          "attached after the last change to which parameters train")

    def _on_calling_thread(self, args: tuple, inline: bool = False) -> None:
        """The step's last bucket, reduced on the calling thread once the worker has done the
        step's earlier ones. Backward has nothing left to overlap with it, and the worker
        would only cost two thread hand-offs (waking it, then waking DDP's thread when the
        futures complete): with a single bucket, as vision's, that was all the hook's
        threading did. Collective order is unchanged: the worker is idle by then. `inline`:
        an earlier bucket of a step with nothing low-bit (`submit`): the worker has none."""
        queued, self._queued = (None, None) if inline else (self._queued, None)
        failed = queued.exception() if queued is not None else None  # waits for it
        own = failed is None
        if own:
            try:
                self._reduce_bucket(*args, inline)
                return
            except BaseException as exc:  # handed to DDP's futures, as the worker's are
                failed = exc
        self._fail_pending(failed, args[-1])  # (a worker's: its callback may not have run yet)
        if not inline:  # the step's last bucket: the failed step is over, not counted, and a
            # run that catches the error starts its next as a step; the failed step's period
            # (which would run on through the caller's recovery) is no sample of its path
            self._step_started, self._timing = None, None
        if own and not isinstance(failed, Exception):  # Ctrl-C on DDP's thread: stop the run
            raise failed

    def _plain_direct(self) -> bool:
        """Whether this step is a plain phase's sent by `_fp32_direct` (not traced)."""
        return self._direct and self.controller.plain

    def _gated_off(self) -> bool:
        """Whether this step goes out as plain DDP: the measured gate chose fp32 for it, or the
        model gate already refuses every bucket the phase routes anything low-bit in
        (`controller.gated_off`), so nothing low-bit is sent and there is nothing to decide.
        Decided at a step's first bucket on agreed verdicts, so every rank decides alike. The
        buckets are those of the phase's last step through the worker: a phase that starts at
        step 0 is priced in DDP's first layout (one bucket per dtype, rebuilt after that step)
        and keeps those verdicts, as the simulator does (`SimulatedDDP._plan`)."""
        if self.gate.measured is not None and self.gate.enabled:
            return self._measured_path() == FP32_PATH
        return self.controller.gated_off()

    def _measured_path(self) -> str:
        """The measured gate's path for this step (`probe.py`), at its first bucket: record
        the last step's period if it was timed, judge a probed pair on the ranks' mean times
        (one small blocking all-reduce: the worker is idle between steps and every rank
        reaches it at the same step), then ask for this step's path.

        Every timed single step and every block's first step (`probe.py`) starts at such a
        round, an empty one where no pair is due, and its period starts after it; a block's
        other steps run on without one. The round is a barrier: it holds its round trip and
        the ranks' skew (2.7-2.9 ms median, 7-8 ms at p90, on transformer's ~22 ms step).
        Timed in the low-bit step after each pair alone, it made low-bit read ~9 % slower
        than it runs and kept fp32 where static was faster; left out of the low-bit periods
        alone, those started with the ranks in step while the fp32 ones still held the skew,
        which favours low-bit by about half of it. Both paths now start in step
        (docs/capacity.md)."""
        probe, phase, now = self.gate.measured, self.phase.name, self._step_started
        if self._timing is not None:
            probe.record(*self._timing, now - self._period_start)
        self._timing = None
        if self._plain_direct():
            return FP32_PATH
        if phase not in self._lowbit_phases:  # nothing to time (e.g. a traced fp32 phase)
            return LOWBIT_PATH
        cycle = self._probe_cycle[phase]
        if self._held_step and probe.probing(cycle):
            # The monitor holds every low-bit scope: a "low-bit" step would time the held path
            # (fp32 and the statistics round), not low-bit's, and decide between two fp32s.
            # The probe waits, its position and samples as they were; holds are agreed, so
            # every rank waits alike.
            return LOWBIT_PATH
        due = probe.due(cycle)
        if due is not None:
            low, full = self._probe_round(due)
            decided = probe.decide(cycle, low, full)
            if decided is not None:
                self._log({"step": self.step, "scope": "step", "from": "probe",
                           "to": decided[0], "reason": decided[1]})
        path, timed, fresh = probe.path(cycle)
        if timed:
            if fresh and due is None:
                self._probe_round((0.0, 0.0))  # a barrier: this period starts in step too
            self._timing, self._period_start = (cycle, path), time.perf_counter()
        return path

    def _probe_round(self, times: tuple[float, float]) -> tuple[float, float]:
        """The ranks' mean of (low-bit, fp32) times: one small blocking all-reduce, the same
        on every rank at the same step."""
        agreed = to_device(torch.tensor(times, dtype=torch.float64), self.device)
        dist.all_reduce(agreed, group=self.comm.group)
        low, full = (agreed / self.world_size).tolist()
        return low, full

    def _fp32_direct(self, buffer: torch.Tensor, params: list[torch.Tensor],
                     is_last: bool) -> torch.futures.Future:
        """A phase with every parameter on fp32, or a step the gate sends all fp32
        (`_gated_off`): plain DDP's path (`ddp_mean_`, then an all-reduce), on the calling
        thread.

        In an all-fp32 phase nothing can fall back (the monitor only acts on low-bit scopes)
        and the run is plain DDP's, NaN included. A gated-off step of a low-bit phase is
        judged once its last all-reduce lands (`_judge_direct`): neutralised when not finite,
        as on the worker path, and its ramped scopes held (`StepController.direct`). DDP's
        futures complete together after that, each all-reduce still overlapping backward.
        Phases change only between steps, and the worker is idle on these steps, so
        collective order stays identical.
        """
        step, phase = self.step, self.phase.name
        guarded = self._direct_step and phase in self._lowbit_phases
        if self.injections:
            apply_injection(self.injections, step, self.rank, [buffer])
        ddp_mean_(buffer, self.world_size)
        wb = _full(buffer.dtype).wire_bytes(buffer.numel(), self.world_size, self.rank)
        self.meter.add(step, phase, "fp32", wb)
        self.meter.add_fp32_reference(step, wb, buffer.dtype)
        work = dist.all_reduce(buffer, group=self.comm.group, async_op=True)
        if is_last:
            with self._lock:
                self._loss, self._loss_fed = None, None  # no monitor on these steps
        if not guarded:
            if is_last:
                self.controller.refused(step)
                self._advance(step)
            return work.get_future().then(lambda f: f.value()[0])
        fut = _future(buffer)
        self._direct_pending.append((work.get_future(), buffer, fut, params))
        if is_last:
            pending, self._direct_pending = self._direct_pending, []
            torch.futures.collect_all([w for w, *_ in pending]).then(
                lambda done: self._judge_direct(step, done, pending))
        return fut

    def _judge_direct(self, step: int, done: torch.futures.Future,
                      pending: list[tuple[Any, torch.Tensor, torch.futures.Future,
                                          list[torch.Tensor]]]) -> None:
        """A gated-off step of a low-bit phase (plain DDP's path, no statistics round), once
        its last all-reduce lands: zero the whole step on every rank if any result is not
        finite, as the worker path does, and while the update guard has something to hold
        (a ramp, a monitor hold) hold those scopes' updates (`StepController.direct`); then
        close the step (a failed one too: the next step starts clean). A sum carries a NaN or
        inf of any rank to every rank and the reduced updates are the same everywhere, so the
        ranks agree without a collective; one host read per step. The monitor's detectors
        do not run on these steps (the gate chose plain DDP for them)."""
        try:
            for w in done.value():
                # raises for a failed all-reduce; on a GPU also makes this thread's stream
                # wait for it (`value()` would not), before the read and the zeroing below
                w.wait()
            bufs = [b for _, b, *_ in pending]
            self.controller.refused(step)
            updates, buckets = None, []
            if self.controller.guarding:  # the update norms, in the finiteness check's read
                buckets = [list(zip(self._bucket_names(params),
                                    _views(b, [p.numel() for p in params])[1], strict=True))
                           for _, b, _, params in pending]
                # per bucket: a half-precision bucket's norms in float32 (`_norms`)
                norms = [_norms([g for _, g in parts]).to(torch.float64) for parts in buckets]
                ends = [v.to(torch.float64) for v in _ends(bufs)]
                read = host_read(torch.cat(norms + ([torch.stack(ends)] if ends else [])))
                named = [n for parts in buckets for n, _ in parts]
                finite = all(map(math.isfinite, read[len(named):]))
                updates = dict(zip(named, read, strict=False))
            else:
                finite = all_finite(bufs)
            decision = self.controller.direct(step, finite, updates)
            if decision.skip:
                self._neutralise(bufs)
            elif decision.scales or decision.clips:
                self._scale([(parts, frozenset()) for parts in buckets], decision)
        except Exception as exc:  # noqa: BLE001 - surfaced in DDP's thread, not swallowed
            failed: Exception | None = exc
            self._failed = True
        else:
            failed = None
        try:  # closed either way: the next step starts clean
            self._advance(step)
        except Exception as exc:  # noqa: BLE001 - (a warning raised as an error, say)
            failed = failed or exc
        for _, b, f, *_ in pending:  # DDP waits on these: always completed
            if failed is not None:
                f.set_exception(failed)
            else:
                f.set_result(b)

    # -- per bucket (worker thread; the last on DDP's) -----------------------------------------
    def _effective(self, name: str) -> RouteSpec:
        return self.controller.effective(name)

    def _reduce_bucket(
        self, buffer: torch.Tensor, names: list[str], numels: list[int], is_last: bool,
        fut: torch.futures.Future, inline: bool = False
    ) -> None:
        """One bucket (on the worker thread, or the last on DDP's): its statistics and
        routes, then its reduction, pipelined with the previous bucket's
        (`runtime/bucket.py`). `inline`: a bucket of a step with nothing low-bit, issued on
        DDP's thread (`submit`) and landed with the step's last bucket."""
        step, phase = self.step, self.phase.name
        offsets, slices = _views(buffer, numels)
        if self.injections:
            apply_injection(self.injections, step, self.rank, slices)
        routing = self._routing(names, numels)
        # the local gradient norms, by scope, before anything is encoded (read at the step's end)
        self._grad_norms.append((routing.regions, _norms(slices)))
        groups = routing.groups
        key = (routing.names, phase)
        if routing.planned:
            self._step_keys.append(key)
        if routing.priced:
            # Priced per reduce the job issues, as compile-profile and calibration price it.
            if not self.gate.verdict(key, routing.priced).admit:
                groups = routing.refused
                self._step_refused |= routing.sends
        if is_last and self._inflight is not None:  # landed first: its time is in the statistics
            self._land(self._inflight)
            self._inflight = None
        stats, timed = self._stats_round() if is_last else (None, [])
        if stats is not None and self.trace is None and whole_bucket([g.spec for g in groups]):
            # Nothing will carry the statistics and nothing left adds to them: their round
            # goes out ahead of the bucket's all-reduce, so it lands while that one is on the
            # wire instead of queueing behind it.
            stats.issue()
            self.meter.add(step, phase, "control", self.comm.take())
        job = BucketJob(self, buffer, names, slices, offsets, groups, step, phase,
                        index=len(self._pending), rider=stats)
        sent_low = routing.lowbit_names if groups is routing.groups else frozenset()
        self._pending.append((fut, buffer, list(zip(names, slices, strict=True)), sent_low))
        job.start()
        if inline:  # (`submit`) lands with the step's last bucket
            self._issued.append(job)
            return
        previous, self._inflight = self._inflight, job
        if previous is not None:
            self._land(previous)
        if is_last:  # the buckets issued on DDP's thread (`submit`), in the order they went out
            issued, self._issued = self._issued, []
            for earlier in issued:
                self._land(earlier)
        job.middle()
        if stats is not None:
            self._inflight = None
            if not stats.sent:  # no all-gather carried it: its own all-reduce
                stats.issue()
            self._land(job)
            self._finish_step(step, stats, timed)

    def _routing(self, names: list[str], numels: list[int]) -> _Routing:
        """A bucket's regions and route groups now (the profile's routes, fp32 where the
        monitor holds a scope), remembered per (bucket, phase, held scopes): they change only
        when one of those does, and working them out per parameter cost a transformer step
        about 0.4 ms."""
        key = (tuple(names), self.phase.name, self.controller.forced())
        found = self._routings.get(key)
        if found is None:
            if len(self._routings) >= 256:  # bucket rebuilds and hold patterns: a few
                self._routings.clear()
            names_t, phase, _ = key
            regions = tuple(self.bindings.params[n].regions[phase] for n in names_t)
            specs = [self._effective(n) for n in names]
            groups = tuple(bucket_groups(regions, specs, numels))
            lowbit = any(s.lowbit for s in specs)
            found = self._routings[key] = _Routing(
                names_t, regions, groups, tuple(spec_numels(groups)) if lowbit else (),
                tuple(bucket_groups(regions, [FP32] * len(specs), numels)) if lowbit else groups,
                self.bindings.lowbit_in(names_t, phase),
                frozenset(r for r, spec in zip(regions, specs, strict=True) if spec.lowbit),
                frozenset(n for n, spec in zip(names_t, specs, strict=True) if spec.lowbit))
        return found

    def _land(self, job: BucketJob) -> None:
        """Finish a bucket's reduction and record what the step's end needs of it."""
        job.finish()
        key = (tuple(job.names), job.phase)
        if job.lowbit:
            self._bucket_times.append((key, job.seconds))
        full = _full(job.buffer.dtype)
        ref = full.wire_bytes(job.buffer.numel(), self.world_size, self.rank)  # in its own dtype
        self.meter.add_fp32_reference(job.step, ref, job.buffer.dtype)
        if self.monitor_enabled:  # the update guard's input; read once per step
            self._update_norms.append((job.names, _norms(job.slices)))

    def _group_stats(self, region: str) -> dict[str, Any]:
        """The dict a region's low-bit reduces add their agreement sums to, for this step."""
        return self._step_stats.setdefault(region, {})

    # -- per step ------------------------------------------------------------------------------
    def _stats_round(self) -> tuple[StatsRound, list[tuple[tuple, float]]]:
        """The step's statistics round, made before its last bucket starts (it rides on that
        bucket's all-gather, `runtime/agree.py`): the loss, every bucket's gradient norms
        (taken before encoding), the reduce times of every bucket but the last (which rides
        in the next step's round), and the agreement sums of sharded reduces as they stand
        when it is sent. Every rank sends it at the same point of the same bucket, so the
        collective order stays the same on every rank. Returns the round and the (bucket,
        seconds) it carries."""
        with self._lock:
            loss, self._loss = self._loss, None
            fed, self._loss_fed = self._loss_fed, None
        self._check_observed(fed)
        timed, self._bucket_times = self._bucket_times, []
        stats = StatsRound(self.comm, self._scopes, self._grad_norms, loss,
                           lambda: _agreement(self._step_stats), [t for _, t in timed],
                           self.device)
        return stats, timed

    def _finish_step(self, step: int, stats: StatsRound, timed: list[tuple[tuple, float]]) -> None:
        whole = _agreement({r: st[WHOLE] for r, st in self._step_stats.items() if WHOLE in st})
        agreed = stats.result(self._update_norms, whole)
        self.meter.add(step, self.phase.name, "control", self.comm.take())
        self.controller.refused(step, self._step_refused)
        decision = self.controller.decide(step, agreed.loss, agreed.nonfinite, agreed.grad_norms,
                                          agreed.agreement, agreed.update_norms)
        for (key, _), seconds in zip(timed, agreed.bucket_seconds, strict=True):
            reason = self.gate.observe(key, seconds)
            if reason:
                self._log({"step": step, "scope": f"bucket[{len(key[0])} params]", "from": "low-bit", "to": "fp32", "reason": reason})
        if decision.skip:
            self._neutralise([buf for _, buf, *_ in self._pending])
        elif decision.scales or decision.clips:
            self._scale([(parts, low) for *_, parts, low in self._pending], decision)
        self.controller.priced(self._step_keys)
        self._clear_step_stats()
        self._advance(step)
        # only now: a raise above still finds the futures in `_pending` (`_fail_pending`)
        pending, self._pending = self._pending, []
        for fut, buf, *_ in pending:
            fut.set_result(buf)

    def _scale(self, buckets: list[tuple[list[tuple[str, torch.Tensor]], frozenset[str]]],
               decision: StepDecision) -> None:
        """Clip and scale each (name, reduced slice) of the step's buckets as `decision` says,
        each bucket with the names it sent low-bit (`StepDecision.apply_`). A ramp's clip is
        the switch's cost, not the path's: the time of a clipping step's clip-and-scale pass
        is left out of a measured gate's probe period (the clip was 0.3x a 47M-parameter
        model's compute, `bench.ramp_cost`, and every fp32 probe step after a low-bit one
        clips), so a close call is not tilted towards low-bit. The host's time: on a GPU the
        clip's kernels may still run into the period."""
        started = time.perf_counter() if decision.clips else None
        for parts, low in buckets:
            for name, g in parts:
                if decision.apply_(self.controller.region(name), g, name not in low):
                    self.ef.reset(name)  # its residual holds what was held back
                    # (a spike's, ~1000x: docs/health.md, "Error feedback leaked ...")
        if started is not None and self._timing is not None:  # (the step's period is timed)
            self._period_start += time.perf_counter() - started

    def _neutralise(self, buffers: list[torch.Tensor]) -> None:
        """A skipped (non-finite) step's results, on every rank alike: zeroed, or for a loss
        scaler (``nonfinite="pass"``) not finite, which it skips. The low-bit routes never
        pass a NaN on (they encode finite values), so the step is made NaN whole. A run of
        zeroed steps is what a loss scaler stuck on a too-large scale looks like: said once."""
        mode = self.controller.nonfinite
        for b in buffers:
            b.fill_(math.nan if mode == "pass" else 0.0)
        self.ef.reset()  # the residuals hold what a non-finite step did not send: nothing to keep
        skipped = self.controller.skipped_steps
        if (mode == "zero" and not self._scaler_warned and len(skipped) >= SCALER_HINT
                and skipped[-1] - skipped[-SCALER_HINT] == SCALER_HINT - 1):
            self._scaler_warned = True
            if self.rank == 0:
                warnings.warn(
                    f"nfabric: steps {skipped[-SCALER_HINT]}-{skipped[-1]} were not finite and "
                    "were zeroed on every rank. If a loss scaler (AMP's GradScaler) scales this "
                    "run's loss, attach with nonfinite='pass': a zeroed step looks finite to "
                    "it, so it never lowers its scale", stacklevel=2)

    def _advance(self, step: int) -> None:
        """Close step `step`: record its time, count it, enter the next phase if it changes."""
        if self._step_started is not None:
            self.step_times.append(time.perf_counter() - self._step_started)
            self._step_started = None
        self.controller.advance(step)
        found, self._accumulation_found = self._accumulation_found, None
        if found is not None and self.rank == 0:  # (after the step's collectives)
            warnings.warn(accumulation_warning(found), AccumulationWarning, stacklevel=2)
        if self.steps_known and self.step == self.total_steps + 1:
            warnings.warn(
                f"nfabric: step {self.step} is past total_steps={self.total_steps}: the last "
                "phase goes on; pass the number of optimizer steps the run takes "
                f"({NO_SYNC_HINT})", stacklevel=2)

    def _fail_step(self, job: Any, fut: torch.futures.Future) -> None:
        """Surface a worker exception in DDP's main thread instead of hanging the step."""
        exc = job.exception()
        if exc is not None:
            self._fail_pending(exc, fut)

    def _clear_step_stats(self) -> None:
        """Forget the step's statistics: norms, agreement sums, the buckets it priced."""
        self._grad_norms, self._update_norms, self._step_stats, self._step_keys = [], [], {}, []
        self._step_refused = set()

    def _fail_pending(self, exc: BaseException, fut: torch.futures.Future) -> None:
        """Fail the step's pending futures and `fut` with `exc`, and drop the step's
        statistics so that a run that catches the error starts its next step clean. The
        buckets still on the wire are landed first (their results dropped with the step): left
        in flight, a later step's collectives met theirs and a run that went on hung. (Not a
        bucket that failed while it was being issued: what it sent is left in flight.)"""
        self._failed = True
        with self._lock:  # (the worker's done-callback and DDP's thread may both get here)
            abandoned = [j for j in (self._inflight, *self._issued) if j is not None]
            pending, self._pending, self._inflight, self._issued = self._pending, [], None, []
        for job in abandoned:
            with contextlib.suppress(Exception):  # (what failed is `exc`'s to say)
                job.finish()
        self._clear_step_stats()
        self._bucket_times = []
        for f in [p for p, *_ in pending] + [fut]:
            if not f.done():
                f.set_exception(exc)

    def _log(self, event: dict[str, Any]) -> None:
        event = {"step": event["step"], "rank": self.rank, **{k: v for k, v in event.items() if k != "step"}}
        self.events.append(event)


def _backward_witness(loss: torch.Tensor) -> Any:
    """The autograd node a backward through `loss` runs, however the loss was derived before
    `observe` (``loss.float()``, ``loss.reshape(1)``, ``2 * loss``): down its graph while each
    node has one input, so a backward of the loss itself passes it too. Never a parameter's
    gradient accumulator, which outlives the step (a late observe's hook there would fire in
    the next step's backward): the step's own node above it; None for a leaf loss."""
    node = loss.grad_fn
    while node is not None:
        inputs = [n for n, _ in node.next_functions if n is not None]
        if len(inputs) != 1 or not inputs[0].next_functions:
            break
        node = inputs[0]
    return node


def _views(buffer: torch.Tensor, numels: Sequence[int]) -> tuple[list[int], list[torch.Tensor]]:
    """A bucket's parameters' offsets and views (`numels` elements each), in order."""
    offsets = list(itertools.accumulate(numels[:-1], initial=0)) if numels else []
    return offsets, [buffer[o:o + n] for o, n in zip(offsets, numels, strict=True)]


def _future(buffer: torch.Tensor) -> torch.futures.Future:
    """The future a bucket's reduce completes for DDP: on a GPU one that records the CUDA
    streams its value was written on when set, so DDP's wait orders its copy into `.grad`
    after that work (zeroing a non-finite step included), as the futures of its own
    collectives do."""
    if buffer.device.type == "cuda":
        return torch.futures.Future(devices=[buffer.device])
    return torch.futures.Future()
