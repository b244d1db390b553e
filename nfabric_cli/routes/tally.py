"""Where one reduce's vote agreement goes, per health scope.

The sign vote's agreement |2c - W| per element is a health signal per scope (the profile's
regions). One reduce may span several scopes: parameters of different regions on the same
route, consecutive in a DDP bucket, go out as one exchange piece (`routes/groups.py`), so as
not to pay per-piece costs once per region. A `Tally` splits the reduce's elements into
ranges, one per scope in the order they lie, and adds each range's margins to its scope's
step statistics: the same sums as one reduce per scope (margins are integers, so exact in
any grouping). The native kernels sum per range in the same pass (`kernels._Margins`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

Stats = dict  # a scope's step statistics: "agree_sum", "agree_n" (and `exchange.WHOLE`)


@dataclass(frozen=True)
class Tally:
    """Element range k, [ends[k - 1], ends[k]) (ends non-decreasing, from 0), adds its vote
    margins to `into[k]`; elements at or past `ends[-1]` are not counted."""

    ends: tuple[int, ...]
    into: tuple[Stats, ...]

    @staticmethod
    def of(stats: Stats | Tally | None, n: int) -> Tally | None:
        """A tally as given, or one scope's dict over the first `n` elements."""
        if stats is None or isinstance(stats, Tally):
            return stats
        return Tally((n,), (stats,))

    @staticmethod
    def over(regions: Sequence[str], segments: Sequence[int],
             sink: Callable[[str], Stats]) -> Tally:
        """Consecutive segments (a reduce's parameters), each adding to its region's dict
        `sink(region)`; neighbours of one region make one range (worked out once per layout:
        this runs per reduce per step)."""
        ends, names = _runs(tuple(regions), tuple(segments))
        return Tally(ends, tuple(sink(r) for r in names))

    def window(self, start: int, n: int) -> Tally:
        """The ranges seen from elements [start, start + n) (a rank's shard of the reduce)."""
        return Tally(tuple(min(max(e - start, 0), n) for e in self.ends), self.into)

    def sub(self, key: str) -> Tally:
        """The same ranges adding to each scope's sub-dict `key` (created where missing)."""
        return Tally(self.ends, tuple(d.setdefault(key, {}) for d in self.into))

    def add(self, margins: Sequence[int | float | torch.Tensor], w: int) -> None:
        """Add each range's margin sum (the kernels' ints, or tensors the torch path leaves
        unread) and its element count times W, in float64."""
        for start, end, m, d in zip((0, *self.ends), self.ends, margins, self.into, strict=False):
            value = m.double() if isinstance(m, torch.Tensor) else float(m)
            d["agree_sum"] = d.get("agree_sum", 0.0) + value
            d["agree_n"] = d.get("agree_n", 0.0) + float((end - start) * w)

    def remove(self, counts: torch.Tensor, margin: int, w: int) -> None:
        """Take `counts[k]` elements of range k out of its scope's sums, each with vote margin
        `margin` (elements no rank has a gradient for: `CodeRoute.exclude_silent`)."""
        margins = counts * margin if margin else None  # (the split vote at an even W: 0)
        elements = counts * w
        for k, d in enumerate(self.into):
            if margins is not None:
                d["agree_sum"] = d.get("agree_sum", 0.0) - margins[k]
            d["agree_n"] = d.get("agree_n", 0.0) - elements[k]

    def split(self, agree: torch.Tensor, w: int) -> list[torch.Tensor]:
        """Per range, the sum of |2c - W| from the torch path's per-element agreement."""
        return [torch.round(agree[start:end].double() * w).sum()
                for start, end in zip((0, *self.ends), self.ends, strict=False)]


@functools.lru_cache(maxsize=1024)
def _runs(regions: tuple[str, ...], segments: tuple[int, ...]) -> tuple[tuple[int, ...],
                                                                       tuple[str, ...]]:
    """Where each run of one region ends, and its region, along consecutive segments."""
    ends: list[int] = []
    names: list[str] = []
    end = 0
    for region, n in zip(regions, segments, strict=True):
        end += n
        if names and names[-1] == region:
            ends[-1] = end
        else:
            ends.append(end)
            names.append(region)
    return tuple(ends), tuple(names)


#: What a route's `stats` argument takes: one scope's dict (the whole reduce adds to it), or
#: a `Tally` of several.
Sink = Stats | Tally
