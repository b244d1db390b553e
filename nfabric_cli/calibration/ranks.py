"""The simulated ranks' step: local gradients, their aggregate and the optimizer step, in one
process or in forked ones.

Each simulated rank computes ``workload.loss(model, train_batch(step, rank, W, seed))`` and its
gradient with the ops a DDP rank runs, and draws from its own RNG stream (every rank starts
from ``manual_seed(seed)``, as a real rank seeded that way does), so a rank's gradient is
bit-identical however many processes compute them. The gradients are then aggregated with the
step's routes (`aggregate.py`), which is bit-identical however the parameters are split, a
non-finite value never reaches a codec (zeroed before the reduce, except in an all-fp32
phase, which is plain DDP's and sums the NaN into every update, as DDP does), the caller's
decision on the step (`decide`: the step controller's skip of a non-finite step and
scale-downs of held scopes, from the ranks' statistics and the aggregate's norms) is
applied, and the optimizer and scheduler
step. Everything runs with one intra-op thread, as each real rank does (`validation/worker.py`):
a convolution's backward sums in another order with more threads, so a 2-thread simulation
drifts from real DDP bit by bit.

With ``processes > 1`` (POSIX ``fork``), parameters, gradients and the aggregate live in shared
memory and P forked children (one intra-op thread each) share the work as W real ranks share
the machine's cores: child p computes the ranks ``r = p (mod P)``; after a barrier it
aggregates its shard of the parameters over all ranks (keeping those parameters' error
feedback) and steps the optimizer on that shard (its forked copy of the optimizer, with
gradients set on the shard alone: the optimizers in `PER_PARAMETER` update each parameter
from its own gradient and state only, so the shards' steps are the optimizer's step bit for
bit); after a second barrier every parameter is updated and the child goes straight on to
the next step's gradients, which depend on no decision of the parent (only the aggregate
needs the step's plan, and the update the parent's decision, which the children wait for
between aggregating and updating). The parent's own work per step (the health monitor, a checkpoint's
evaluation) thus overlaps the children's next forward and backward passes. The parameters
must change only through `step`. A model with buffers (BatchNorm running statistics, which DDP
broadcasts from rank 0 before every forward: `_every_rank_gradient`) or an optimizer outside
`PER_PARAMETER` is simulated in one process.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import signal
import threading
import traceback
import warnings
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
from torch import nn

from nfabric_cli.calibration.aggregate import (
    Aggregator,
    Agreement,
    StepRoutes,
    merge_agreement,
    shard,
)
from nfabric_cli.calibration.cpus import PER_PARAMETER, default_processes, one_thread, usable_cpus
from nfabric_cli.calibration.reduces import ReduceOrders
from nfabric_cli.errors import PluginError, user_frame
from nfabric_cli.ranks.loop import RankRng
from nfabric_cli.runtime.controller import StepDecision
from nfabric_cli.runtime.inject import Injection, apply_injection

__all__ = ["PER_PARAMETER", "Decide", "RanksStep", "SimulatedRanks", "default_processes",
           "one_thread", "usable_cpus"]
from nfabric_cli.workloads.base import Workload

#: Seconds a closing child may take to exit before it is terminated.
JOIN_TIMEOUT_S = 5.0


@dataclass
class RanksStep:
    """One step of every simulated rank: loss, the gradient norm of each parameter (the hook's
    health statistics, taken before non-finite values are zeroed), whether any of them was
    not finite (the step was then neutralised, unless plain: zero gradients on every rank),
    and the sign agreement."""

    losses: list[float]
    norms: list[list[float]]
    nonfinite: bool
    agreement: Agreement
    #: per rank and parameter: in the rank's autograd graph this step. A copy: the children
    #: compute the next step's gradients, and their flags, as soon as this step is done
    used: torch.Tensor
    #: per parameter: the norm of the aggregate (what every rank received), before any decision
    update_norms: list[float] | None = None


#: The caller's decision on a step, from its `RanksStep` (the step controller's): whether the
#: update is zeroed (skipped), and per scope the factor its aggregate is multiplied by before
#: the optimizer step (absent: 1).
Decide = Callable[[RanksStep], StepDecision]


def as_bucketed(flat: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`flat` (one parameter's elements) as DDP's bucket view of `param`'s gradient: in the
    parameter's own memory layout where it is dense (channels_last included), so element k of
    the flat buffer is the one the hook receives at k, else in the contiguous one."""
    if _dense(param):
        return flat.as_strided(param.size(), param.stride())
    return flat.view(param.size())


