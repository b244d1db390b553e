"""gloo's ring all-reduce, summed in one process in the collective's own order.

A float sum rounds by its association, so a simulated reduce equals the real one bit for bit
only if it adds the ranks' values in the order the backend does. ProcessGroupGloo's CPU
all-reduce (gloo/allreduce.cc, `ring`) splits a buffer of n elements of e bytes into
N = roundUp(max(ceil(n·e / 1 MiB), 2W), W) segments of L = ceil(n / N) elements; chunk c is
segments [cS, (c+1)S), S = N / W (the last chunks may be short or empty). Chunk c is reduced
while it travels the ring from rank c-1 down to rank c:

    t = x[c-1];  t = x[c-2] + t;  ...;  t = x[c] + t        (ranks mod W)

So an element's order depends only on its offset in the all-reduced buffer and that buffer's
length: W = 2 is rank order everywhere, W = 3 only in chunk 2, W = 4 nowhere. Checked bit for
bit against gloo for float32, bfloat16 and float16 (`tests/routes/test_ring.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: gloo's largest segment (`AllreduceOptionsImpl::kMaxSegmentSize`).
MAX_SEGMENT_BYTES = 1024 * 1024

#: Elements [lo, hi) of a tensor that lie in ring chunk c: (lo, hi, c).
Piece = tuple[int, int, int]


def ring_bounds(numel: int, world_size: int, element_size: int = 4) -> list[tuple[int, int]]:
    """[start, stop) of each ring chunk c = 0..W-1 of a buffer of `numel` elements."""
    if numel <= 0:
        return [(0, 0)] * world_size
    per_segment = max(1, MAX_SEGMENT_BYTES // element_size)
    segments = -(-numel // per_segment)
    segments = -(-max(segments, 2 * world_size) // world_size) * world_size
    span = segments // world_size * -(-numel // segments)
    return [(min(numel, c * span), min(numel, (c + 1) * span)) for c in range(world_size)]


def ring_pieces(
    offset: int, numel: int, buffer_numel: int, world_size: int, element_size: int = 4
) -> tuple[Piece, ...]:
    """Elements [offset, offset + numel) of an all-reduced buffer of `buffer_numel` elements,
    split by ring chunk; positions relative to `offset`."""
    stop = offset + numel
    return tuple(
        (max(lo, offset) - offset, min(hi, stop) - offset, c)
        for c, (lo, hi) in enumerate(ring_bounds(buffer_numel, world_size, element_size))
        if max(lo, offset) < min(hi, stop)
    )


def join_pieces(parts: Sequence[Sequence[Piece]], numels: Sequence[int]) -> tuple[Piece, ...]:
    """The pieces of tensors laid end to end (each `parts[i]` relative to its own start),
    neighbours in the same chunk merged: one slice per run instead of one per tensor."""
    out: list[Piece] = []
    offset = 0
    for pieces, numel in zip(parts, numels, strict=True):
        for lo, hi, c in pieces:
            lo, hi = lo + offset, hi + offset
            if out and out[-1][2] == c and out[-1][1] == lo:
                lo = out.pop()[0]
            out.append((lo, hi, c))
        offset += numel
    return tuple(out)


def ring_sum(parts: Sequence[torch.Tensor], pieces: Sequence[Piece] | None = None) -> torch.Tensor:
    """The sum of the ranks' flat tensors `parts[r]` as gloo's all-reduce leaves it on every
    rank. `pieces`: each element's ring chunk (default: `parts` are the whole buffer)."""
    world = len(parts)
    n = parts[0].numel()
    if pieces is None:
        pieces = ring_pieces(0, n, n, world, parts[0].element_size())
    out = torch.empty_like(parts[0])
    covered = 0
    for lo, hi, c in pieces:
        t = out[lo:hi]
        t.copy_(parts[(c - 1) % world][lo:hi])
        for j in range(2, world + 1):
            t.add_(parts[(c - j) % world][lo:hi])  # x + t: IEEE addition commutes
        covered += hi - lo
    if covered != n:
        raise ValueError(f"ring pieces cover {covered} of {n} elements")
    return out
