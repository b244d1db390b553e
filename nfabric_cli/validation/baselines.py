"""PyTorch's own compression hooks as baseline arms, with their traffic metered per step.

`fp16_compress_hook` all-reduces each bucket cast to fp16: 2 bytes per element.
`powerSGD_hook` all-reduces the bucket in fp32 until `start_powerSGD_iter`; afterwards, per
bucket, one fp32 all-reduce of the tensors it leaves uncompressed (1-D tensors and matrices
whose compression rate would be below `min_compression_rate`), then the P factors, then the
Q factors. `price_powersgd` repeats the hook's own split (same `_should_compress` test, same
rank clamp), so the bytes are what the hook really all-reduced, counted with the ring model
of `routes/plan.py` that every other arm uses.

A baseline is registered as `metered_hook` around the PyTorch hook; the wrapper prices the
bucket, then hands it on unchanged.

On gloo, PowerSGD's buckets go one at a time (`serial`). Its hook chains `Future.then`
callbacks that issue the next all-reduce and `.wait()` on it; gloo runs those callbacks on its
process group's worker threads (two). With two buckets' chains in flight both threads block
in `wait()` and the awaited all-reduces never run: the arm hung at step `start_powerSGD_iter`
with vision in 3 buckets (`--bucket-cap-mb 0.1`), reproduced with a bare 4-bucket DDP model.
More threads do not fix it: each rank then issues the chains' collectives in the order its
threads happen to finish, and gloo aborts on the mismatch (measured: "Received data size
doesn't match expected size"). One chain at a time keeps the order identical on every rank;
on NCCL, where the callbacks do not block a pool, the hook overlaps buckets as published.
"""

# No `from __future__ import annotations`: DDP inspects the hook's annotations when it is
# registered and expects the real `dist.GradBucket` and `torch.futures.Future` objects.
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

from nfabric_cli.routes.plan import op_wire_bytes

Price = Callable[[object, dist.GradBucket], list]


class HookByteMeter:
    """Bytes one rank sends and receives per step, filled bucket by bucket."""

    __slots__ = ("world_size", "rank", "step", "sent", "received")

    def __init__(self, world_size: int, rank: int) -> None:
        self.world_size, self.rank, self.step = world_size, rank, 0
        self.sent: list[int] = []
        self.received: list[int] = []

    def add(self, kind: str, nbytes: int) -> None:
        while len(self.sent) <= self.step:
            self.sent.append(0)
            self.received.append(0)
        wb = op_wire_bytes(kind, nbytes, self.world_size, self.rank)
        self.sent[self.step] += wb.sent
        self.received[self.step] += wb.received


class MeteredHookState:
    """A PyTorch hook, its own state, the function that prices one bucket, and whether
    buckets go one at a time (`serial`: each starts when the previous one's future is done)."""

    __slots__ = ("inner", "hook", "price", "meter", "serial", "last")

    def __init__(self, inner: object, hook: Callable, price: Price, meter: HookByteMeter,
                 serial: bool = False) -> None:
        self.inner, self.hook, self.price, self.meter = inner, hook, price, meter
        self.serial = serial
        self.last: torch.futures.Future | None = None


def metered_hook(
    state: MeteredHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Meter the bucket's collectives (priced before the hook advances its own state)."""
    for kind, nbytes in state.price(state.inner, bucket):
        state.meter.add(kind, nbytes)
    fut = _after_last(state, bucket) if state.serial else state.hook(state.inner, bucket)
    if bucket.is_last():
        state.meter.step += 1
    return fut


def _after_last(state: MeteredHookState, bucket: dist.GradBucket) -> torch.futures.Future:
    """Run the hook on `bucket` once the previous bucket's future is done (at once if it is)."""
    last = state.last
    if last is None or last.done():
        state.last = state.hook(state.inner, bucket)
        return state.last
    out: torch.futures.Future = torch.futures.Future()

    def start(_: Any) -> None:
        try:
            state.hook(state.inner, bucket).add_done_callback(lambda f: _relay(f, out))
        except Exception as exc:  # noqa: BLE001 - handed to DDP through the future
            out.set_exception(exc)

    state.last = out
    last.add_done_callback(start)
    return out


def _relay(done: torch.futures.Future, out: torch.futures.Future) -> None:
    try:
        out.set_result(done.value())
    except Exception as exc:  # noqa: BLE001 - the hook's own failure, handed on
        out.set_exception(exc)


def price_fp16(_: object, bucket: dist.GradBucket) -> list:
    return [("allreduce", bucket.buffer().numel() * 2)]


def price_powersgd(state: psgd.PowerSGDState, bucket: dist.GradBucket) -> list:
    """The all-reduces `powerSGD_hook` issues for this bucket at the state's current iter."""
    buffer = bucket.buffer()
    size = buffer.element_size()
    if state.iter < state.start_powerSGD_iter:
        return [("allreduce", buffer.numel() * size)]
    uncompressed = ps = qs = 0
    for param in bucket.parameters():
        n = param.shape[0] if param.dim() > 0 else 1
        m = param.numel() // max(n, 1)
        rank = min(n, m, state.matrix_approximation_rank)
        compress, full, _ = psgd._should_compress(n, m, rank, state.min_compression_rate)
        if compress:
            ps, qs = ps + n * rank, qs + m * rank
        else:
            uncompressed += full
    return [("allreduce", uncompressed * size), ("allreduce", ps * size), ("allreduce", qs * size)]


def fp16_state(group: dist.ProcessGroup | None, meter: HookByteMeter) -> MeteredHookState:
    return MeteredHookState(group, default_hooks.fp16_compress_hook, price_fp16, meter)


def powersgd_state(
    group: dist.ProcessGroup | None, meter: HookByteMeter, rank: int, start_iter: int, seed: int
) -> MeteredHookState:
    """PowerSGD with rank `rank`, error feedback and warm start on (its docs' advice), the
    default `min_compression_rate`, compression from `start_iter`."""
    inner = psgd.PowerSGDState(
        process_group=group,
        matrix_approximation_rank=rank,
        start_powerSGD_iter=start_iter,
        use_error_feedback=True,
        warm_start=True,
        random_seed=seed,
    )
    gloo = dist.get_backend(group) == dist.Backend.GLOO
    return MeteredHookState(inner, psgd.powerSGD_hook, price_powersgd, meter, serial=gloo)
