"""One statistics round and one host read per step: the hook's local statistics become numbers
every rank shares.

The step's statistics stay tensors on the buckets' device until the step ends: each bucket's
gradient norms (before the reduce) and update norms (after it), the sign routes' vote
margins, the observed loss. `StatsRound` packs them into one float64 vector, on the device:
whether anything was not finite, the ranks' losses (count and sum: a rank that did not
`observe` a loss does not count), per scope the squared gradient norm and the agreement sums,
and each low-bit bucket's reduce time (summed, so the gate judges the ranks' mean). That vector
is summed over the ranks, and read to the host together with the update norms, in
`host_read`: the step's one synchronisation (a test counts it). Every rank unpacks the same
sums, so every decision taken from them is the same on every rank.

The vector rides on the last bucket's all-gather where that bucket has one (`Exchange`'s
rider: every rank appends its vector to its row, and every rank sums the W rows in rank
order), so the step pays no round of its own: on vision at W = 2 a separate small all-reduce
cost about 1.5 ms of a 13-16 ms step even when issued alongside that all-gather (measured
with it skipped, arms interleaved). Where the last bucket has no exchange (every parameter on
fp32, a gate-refused bucket, a traced run) the round is its own all-reduce: issued ahead of
the bucket's all-reduce where that is the whole bucket's and the run is not traced (nothing
left to add to it, and the small round then does not queue behind the bucket on the link),
else after the bucket's middle stage. Either way two things wait for the result instead: the
agreement of pieces combined whole on every rank (complete on each rank already, added to
it) and the last bucket's reduce time (it rides in the next step's round).

Sums are taken in a fixed order (bucket order, then parameter order within a bucket), in
float64, so a scope's squared norm is the same number a sequential Python sum gives.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from nfabric_cli.routes.comm import Comm, sum_in_rank_order
from nfabric_cli.routes.device import to_device

_SUMS = ("agree_sum", "agree_n")  # the agreement sums, per scope
Named = tuple[list[str], torch.Tensor]  # per bucket: a label per parameter, a value per parameter

#: Host reads so far (`host_read` calls), for tests: one per step is the contract.
HOST_READS = [0]


@dataclass(frozen=True)
class Agreed:
    """One step's statistics, as every rank holds them after the all-reduce."""

    nonfinite: bool
    loss: float | None  # mean over the ranks that reported one
    grad_norms: dict[str, float]  # per scope, sqrt of the summed squared local norms
    agreement: dict[str, float]  # per sign scope: agree_sum / agree_n
    bucket_seconds: list[float]  # per low-bit reduce timed: mean over the ranks
    update_norms: dict[str, float]  # per parameter: the reduced update's norm (every rank's)


def host_read(t: torch.Tensor) -> list[float]:
    """The step's one device-to-host read."""
    HOST_READS[0] += 1
    return t.tolist()


class StatsRound:
    """The step's statistics, agreed once: packed when the round goes out (`payload`, for the
    last bucket's all-gather, or `issue`, its own all-reduce), so that agreement sums added
    up to then are in it, and read back once with the update norms (`result`). `acc` returns
    the agreement sums that need summing over ranks, as of the moment it is called."""

    def __init__(self, comm: Comm, scopes: list[str], norms: Sequence[Named],
                 loss: torch.Tensor | float | None,
                 acc: Callable[[], dict[str, torch.Tensor | float]], bucket_seconds: list[float],
                 device: torch.device) -> None:
        self.comm, self.scopes, self.device = comm, scopes, device
        self.n_seconds = len(bucket_seconds)
        self._inputs = (norms, loss, acc, bucket_seconds)
        self.nbytes = 8 * _size(len(scopes), self.n_seconds)  # the vector's size
        self.vec: torch.Tensor | None = None
        self._pending = None

    @property
    def sent(self) -> bool:
        """Whether the round went out (as a rider or on its own)."""
        return self.vec is not None

    def _build(self) -> torch.Tensor:
        norms, loss, acc, seconds = self._inputs
        self.vec = _pack(self.scopes, norms, loss, acc(), seconds, self.device)
        return self.vec

    def payload(self) -> torch.Tensor:
        """This rank's vector as bytes, for an all-gather that carries it (`Exchange`)."""
        return self._build().view(torch.uint8)

    def land(self, rows: torch.Tensor) -> None:
        """Every rank's payload (W rows of `nbytes`), gathered: their sum, in rank order."""
        self.vec = sum_in_rank_order(rows.contiguous().view(torch.float64).unbind(0))

    def issue(self) -> None:
        """No all-gather to ride: the round's own all-reduce."""
        vec = self._build()
        if self.comm.world_size > 1:
            self._pending = self.comm.allreduce_async(vec)

    def result(self, updates: Sequence[Named],
               whole: dict[str, float] | None = None) -> Agreed:
        """Wait for the all-reduce and read it back with `updates` (per bucket, the reduced
        update's norms: identical on every rank) in the step's one host read. `whole`:
        "agree_sum:<scope>" / "agree_n:<scope>" sums every rank holds complete already
        (pieces combined whole on every rank), added to the reduced ones."""
        assert self.vec is not None, "the round was never sent"
        if self._pending is not None:
            self._pending.wait()
        f64 = {"dtype": torch.float64, "device": self.device}
        whole = whole or {}
        # the whole sums may be device tensors: read with the rest, in the one host read
        extra = [_f64_vector(list(whole.values()), self.device)] if whole else []
        after = [t.reshape(-1).to(**f64) for _, t in updates]
        parts = [self.vec, *extra, *after]
        v = host_read(torch.cat(parts) if len(parts) > 1 else self.vec)
        read = _unpack(v, self.scopes, self.n_seconds)
        sums, n = read.sums, read.end
        for key, value in zip(whole, v[n:n + len(whole)], strict=True):
            sums[key] += value
        n += len(whole)
        return Agreed(
            nonfinite=read.nonfinite,
            loss=read.loss,
            grad_norms={s: math.sqrt(read.norm2[s]) for s in self.scopes},
            agreement={s: sums[f"agree_sum:{s}"] / sums[f"agree_n:{s}"] for s in self.scopes
                       if sums[f"agree_n:{s}"] > 0},
            bucket_seconds=[t / self.comm.world_size for t in read.seconds],
            update_norms=dict(zip([name for names, _ in updates for name in names],
                                  v[n:], strict=True)),
        )


