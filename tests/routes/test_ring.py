"""`ring_sum` equals gloo's all-reduce bit for bit, on inputs where every order rounds apart.
(DDP's scaling before it, `ddp_mean_`: `tests/calibration/test_replay_ddp.py` at three ranks.)"""

from __future__ import annotations

from functools import cache

import pytest
import torch
import torch.distributed as dist

from nfabric_cli.routes.ring import (
    MAX_SEGMENT_BYTES,
    join_pieces,
    ring_bounds,
    ring_pieces,
    ring_sum,
)
from tests.distutil import run_ranks

SEG = MAX_SEGMENT_BYTES // 4  # float32 elements per full segment


def _orders(cols: list[torch.Tensor]) -> list[torch.Tensor]:
    """Rank order and the W ring-chunk orders of the element tuples `cols[r]`."""
    w = len(cols)
    out = [ring_sum(cols, [(0, len(cols[0]), c)]) for c in range(w)]
    rank = cols[0].clone()
    for col in cols[1:]:
        rank += col
    return [rank, *out]


@cache
def _pool(world: int, dtype: torch.dtype) -> torch.Tensor:
    """(M, W) tuples whose W ring orders (and rank order, unless it is one of them) all round
    apart: an element summed in any other chunk's order than gloo's shows as a difference."""
    g = torch.Generator().manual_seed(world)
    x = torch.randn(100_000, world, generator=g) * torch.exp2(
        torch.randint(-12, 13, (100_000, world), generator=g).float())
    x = x.to(dtype)
    cands = _orders([x[:, r].contiguous() for r in range(world)])
    if world == 3:  # chunk 2's order is rank order
        cands = cands[1:]
    keep = torch.ones(len(x), dtype=torch.bool)
    for i in range(len(cands)):
        for j in range(i + 1, len(cands)):
            keep &= cands[i] != cands[j]
    return x[keep][:1021].contiguous()  # a prime count: the tiling never aligns with a chunk


def _inputs(n: int, world: int, dtype: torch.dtype) -> list[torch.Tensor]:
    pool = _pool(world, dtype)
    idx = (torch.arange(n) + 7 * n) % len(pool)
    return [pool[idx, r].contiguous() for r in range(world)]


def _lengths(world: int) -> dict[torch.dtype, list[int]]:
    """Around every chunk boundary of a 2W-segment layout (short buffers leave the last chunks
    empty), and one segment past 2W full ones, where the count steps up to 3W segments."""
    small = [1, 2, 3, 2 * world - 1, 2 * world, 2 * world + 1, 1001]
    return {torch.float32: [*small, 2 * world * SEG + 1], torch.bfloat16: small}


def _differ(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements whose bits differ (-0.0 and 0.0 too)."""
    bits = torch.int16 if a.element_size() == 2 else torch.int32
    return int((a.view(bits) != b.view(bits)).sum())


def _reduce_all(rank: int, size: int) -> dict[int, list[tuple[str, int, int, int]]]:
    """For W = 3 (ranks 0-2) and 4, per buffer: (dtype, n, elements != ring_sum, elements !=
    rank order) on rank 0."""
    out: dict[int, list[tuple[str, int, int, int]]] = {}
    for world in (3, 4):
        group = dist.new_group(list(range(world)))  # every rank takes part in creating it
        if rank >= world:
            continue
        rows = out.setdefault(world, [])
        for dtype, lengths in _lengths(world).items():
            for n in lengths:
                parts = _inputs(n, world, dtype)
                buf = parts[rank].clone()
                dist.all_reduce(buf, group=group)
                if rank == 0:
                    rows.append((str(dtype), n, _differ(buf, ring_sum(parts)),
                                 _differ(buf, _orders(parts)[0])))
    return out


def test_ring_sum_is_gloo_allreduce_bit_for_bit() -> None:
    by_world = run_ranks(_reduce_all, 4)[0]
    for world, rows in by_world.items():
        assert [r for r in rows if r[2]] == [], world
        # the inputs discriminate: rank order misses wherever gloo's order is another chunk's
        assert all(r[3] > 0 for r in rows), world
    assert {w: len(rows) for w, rows in by_world.items()} == {3: 15, 4: 15}


def test_ring_bounds_follow_gloos_segments() -> None:
    # 10 elements, W = 4: 8 segments of 2, 2 per chunk: chunks of 4, 4, 2, 0 elements
    assert ring_bounds(10, 4) == [(0, 4), (4, 8), (8, 10), (10, 10)]
    # 2W full segments: one segment more rounds up to 3W segments, 12 at W = 4
    assert ring_bounds(8 * SEG, 4) == [(0, 2 * SEG), (2 * SEG, 4 * SEG), (4 * SEG, 6 * SEG),
                                       (6 * SEG, 8 * SEG)]
    # ... of ceil((8 SEG + 1) / 12) = 174763 elements, 3 per chunk
    assert ring_bounds(8 * SEG + 1, 4)[1] == (524289, 1048578)
    # 16-bit elements: twice as many per segment, so still 8 segments (of 262145)
    assert ring_bounds(8 * SEG + 1, 4, element_size=2)[0] == (0, 524290)


def test_pieces_split_a_tensor_by_chunk_and_join_end_to_end() -> None:
    # elements 3..9 of a 10-element buffer at W = 4 (chunks [0,4), [4,8), [8,10))
    assert ring_pieces(3, 7, 10, 4) == ((0, 1, 0), (1, 5, 1), (5, 7, 2))
    a, b = ring_pieces(0, 6, 10, 4), ring_pieces(6, 4, 10, 4)
    assert join_pieces([a, b], [6, 4]) == ring_pieces(0, 10, 10, 4)
    with pytest.raises(ValueError, match="cover 4 of 10"):
        ring_sum([torch.ones(10)] * 4, [(0, 4, 0)])
