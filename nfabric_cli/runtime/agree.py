"""One small all-reduce per step: the hook's local statistics become numbers every rank shares.

Packed into one float64 vector, summed over the ranks: whether anything was not finite, the
ranks' losses (count and sum: a rank that did not `observe` a loss does not count), per scope
the squared gradient norm and the sign routes' agreement sums, and each low-bit bucket's
reduce time (summed, so the gate judges the ranks' mean). Every rank unpacks the same sums, so
every decision taken from them is the same on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nfabric_cli.routes.comm import Comm

_KINDS = ("norm2", "agree_sum", "agree_n")


@dataclass(frozen=True)
class Agreed:
    """One step's statistics, as every rank holds them after the all-reduce."""

    nonfinite: bool
    loss: float | None  # mean over the ranks that reported one
    grad_norms: dict[str, float]  # per scope, sqrt of the summed squared local norms
    agreement: dict[str, float]  # per sign scope: agree_sum / agree_n
    bucket_seconds: list[float]  # per low-bit reduce timed: mean over the ranks


def agree_step(comm: Comm, scopes: list[str], nonfinite: bool, loss: float | None,
               acc: dict[str, float], bucket_seconds: list[float]) -> Agreed:
    """All-reduce this rank's statistics (`acc`: "norm2:<scope>" etc. sums) once."""
    keys = [f"{k}:{s}" for s in scopes for k in _KINDS]
    bad = nonfinite or (loss is not None and not math.isfinite(loss))
    local = [1.0 if bad else 0.0, 0.0 if loss is None else 1.0,
             loss if loss is not None and math.isfinite(loss) else 0.0]
    local += [acc.get(k, 0.0) for k in keys]
    local += list(bucket_seconds)
    vec = torch.tensor(local, dtype=torch.float64)
    if comm.world_size > 1:
        comm.allreduce(vec)
    v = vec.tolist()
    vals = dict(zip(keys, v[3 : 3 + len(keys)], strict=True))
    return Agreed(
        nonfinite=v[0] > 0,
        loss=v[2] / v[1] if v[1] > 0 else None,
        grad_norms={s: math.sqrt(vals[f"norm2:{s}"]) for s in scopes},
        agreement={s: vals[f"agree_sum:{s}"] / vals[f"agree_n:{s}"] for s in scopes
                   if vals[f"agree_n:{s}"] > 0},
        bucket_seconds=[t / comm.world_size for t in v[3 + len(keys):]],
    )
