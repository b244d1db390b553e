"""`Comm`: the collectives routes use, with a byte meter.

Each call records the logical bytes it moved (see `plan.py`), so the traffic a run reports is
counted from the collectives actually issued, and a test can compare it with `wire_bytes`.
Every call is issued at once, in program order, from one thread at a time (the hook's worker,
or DDP's for a step's last bucket), which keeps the collective order identical on every rank
(see `runtime/hook.py`); the plain calls block until done, the `_async` ones return a
`Pending` to wait on later.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from nfabric_cli.routes.plan import WireBytes, op_wire_bytes


class Pending:
    """A collective in flight: `wait()` completes it and returns its result tensor."""

    __slots__ = ("result", "_works")

    def __init__(self, result: torch.Tensor, works: list) -> None:
        self.result, self._works = result, works

    def wait(self) -> torch.Tensor:
        works, self._works = self._works, []
        for w in works:
            w.wait()
        return self.result


class Comm:
    """Blocking collectives over one process group, metered in logical bytes."""

    __slots__ = ("group", "world_size", "rank", "bytes", "calls", "_p2p_gather", "_peers",
                 "_scratch")

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.bytes = WireBytes()
        self.calls: list[tuple[str, int]] = []
        # gloo's flat all-gather ran at a third of the speed of posted sends (bench.collectives):
        # on gloo every rank posts its sends and receives to each peer instead; NCCL and
        # others keep their native all-gather
        self._p2p_gather = dist.get_backend(group) == "gloo" and self.world_size > 1
        self._peers = [self.global_rank(r) for r in range(self.world_size)]
        self._scratch: dict[object, torch.Tensor] = {}

    def scratch(self, key: object, numel: int, dtype: torch.dtype,
                device: torch.device | str = "cpu") -> torch.Tensor:
        """A 1-D buffer of `numel` elements kept under `key`: the front of the kept one while
        it is large enough, else a new one kept instead. A fresh tensor of tens of MB costs
        its page faults on every step (measured in bench.collectives: 5-8 ms per 19 MB), a
        kept one nothing, also when a key's size changes back and forth (a bucket whose
        route changes with the phase). The caller owns `key`: a buffer may be reused as soon
        as the same key is asked for again."""
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != torch.device(device):
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._scratch[key] = buf
        return buf[:numel]

    def release(self) -> None:
        """Free the kept buffers (`scratch`): a closed state issues nothing more."""
        self._scratch.clear()

    def _meter(self, kind: str, nbytes: int) -> None:
        self.calls.append((kind, nbytes))
        self.bytes = self.bytes + op_wire_bytes(kind, nbytes, self.world_size, self.rank)

    def take(self) -> WireBytes:
        """Bytes since the last call to `take` (and forget them)."""
        out, self.bytes = self.bytes, WireBytes()
        self.calls.clear()
        return out

    def allreduce(self, t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        return self.allreduce_async(t, op).wait()

    def all_to_all(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Equal-split all-to-all of a 1-D byte buffer whose length is a multiple of W (into
        `out` when given)."""
        return self.all_to_all_async(t, out).wait()

    def all_gather(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every rank's `t`, concatenated in rank order, received straight into one tensor
        (`out` when given)."""
        return self.all_gather_async(t, out).wait()

    # Issued now, completed by `Pending.wait()`: the hook encodes the next bucket while one is
    # on the wire. Collectives are still issued in program order, so every rank issues the
    # same ones in the same order (`runtime/bucket.py`).
    def allreduce_async(self, t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> Pending:
        self._meter("allreduce", t.numel() * t.element_size())
        return Pending(t, [dist.all_reduce(t, op=op, group=self.group, async_op=True)])

    def all_to_all_async(self, t: torch.Tensor, out: torch.Tensor | None = None) -> Pending:
        out = torch.empty_like(t) if out is None else out
        self._meter("all_to_all", t.numel() * t.element_size())
        return Pending(out, [dist.all_to_all_single(out, t, group=self.group, async_op=True)])

    def gather_buffers(self, key: object, numel: int, dtype: torch.dtype,
                       device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Kept buffers for `all_gather_async(mine, out=out)`: (mine, out), `numel` elements per
        rank. Where this rank's part is sent by posted sends (gloo), `mine` is its own row of
        `out`, so what the caller writes there needs no copy into place (9.4 MB: 1.3 ms)."""
        out = self.scratch((key, "out"), self.world_size * numel, dtype, device)
        if self._posts(out):
            return out.view(self.world_size, numel)[self.rank], out
        return self.scratch((key, "mine"), numel, dtype, device), out

    def all_gather_async(self, t: torch.Tensor, out: torch.Tensor | None = None) -> Pending:
        if out is None:
            out = torch.empty((self.world_size * t.numel(),), dtype=t.dtype, device=t.device)
        self._meter("all_gather", t.numel() * t.element_size())
        mine = t.reshape(-1)
        if not self._posts(mine):
            return Pending(out, [_all_gather_single(out, mine, group=self.group, async_op=True)])
        # as W - 1 sends and receives posted at once (the same bytes as a ring)
        parts = out.view(self.world_size, mine.numel())
        works = []
        for r in range(self.world_size):
            if r != self.rank:
                works.append(dist.isend(mine, self._peers[r], group=self.group))
                works.append(dist.irecv(parts[r], self._peers[r], group=self.group))
        if parts[self.rank].data_ptr() != mine.data_ptr():  # (not `gather_buffers`' own row)
            parts[self.rank].copy_(mine)
        return Pending(out, works)

    def _posts(self, t: torch.Tensor) -> bool:
        """Whether an all-gather of `t` goes as posted sends: on gloo, of host memory (gloo's
        point-to-point reads host memory only)."""
        return self._p2p_gather and t.device.type == "cpu"

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Gather to group rank 0 (the central reducer); other ranks get None."""
        self._meter("gather", t.numel() * t.element_size())
        dst = self.global_rank(0)
        if self.rank == 0:
            outs = [torch.empty_like(t) for _ in range(self.world_size)]
            dist.gather(t, gather_list=outs, dst=dst, group=self.group)
            return outs
        dist.gather(t, gather_list=None, dst=dst, group=self.group)
        return None

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Broadcast from group rank 0 into `t` (same shape on every rank)."""
        self._meter("broadcast", t.numel() * t.element_size())
        dist.broadcast(t, src=self.global_rank(0), group=self.group)
        return t

    def global_rank(self, group_rank: int) -> int:
        """The global rank of rank `group_rank` of this group (collectives take global ranks)."""
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)


#: torch >= 2.13 names the flat all-gather `all_gather_single`; older ones
#: `all_gather_into_tensor` (deprecated since).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def sum_in_rank_order(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum tensors in rank order: the same float result in the simulator and on every rank."""
    total = parts[0].clone()
    for p in parts[1:]:
        total += p
    return total
