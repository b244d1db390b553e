"""The simulated ranks' step: local gradients and their aggregate, in one process or in forked
ones.

Each simulated rank computes ``workload.loss(model, train_batch(step, rank, W, seed))`` and its
gradient with the ops a DDP rank runs, and draws from its own RNG stream (every rank starts
from ``manual_seed(seed)``, as a real rank seeded that way does), so a rank's gradient is
bit-identical however many processes compute them. The gradients are then aggregated with the
step's routes (`aggregate.py`), which is bit-identical however the parameters are split.

With ``processes > 1`` (POSIX ``fork``), parameters, gradients and the aggregate live in shared
memory and P forked children (one intra-op thread each) work in two phases per step: child p
computes the ranks ``r ≡ p (mod P)``; after a barrier it aggregates its shard of the
parameters over all ranks, keeping those parameters' error feedback. The parent steps the
optimizer in place, which the children read at the next step. The W simulated ranks then use
the machine's cores as W real ranks would, and so does the reduce. A model with buffers
(BatchNorm running statistics, which DDP broadcasts from rank 0 every step) is simulated in
one process.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import threading
import traceback
import warnings
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
from torch import nn

from nfabric_cli.calibration.aggregate import Aggregator, Agreement, Plan, merge_agreement, shard
from nfabric_cli.workloads.base import Workload

#: Seconds a closing child may take to exit before it is terminated.
JOIN_TIMEOUT_S = 5.0


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_processes(world_size: int) -> int:
    """One process per usable CPU, at most one per simulated rank."""
    return max(1, min(world_size, usable_cpus()))


@dataclass
class RanksStep:
    """One step of every simulated rank: flat fp32 local gradient per parameter (views of a
    buffer the next step overwrites; non-finite values zeroed), loss, the gradient norm of
    each parameter before zeroing (the hook's health statistics), what every rank receives
    per parameter (views of a buffer the next step overwrites), and the sign agreement."""

    grads: list[list[torch.Tensor]]
    losses: list[float]
    norms: list[list[float]]
    agreed: list[torch.Tensor]
    agreement: Agreement


class SimulatedRanks:
    """Per step: every simulated rank's gradient and loss, and their aggregate under a plan."""

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
    ) -> None:
        """`groups[i]`: what parameter i is reduced with (see `aggregate.shard`)."""
        self.workload, self.model, self.params = workload, model, params
        self.world_size, self.seed = world_size, seed
        self.numels = [p.numel() for p in params]
        total = sum(self.numels)
        wanted = default_processes(world_size) if processes is None else int(processes)
        if wanted < 1:
            raise ValueError(f"processes must be >= 1, got {processes}")
        self.processes = min(wanted, world_size)
        if self.processes > 1 and (
            "fork" not in mp.get_all_start_methods() or any(True for _ in model.buffers())
        ):
            self.processes = 1
        start = torch.Generator().manual_seed(int(seed)).get_state()
        self.rng = [start.clone() for _ in range(world_size)]
        self.buffers = [torch.zeros(total) for _ in range(world_size)]
        self.views = [list(torch.split(b, self.numels)) for b in self.buffers]
        self.out = torch.zeros(total)
        self.out_views = list(torch.split(self.out, self.numels))
        self.shards = shard(self.numels, self.processes, groups)
        self.aggregators = [Aggregator(names, world_size, seed, owned) for owned in self.shards]
        self._plans: dict[Plan, int] = {}
        self.conns: list[Connection] = []
        self.children: list[Any] = []
        self.barrier: Any = None
        if self.processes > 1:
            self._fork()

    # -- one rank ----------------------------------------------------------------------------
    def _rank_gradient(self, step: int, rank: int) -> tuple[float, list[float]]:
        """Rank `rank`'s gradient of step `step` into its buffer; returns its loss and the
        gradient norm of each parameter. A non-finite gradient is zeroed after its norm is
        taken (NaN never reaches a codec; the step is neutralised anyway)."""
        saved = torch.get_rng_state()
        torch.set_rng_state(self.rng[rank])
        try:
            batch = self.workload.train_batch(step, rank, self.world_size, self.seed)
            loss = self.workload.loss(self.model, batch)
            got = torch.autograd.grad(loss, self.params, allow_unused=True)
            self.rng[rank] = torch.get_rng_state()
        finally:
            torch.set_rng_state(saved)
        norms = []
        for view, g in zip(self.views[rank], got, strict=True):
            if g is None:
                view.zero_()
            else:
                view.copy_(g.detach().reshape(-1))
            norms.append(float(torch.linalg.vector_norm(view)))
        if not all(math.isfinite(n) for n in norms):
            self.buffers[rank].nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        return float(loss.detach()), norms

    # -- the step ----------------------------------------------------------------------------
    def step(self, step: int, plan: Plan) -> RanksStep:
        """Every rank's gradient, loss and norms for `step`, and their aggregate under `plan`."""
        if not self.conns:
            done = [self._rank_gradient(step, r) for r in range(self.world_size)]
            agree = self.aggregators[0].run(step, plan, self.views, self.out_views)
            return RanksStep(self.views, [d[0] for d in done], [d[1] for d in done],
                             self.out_views, agree)
        known = plan in self._plans
        if not known:
            self._plans[plan] = len(self._plans)
        for conn in self.conns:  # a plan crosses the pipe once; then its number does
            conn.send((step, self._plans[plan], None if known else plan))
        losses = [0.0] * self.world_size
        norms: list[list[float]] = [[] for _ in range(self.world_size)]
        agreements = []
        for msg in self._collect(step):
            for rank, (loss, rank_norms) in msg[1]:
                losses[rank], norms[rank] = loss, rank_norms
            agreements.append(msg[2])
        return RanksStep(self.views, losses, norms, self.out_views, merge_agreement(agreements))

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
            raise RuntimeError(f"simulated rank failed at step {step}: {first[1]}\n{first[2]}")
        return [replies[p] for p in sorted(replies)]

    # -- processes ---------------------------------------------------------------------------
    def _fork(self) -> None:
        for t in (*self.params, *self.buffers, self.out):
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

    def _serve(self, conn: Connection, parent_end: Connection, p: int) -> None:
        """A child's loop: for each (step, plan) received, its ranks' gradients, the barrier,
        then its shard's aggregate; None ends it."""
        # Only the parent may hold the parent's ends (ours and earlier siblings'), or a parent
        # killed outright would leave this child waiting forever instead of reading EOF.
        for other in (*self.conns, parent_end):
            other.close()
        torch.set_num_threads(1)
        ranks = range(p, self.world_size, self.processes)
        plans: dict[int, Plan] = {}
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # the parent is gone
                return
            if msg is None:
                return
            step, number, plan = msg
            if plan is not None:
                plans[number] = plan
            try:
                done = [(r, self._rank_gradient(step, r)) for r in ranks]
            except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises
                self.barrier.abort()
                conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
                continue
            try:
                self.barrier.wait()
                agree = self.aggregators[p].run(step, plans[number], self.views, self.out_views)
                conn.send(("ok", done, agree))
            except threading.BrokenBarrierError:
                conn.send(("error", _BROKEN, ""))
            except Exception as exc:  # noqa: BLE001
                conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))

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