def _dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill its memory without gaps or overlaps, in some dim order."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.size(), t.stride(), strict=True)
                               if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _finite(loss: float, norms: Sequence[float]) -> bool:
    return math.isfinite(loss) and all(math.isfinite(n) for n in norms)


class SimulatedRanks:
    """Per step: every simulated rank's gradient and loss, their aggregate under a plan, and
    the optimizer step (none without an optimizer).

    `views[rank][i]`: rank's flat gradient of parameter i, and `out_views[i]`: what every rank
    received, at the last step. With forked children, `views`, `bad` and `used` may already
    hold the next step's values once `step` returns (each child computes it ahead): read a
    step's flags from its `RanksStep`; `out_views` stays until the next `step`."""

    def __init__(
        self,
        workload: Workload,
        model: nn.Module,
        params: list[nn.Parameter],
        names: list[str],
        world_size: int,
        seed: int,
        processes: int | None = None,
        groups: Sequence[Hashable] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        injections: Sequence[Injection] = (),
        orders: ReduceOrders | None = None,
    ) -> None:
        """`groups[i]`: what parameter i is reduced with (see `aggregate.shard`); `optimizer`
        (and `scheduler`, stepped once per step): built over `params` (or a superset);
        `injections`: nan / spike faults put into a rank's gradient as the hook puts them;
        `orders`: the real run's all-reduces, for float routes' summation order."""
        self.workload, self.model, self.params = workload, model, params
        self.injections = tuple(injections)
        self.world_size, self.seed = world_size, seed
        self.optimizer, self.scheduler = optimizer, scheduler
        self.numels = [p.numel() for p in params]
        total = sum(self.numels)
        wanted = default_processes(world_size) if processes is None else int(processes)
        if wanted < 1:
            raise ValueError(f"processes must be >= 1, got {processes}")
        self.processes = min(wanted, world_size)
        if self.processes > 1 and (
            "fork" not in mp.get_all_start_methods()
            or any(True for _ in model.buffers())
            or (optimizer is not None and type(optimizer) not in PER_PARAMETER)
        ):
            self.processes = 1
        self.rng = [RankRng(seed) for _ in range(world_size)]  # as every real rank's
        self.buffers = [torch.zeros(total) for _ in range(world_size)]
        self.views = [list(torch.split(b, self.numels)) for b in self.buffers]
        self.out = torch.zeros(total)
        self.out_views = list(torch.split(self.out, self.numels))
        self.bad = torch.zeros(world_size, dtype=torch.bool)  # per rank: non-finite this step
        # per rank and parameter: in the rank's autograd graph this step (`_update`)
        self.used = torch.ones(world_size, len(params), dtype=torch.bool)
        self.shards = shard(self.numels, self.processes, groups)
        self.aggregators = [Aggregator(names, world_size, seed, owned, orders)
                            for owned in self.shards]
        self._plans: dict[StepRoutes, int] = {}
        self.conns: list[Connection] = []
        self.children: list[Any] = []
        self.barrier: Any = None
        if self.processes > 1:
            self._fork()

    # -- one rank ----------------------------------------------------------------------------
    def _rank_gradient(self, step: int, rank: int) -> tuple[float, list[float]]:
        """Rank `rank`'s gradient of step `step` into its buffer; returns its loss and the
        gradient norm of each parameter, and marks the rank in `bad` if any is not finite.
        A non-finite gradient is zeroed later, before the reduce, unless the step is plain
        DDP's (`_neutralise_inputs`)."""
        with self.rng[rank].active():
            batch = self.workload.train_batch(step, rank, self.world_size, self.seed)
            loss = self.workload.loss(self.model, batch)
            got = torch.autograd.grad(loss, self.params, allow_unused=True)
        norms = []
        for i, (view, g, p) in enumerate(zip(self.views[rank], got, self.params, strict=True)):
            self.used[rank, i] = g is not None
            if g is None:  # DDP (find_unused_parameters) reduces zeros for it
                view.zero_()
            else:
                as_bucketed(view, p).copy_(g.detach())
        if self.injections:
            apply_injection(self.injections, step, rank, self.views[rank])
        for view in self.views[rank]:
            norms.append(float(torch.linalg.vector_norm(view)))
        value = float(loss.detach())
        finite = _finite(value, norms)
        self.bad[rank] = not finite
        return value, norms

    def _every_rank_gradient(self, step: int) -> list[tuple[float, list[float]]]:
        """Every rank's `_rank_gradient` of `step`, in one process. DDP broadcasts rank 0's
        buffers (BatchNorm's running statistics) before each forward, so every rank's forward
        starts from them and only rank 0's own forward carries into the next step and into an
        evaluation, which rank 0 runs: the model keeps those. Ranks run in turn on one model
        here, so each starts from the step's buffers and rank 0's are put back at the end."""
        buffers = list(self.model.buffers())  # now: a module may rebind one
        if not buffers:
            return [self._rank_gradient(step, r) for r in range(self.world_size)]
        start = [b.clone() for b in buffers]
        done = [self._rank_gradient(step, 0)]
        kept = [b.clone() for b in buffers]
        for rank in range(1, self.world_size):
            for b, s in zip(buffers, start, strict=True):
                b.copy_(s)
            done.append(self._rank_gradient(step, rank))
        for b, k in zip(buffers, kept, strict=True):
            b.copy_(k)
        return done

    def _neutralise_inputs(self, owned: Sequence[int], plan: StepRoutes) -> None:
        """Zero the non-finite values of the owned parameters' gradients, rank by rank, before
        they are reduced (NaN never reaches a codec; the step is neutralised anyway), as the
        hook does before it encodes. A plain step (`plan.plain`) keeps them: plain DDP sums
        them into every rank's update."""
        if plan.plain:
            return
        for rank in torch.nonzero(self.bad).flatten().tolist():
            for i in owned:
                self.views[rank][i].nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)

    def _norms(self, owned: Sequence[int]) -> dict[int, float]:
        return {i: float(torch.linalg.vector_norm(self.out_views[i])) for i in owned}

    def _update(self, owned: Sequence[int], plan: StepRoutes, decision: StepDecision) -> None:
        """The optimizer (and scheduler) step on the parameters `owned`, from the aggregate
        scaled by the decision's `scales` (per scope); a skipped step updates from zero
        gradients, as every real rank then does."""
        for i in owned:
            if decision.skip:
                self.out_views[i].zero_()
                for agg in self.aggregators:  # as the hook: nothing of the step is kept
                    agg.reset_feedback(i)
            elif decision.apply_(plan.regions[i], self.out_views[i], not plan.specs[i].lowbit):
                for agg in self.aggregators:  # as the hook: the residual goes with the update
                    agg.reset_feedback(i)
        if self.optimizer is None:
            return
        # DDP leaves the gradient of a parameter no rank used untouched (None after
        # `zero_grad(set_to_none=True)`), so the optimizer skips it: no momentum, no decay
        used = set(owned) & set(torch.nonzero(self.used.any(0)).flatten().tolist())
        for i, p in enumerate(self.params):
            p.grad = as_bucketed(self.out_views[i], p) if i in used else None
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    # -- the step ----------------------------------------------------------------------------
    @staticmethod
    def _decision(out: RanksStep, plan: StepRoutes, decide: Decide | None) -> StepDecision:
        """`decide`'s verdict; without one, a non-finite step is skipped unless plain (the
        step controller's rule)."""
        if decide is not None:
            return decide(out)
        return StepDecision(out.nonfinite and not plan.plain)

    def step(self, step: int, plan: StepRoutes, decide: Decide | None = None,
             measure: bool = True, last: bool = False) -> RanksStep:
        """Train `step`: gradients, losses, norms, the aggregate under `plan`, `decide`'s
        scale-downs (given `measure`, from the aggregate's norms) and the optimizer step.
        `last`: the run ends here, so the children do not compute the next step's gradients
        ahead (they would compete with the final evaluation for nothing; a later `step`
        still works, computing its gradients when asked)."""
        measure = measure and decide is not None
        if not self.conns:
            with one_thread():
                done = self._every_rank_gradient(step)
                self._neutralise_inputs(self.shards[0], plan)
                agree = self.aggregators[0].run(step, plan, self.views, self.out_views)
                nonfinite = bool(self.bad.any())
                owned = self.shards[0]
                norms = self._norms(owned) if measure else {}
                out = RanksStep([d[0] for d in done], [d[1] for d in done], nonfinite, agree,
                                self.used.clone(),
                                [norms[i] for i in range(len(self.params))] if norms else None)
                self._update(owned, plan, self._decision(out, plan, decide))
            return out
        known = plan in self._plans
        if not known:
            self._plans[plan] = len(self._plans)
        for conn in self.conns:  # a plan crosses the pipe once; then its number does
            conn.send((step, self._plans[plan], None if known else plan, measure))
        losses = [0.0] * self.world_size
        norms: list[list[float]] = [[] for _ in range(self.world_size)]
        agreements = []
        updates: dict[int, float] = {}
        for msg in self._collect(step):
            for rank, (loss, rank_norms) in msg[1]:
                losses[rank], norms[rank] = loss, rank_norms
            agreements.append(msg[2])
            updates.update(msg[3])
        nonfinite = not all(_finite(v, n) for v, n in zip(losses, norms, strict=True))
        # read while every child waits for the decision: once it has it, a child goes on to
        # the next step's gradients and overwrites the shared flags
        out = RanksStep(losses, norms, nonfinite, merge_agreement(agreements), self.used.clone(),
                        [updates[i] for i in range(len(self.params))] if updates else None)
        decision = self._decision(out, plan, decide)
        for conn in self.conns:
            conn.send((decision, not last))
        self._collect(step)  # every shard updated
        return out

    def _collect(self, step: int) -> list[Any]:
        """Every child's reply to `step`, in child order; raises the first real failure (a
        child that dies or raises breaks the barrier, so its siblings stop waiting)."""
        replies: dict[int, Any] = {}
        index = {id(c): p for p, c in enumerate(self.conns)}
        pending = list(self.conns)
        while pending:
            for conn in wait(pending):
                p = index[id(conn)]
                pending.remove(conn)
                try:
                    replies[p] = conn.recv()
                except EOFError:
                    self.barrier.abort()
                    self.children[p].join(JOIN_TIMEOUT_S)  # its pipe closes before it is reaped
                    code = self.children[p].exitcode
                    raise RuntimeError(
                        f"simulated-rank process {p} exited (exit code {code}) at step {step}"
                    ) from None
        errors = [replies[p] for p in sorted(replies) if replies[p][0] == "error"]
        if errors:
            first = next((e for e in errors if e[1] != _BROKEN), errors[0])
            if len(first) > 3 and first[3] is not None:  # the user's own code raised it
                raise PluginError(f"the plugin's code raised {first[1]} ({first[3]}; in a "
                                  f"simulated rank at step {step})")
            raise RuntimeError(f"simulated rank failed at step {step}: {first[1]}\n{first[2]}")
        return [replies[p] for p in sorted(replies)]

    # -- processes ---------------------------------------------------------------------------
    def _fork(self) -> None:
        for t in (*self.params, *self.buffers, self.out, self.bad, self.used):
            t.detach().share_memory_()
        ctx = mp.get_context("fork")
        self.barrier = ctx.Barrier(self.processes)
        for p in range(self.processes):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=self._serve, args=(child, parent, p), daemon=True,
                               name=f"nfabric-sim-{p}")
            with warnings.catch_warnings():
                # Python >= 3.12 warns when a process with threads forks (a progress bar's
                # refresh thread, say). The child only runs torch ops on its own tensors and
                # talks over its pipe, so it takes no lock another thread may hold.
                warnings.filterwarnings("ignore", "This process .* is multi-threaded",
                                        DeprecationWarning)
                proc.start()
            child.close()
            self.conns.append(parent)
            self.children.append(proc)

    def _gradients(self, ranks: range, step: int) -> tuple[Any, ...]:
        """A child's first phase: its ranks' gradients of `step`, then the barrier after which
        every rank's are in place. ("ready", [(rank, (loss, norms))]) or ("error", what, tb);
        a failure breaks the barrier, so the siblings do not wait for it."""
        try:
            done = [(r, self._rank_gradient(step, r)) for r in ranks]
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises
            self.barrier.abort()
            return _failure(exc)
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            return ("error", _BROKEN, "")
        return ("ready", done)

    def _serve(self, conn: Connection, parent_end: Connection, p: int) -> None:
        """A child's loop: for each (step, plan) received, its ranks' gradients (usually
        computed ahead), its shard's aggregate and optimizer step, the reply, a barrier, then
        the next step's gradients ahead of its plan (not after the run's last step); None ends
        it."""
        # Only the parent may hold the parent's ends (ours and earlier siblings'), or a parent
        # killed outright would leave this child waiting forever instead of reading EOF.
        for other in (*self.conns, parent_end):
            other.close()
        # Ctrl-C reaches the whole process group: the parent handles it and stops us (a
        # child's KeyboardInterrupt would only print a traceback over the one-line message).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        torch.set_num_threads(1)
        ranks = range(p, self.world_size, self.processes)
        plans: dict[int, StepRoutes] = {}
        ahead: tuple[int, tuple[Any, ...], list[torch.Tensor]] | None = None
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # the parent is gone
                return
            if msg is None:
                return
            step, number, plan, measure = msg
            if plan is not None:
                plans[number] = plan
            if ahead is not None and ahead[0] == step:
                outcome = ahead[1]
            elif ahead is not None and ahead[1][0] == "error":  # the barrier is broken
                what = ahead[1][1]
                outcome = ("error", what if what == _BROKEN
                           else f"while computing step {ahead[0]} ahead: {what}", *ahead[1][2:])
            else:
                if ahead is not None:  # another step than the next was asked for
                    for r, state in zip(ranks, ahead[2], strict=True):
                        self.rng[r].state = state
                outcome = self._gradients(ranks, step)
            ahead = None
            if outcome[0] == "error":
                conn.send(outcome)
                continue
            owned = self.shards[p]
            try:
                self._neutralise_inputs(owned, plans[number])
                agree = self.aggregators[p].run(step, plans[number], self.views, self.out_views)
                updates = self._norms(owned) if measure else {}
            except Exception as exc:  # noqa: BLE001
                self.barrier.abort()
                conn.send(_failure(exc))
                continue
            conn.send(("ok", outcome[1], agree, updates))
            try:
                reply = conn.recv()  # the parent's decision on this step, and whether more come
            except EOFError:
                return
            if reply is None:
                return
            decision, more = reply
            try:
                self._update(owned, plans[number], decision)
            except Exception as exc:  # noqa: BLE001
                self.barrier.abort()
                conn.send(_failure(exc))
                continue
            conn.send(("updated",))
            try:
                self.barrier.wait()  # every shard is updated and every gradient read
            except threading.BrokenBarrierError:
                ahead = (step + 1, ("error", _BROKEN, ""), [])
                continue
            if not more:
                continue
            states = [self.rng[r].state.clone() for r in ranks]
            ahead = (step + 1, self._gradients(ranks, step + 1), states)

    def close(self) -> None:
        """Stop the children (idempotent)."""
        if self.barrier is not None:
            self.barrier.abort()  # a child waiting for a sibling that will never come
        for conn in self.conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self.children:
            proc.join(JOIN_TIMEOUT_S)
            if proc.is_alive():
                proc.terminate()
                proc.join(JOIN_TIMEOUT_S)
        for conn in self.conns:
            conn.close()
        self.conns, self.children = [], []

    def __enter__(self) -> SimulatedRanks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: What a child says when a sibling's failure broke the barrier (not the failure itself).
_BROKEN = "a sibling process failed"


def _failure(exc: BaseException) -> tuple[str, str, str, str | None]:
    """A child's error reply: what, its traceback, and the user's frame in it if any
    (`errors.user_frame`: a plugin's own bug, exit 2, not nfabric's)."""
    return ("error", f"{type(exc).__name__}: {exc}", traceback.format_exc(), user_frame(exc))
