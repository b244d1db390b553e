"""Every rank attaches the same fabric: checked once, at attach, in one small all-gather.

The ranks' hooks issue collectives in lockstep: a phase switch, a route, a monitor verdict or
a codec's noise seed that differs between ranks makes one rank's collective meet another's of
another size. gloo then aborts the process (`Received data size doesn't match expected size`,
a C++ terminate), NCCL hangs. Ranks that each take `total_steps` from their own data loader,
or load different profile files, drift apart like that only at the first phase switch, far
into the run. So attach compares what must be equal, and every rank raises the same one line.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from nfabric_cli.binding.bindings import Bindings
from nfabric_cli.errors import InputError


def attach_facts(bindings: Bindings, total_steps: int | None, seed: int,
                 options: Sequence[Any]) -> list[tuple[str, int]]:
    """What every rank must agree on, as (what, a number): routes, thresholds and options as
    a digest (their text is long), total_steps (-1: None) and the seed as themselves."""
    routes = repr([(b.name, sorted(b.routes.items()), sorted(b.regions.items()))
                   for b in bindings.params.values()])
    facts = [
        ("the profile's routes and phases", _digest(repr(bindings.phases) + routes)),
        ("the health thresholds", _digest(repr(sorted((bindings.meta.get("health") or {})
                                                     .items())))),
        ("the options (monitor, gate, nonfinite)", _digest(repr(tuple(options)))),
    ]
    return [*facts, ("total_steps", -1 if total_steps is None else int(total_steps)),
            ("seed", int(seed))]


def check_ranks_agree(group: Any, facts: list[tuple[str, int]],
                      device: torch.device) -> None:
    """All-gather `facts`' numbers over `group` (a collective: every rank calls it) and raise
    the same `InputError` on every rank if any differs."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    mine = torch.tensor([v for _, v in facts], dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    table = torch.stack(rows).cpu().tolist()
    for k, (what, _) in enumerate(facts):
        values = [row[k] for row in table]
        if len(set(values)) > 1:
            first = next(r for r, v in enumerate(values) if v != values[0])
            raise InputError(
                f"ranks attach different fabrics: {what} differ ({_show(what, values[0])} on "
                f"rank 0, {_show(what, values[first])} on rank {first}); every rank "
                "must attach the same profile with the same total_steps, seed and options, "
                "or their collectives stop lining up")


def _digest(text: str) -> int:
    """A 56-bit digest of `text` (fits an int64 tensor)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def _show(what: str, value: int) -> str:
    if what == "total_steps":
        return "None" if value < 0 else str(value)
    if what == "seed":
        return str(value)
    return f"digest {value & 0xFFFFFFFF:08x}"
