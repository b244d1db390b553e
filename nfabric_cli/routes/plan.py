"""Collective plans: which collectives a route issues and the exact bytes each one moves.

A route describes its communication as a list of `CommOp`s. The same list drives three
things, so they cannot disagree: `wire_bytes` (a priori traffic), the traffic meter (what the
collectives actually passed) and the capacity cost model (α-β time per op).

Byte accounting is logical and per rank, for a bandwidth-optimal implementation:

| kind         | payload `nbytes` means               | non-root rank sent / received        |
|--------------|--------------------------------------|--------------------------------------|
| `allreduce`  | the whole buffer                     | 2(W-1)/W·n each way (ring)           |
| `all_to_all` | the whole local buffer (W shards)    | (W-1)/W·n each way                   |
| `all_gather` | one rank's contribution              | (W-1)·n each way                     |
| `gather`     | one rank's contribution, to rank 0   | n sent, 0 received                   |
| `broadcast`  | the buffer, from rank 0              | 0 sent, n received                   |

For `gather` and `broadcast` rank 0 (the central reducer endpoint) receives / sends (W-1)·n.
"""

from __future__ import annotations

from dataclasses import dataclass

OP_KINDS: tuple[str, ...] = ("allreduce", "all_to_all", "all_gather", "gather", "broadcast")


@dataclass(frozen=True)
class WireBytes:
    """Bytes one rank sends and receives in one step (or one collective)."""

    sent: int = 0
    received: int = 0

    @property
    def total(self) -> int:
        return self.sent + self.received

    def __add__(self, other: WireBytes) -> WireBytes:
        return WireBytes(self.sent + other.sent, self.received + other.received)

    def __sub__(self, other: WireBytes) -> WireBytes:
        return WireBytes(self.sent - other.sent, self.received - other.received)


@dataclass(frozen=True)
class CommOp:
    """One collective of a route's plan: its kind and payload size in bytes (see module doc)."""

    kind: str
    nbytes: int

    def wire_bytes(self, world_size: int, rank: int = 1) -> WireBytes:
        return op_wire_bytes(self.kind, self.nbytes, world_size, rank)


def op_wire_bytes(kind: str, nbytes: int, world_size: int, rank: int = 1) -> WireBytes:
    """Exact logical bytes rank `rank` sends and receives for one collective of `nbytes`."""
    w = world_size
    if w <= 1 or nbytes == 0:
        return WireBytes()
    if kind == "allreduce":
        b = 2 * (w - 1) * nbytes // w
        return WireBytes(b, b)
    if kind == "all_to_all":
        b = (w - 1) * nbytes // w
        return WireBytes(b, b)
    if kind == "all_gather":
        b = (w - 1) * nbytes
        return WireBytes(b, b)
    if kind == "gather":
        return WireBytes(0, (w - 1) * nbytes) if rank == 0 else WireBytes(nbytes, 0)
    if kind == "broadcast":
        return WireBytes((w - 1) * nbytes, 0) if rank == 0 else WireBytes(0, nbytes)
    raise ValueError(f"unknown collective kind {kind!r}")


def plan_wire_bytes(plan: list[CommOp], world_size: int, rank: int = 1) -> WireBytes:
    total = WireBytes()
    for op in plan:
        total = total + op.wire_bytes(world_size, rank)
    return total
