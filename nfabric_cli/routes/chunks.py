"""Per-chunk scales that never straddle two parameters.

A flat buffer holds one or more parameters (`segments`: their lengths, in order). Scales are
computed per chunk of `chunk` elements *within* each segment, so aggregating a concatenation
gives exactly the concatenation of per-parameter aggregates: the result does not depend on how
DDP happened to bucket the parameters, which is what lets the single-process simulator and the
real hook agree bit for bit.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nfabric_cli.errors import InputError


@dataclass(frozen=True)
class Block:
    """`nchunks` consecutive chunks of `length` elements starting at `start`."""

    start: int
    nchunks: int
    length: int

    @property
    def stop(self) -> int:
        return self.start + self.nchunks * self.length


@dataclass(frozen=True)
class ChunkLayout:
    numel: int
    blocks: tuple[Block, ...]

    @property
    def nchunks(self) -> int:
        return sum(b.nchunks for b in self.blocks)

    def reduce(self, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Apply `fn` (a row reduction of a [nchunks, length] view) per block; concat results."""
        parts = [fn(x[b.start : b.stop].view(b.nchunks, b.length)) for b in self.blocks]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def expand(self, scales: torch.Tensor) -> torch.Tensor:
        """Per-chunk values -> per-element tensor of length `numel`."""
        if len(self.blocks) == 1:
            return scales.repeat_interleave(self.blocks[0].length)
        counts = torch.tensor([b.length for b in self.blocks for _ in range(b.nchunks)],
                              device=scales.device)
        return scales.repeat_interleave(counts)

    def scale_into(self, x: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out = x * per-chunk scale, block by block without materialising the expansion."""
        i = 0
        for b in self.blocks:
            s = scales[i : i + b.nchunks].unsqueeze(1)
            torch.mul(
                x[b.start : b.stop].view(b.nchunks, b.length),
                s,
                out=out[b.start : b.stop].view(b.nchunks, b.length),
            )
            i += b.nchunks
        return out


def check_segments(numel: int, segments: tuple[int, ...] | None) -> tuple[int, ...]:
    if segments is None:
        return (numel,)
    segs = tuple(int(s) for s in segments)
    if any(s < 0 for s in segs) or sum(segs) != numel:
        raise InputError(f"segments {segs[:4]}... do not add up to the buffer's {numel} elements")
    return segs


@functools.lru_cache(maxsize=4096)
def chunk_layout(segments: tuple[int, ...], chunk: int) -> ChunkLayout:
    """Blocks of full chunks and tails, merging neighbouring blocks of the same chunk length."""
    blocks: list[Block] = []
    start = 0
    for length in segments:
        if length == 0:
            continue
        c = min(chunk, length)
        full, tail = divmod(length, c)
        pieces = [(start, full, c)]
        if tail:
            pieces.append((start + full * c, 1, tail))
        for s, n, ln in pieces:
            prev = blocks[-1] if blocks else None
            if prev is not None and prev.length == ln and prev.stop == s:
                blocks[-1] = Block(prev.start, prev.nchunks + n, ln)
            else:
                blocks.append(Block(s, n, ln))
        start += length
    return ChunkLayout(numel=start, blocks=tuple(blocks))


def silent_per_range(layout: ChunkLayout, scales: torch.Tensor, ends: tuple[int, ...]) -> torch.Tensor:
    """Per range k of elements [ends[k - 1], ends[k]) (ends[-1] = 0), how many lie in chunks
    whose scale is exactly 0 (float64, on the scales' device, no host read). Ranges must not
    split a chunk (a `Tally`'s run parameters whole, and a chunk never spans two)."""
    lengths, where = _chunk_ranges(layout, ends, scales.device)
    silent = (scales == 0).to(torch.float64) * lengths
    out = torch.zeros(len(ends), dtype=torch.float64, device=scales.device)
    return out.index_add_(0, where, silent)


@functools.lru_cache(maxsize=1024)
def _chunk_ranges(layout: ChunkLayout, ends: tuple[int, ...],
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each chunk's length (0 past `ends[-1]`, which no range counts) and the range it lies in,
    kept on `device` (a copy to a GPU per call would synchronise its stream every step)."""
    lengths, where = [], []
    for b in layout.blocks:
        for i in range(b.nchunks):
            k = bisect.bisect_right(ends, b.start + i * b.length)
            lengths.append(b.length if k < len(ends) else 0)
            where.append(min(k, len(ends) - 1))
    return (torch.tensor(lengths, dtype=torch.float64, device=device),
            torch.tensor(where, dtype=torch.int64, device=device))