def _pack(scopes: list[str], norms: Sequence[Named], loss: torch.Tensor | float | None,
          acc: dict[str, torch.Tensor | float], bucket_seconds: list[float],
          device: torch.device) -> torch.Tensor:
    """The float64 vector the ranks sum, laid out as `_unpack` reads it: whether anything
    was not finite, the loss sum, per scope the squared gradient norm (non-finite norms left
    out), per scope the agreement sums (one `torch.tensor` where the native kernels gave host
    numbers, else the torch path's tensors stacked), then the loss count (ranks that observed
    one) and the timed reduces, host numbers in one `torch.tensor`. This runs every step,
    between buckets, in about a dozen small tensor ops (about 30 before: 0.24 ms a step)."""
    f64 = {"dtype": torch.float64, "device": device}
    ok: torch.Tensor | None = None  # all finite, as a 0-d bool tensor
    if norms:
        grads = (norms[0][1] if len(norms) == 1 else torch.cat([t for _, t in norms])).to(**f64)
        owners = tuple(s for names, _ in norms for s in names)
        ok = torch.isfinite(grads)
        norm2 = torch.zeros(len(scopes), **f64).index_add_(
            0, _scope_index(tuple(scopes), owners, device), torch.where(ok, grads * grads, 0.0))
        ok = ok.all()
    else:
        norm2 = torch.zeros(len(scopes), **f64)
    if loss is None:  # no loss observed: counted as none (0 ranks), and finite
        loss_sum = torch.zeros(1, **f64)
    else:
        loss_sum = (loss.detach().to(**f64).reshape(1) if isinstance(loss, torch.Tensor)
                    else to_device(torch.tensor([float(loss)], dtype=torch.float64), device))
        finite = torch.isfinite(loss_sum[0])
        ok = finite if ok is None else ok & finite
        loss_sum = loss_sum.nan_to_num(0.0, 0.0, 0.0)
    flag = torch.zeros(1, **f64) if ok is None else (~ok).to(**f64).reshape(1)
    sums = _f64_vector([acc.get(f"{k}:{s}", 0.0) for k in _SUMS for s in scopes], device)
    host = to_device(torch.tensor([float(loss is not None), *bucket_seconds],
                                  dtype=torch.float64), device)
    return torch.cat([flag, loss_sum, norm2, sums, host])


class _Read(NamedTuple):
    """`_pack`'s vector summed over the ranks, read back (`_unpack`)."""

    nonfinite: bool
    loss: float | None  # mean over the ranks that observed one
    norm2: dict[str, float]  # per scope, the squared gradient norm
    sums: dict[str, float]  # "agree_sum:<scope>" / "agree_n:<scope>"
    seconds: list[float]  # the timed reduces, summed over the ranks
    end: int  # where the vector ends in the step's host read


def _unpack(v: list[float], scopes: Sequence[str], n_seconds: int) -> _Read:
    k = len(scopes)
    count, end = v[2 + 3 * k], _size(k, n_seconds)
    keys = [f"{kind}:{s}" for kind in _SUMS for s in scopes]
    return _Read(v[0] > 0, v[1] / count if count > 0 else None,
                 dict(zip(scopes, v[2 : 2 + k], strict=True)),
                 dict(zip(keys, v[2 + k : 2 + 3 * k], strict=True)), v[3 + 3 * k : end], end)


def _size(scopes: int, n_seconds: int) -> int:
    """The vector's length: flag, loss sum, three numbers per scope, loss count, the times."""
    return 3 + 3 * scopes + n_seconds


@functools.lru_cache(maxsize=64)
def _scope_index(scopes: tuple[str, ...], owners: tuple[str, ...],
                 device: torch.device) -> torch.Tensor:
    """Each parameter's scope as an index into `scopes` (the same buckets every step)."""
    index = {s: i for i, s in enumerate(scopes)}
    return torch.tensor([index[s] for s in owners], dtype=torch.long, device=device)


def _f64_vector(values: Sequence[torch.Tensor | float], device: torch.device) -> torch.Tensor:
    """Numbers as one float64 vector on `device`: in one copy when they are host numbers (the
    native kernels' sums), else element by element (the torch path's unread tensors, host
    numbers filled in on the device: no copy that would wait for a GPU)."""
    f64 = {"dtype": torch.float64, "device": device}
    if all(isinstance(v, (int, float)) for v in values):
        return to_device(torch.tensor(values, dtype=torch.float64), device)
    return torch.stack([v.to(**f64).reshape(()) if isinstance(v, torch.Tensor)
                        else torch.full((), float(v), **f64) for v in values])
