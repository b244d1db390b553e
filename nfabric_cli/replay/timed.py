"""`TimedComm`: the routes' `Comm` with a clock around every collective.

A route's `reduce` runs codec work between its collectives: for a code route, scales and
encode before the data goes out (`all_to_all` or `gather`), the combine between that and the
result's return (`all_gather` or `broadcast`), unpack and decode after it. Timing the
collectives therefore splits the real reducer code path into encode / reduce / decode / wire
time without touching the route code (`split_stages`).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from nfabric_cli.routes.comm import Comm


class Event(NamedTuple):
    """One collective: kind, payload bytes, start and end in seconds since the reduce began."""

    kind: str
    nbytes: int
    start: float
    end: float


class Stages(NamedTuple):
    """Seconds of one `reduce` by cause (on one rank)."""

    encode: float
    reduce: float
    decode: float
    comm: float


class TimedComm(Comm):
    """`Comm` that also records an `Event` per collective, relative to `origin`."""

    __slots__ = ("events", "origin")

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(group)
        self.events: list[Event] = []
        self.origin = 0.0

    def start(self) -> float:
        """Forget earlier events; time is measured from now."""
        self.events.clear()
        self.origin = time.perf_counter()
        return self.origin

    def _timed(self, kind: str, t: torch.Tensor, call):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        out = call()
        t1 = time.perf_counter()
        self.events.append(Event(kind, t.numel() * t.element_size(), t0 - self.origin,
                                 t1 - self.origin))
        return out

    def allreduce(self, t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        return self._timed("allreduce", t, lambda: super(TimedComm, self).allreduce(t, op))

    def all_to_all(self, t: torch.Tensor) -> torch.Tensor:
        return self._timed("all_to_all", t, lambda: super(TimedComm, self).all_to_all(t))

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return self._timed("all_gather", t, lambda: super(TimedComm, self).all_gather(t))

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        return self._timed("gather", t, lambda: super(TimedComm, self).gather(t))

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        return self._timed("broadcast", t, lambda: super(TimedComm, self).broadcast(t))


def split_stages(events: list[Event] | list[list], total: float) -> Stages:
    """Encode / reduce / decode / collective seconds of one `reduce` that took `total`.

    With k collectives and the gaps g0..gk around them: one collective (fp32, bf16, fp16):
    encode g0, decode g1; more (code routes): encode is every gap before the data goes out
    (g0..g[k-2]: scales, their agreement's bookkeeping, codes), reduce is g[k-1] (the combine
    between data in and result out; ~0 on a central reducer's non-root ranks), decode is gk.
    """
    evs = [Event(*e) for e in events]
    if not evs:
        return Stages(0.0, 0.0, 0.0, 0.0)
    edges = [0.0] + [x for e in evs for x in (e.start, e.end)] + [total]
    gaps = [max(0.0, edges[2 * i + 1] - edges[2 * i]) for i in range(len(evs) + 1)]
    comm = sum(e.end - e.start for e in evs)
    if len(evs) == 1:
        return Stages(gaps[0], 0.0, gaps[1], comm)
    return Stages(sum(gaps[:-2]), gaps[-2], gaps[-1], comm)
