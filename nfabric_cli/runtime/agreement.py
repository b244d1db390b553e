"""Every rank attaches the same fabric: checked once, at attach, in one small all-gather.

The ranks' hooks issue collectives in lockstep: a phase switch, a route, a bucket verdict or a
monitor threshold that differs between ranks makes one rank's collective meet another's of
another size. gloo then aborts the process (`Received data size doesn't match expected size`,
a C++ terminate), NCCL hangs. Ranks that each take `total_steps` from their own data loader,
or load different profile files, drift apart like that only at the first phase switch, far
into the run. So attach compares what must be equal, and every rank raises one line. A rank
whose own attach failed says so in the same all-gather, so the others raise too instead of
waiting for it in the next collective. (The seed need not agree: the codecs' noise is drawn
per rank anyway, `routes/base.py`, `codec_noise`.)
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from nfabric_cli.binding.bindings import Bindings
from nfabric_cli.errors import InputError
from nfabric_cli.profile.thresholds import HealthThresholds

#: What every rank must agree on, in the order `attach_facts` gives it.
FACTS = ("the profile's routes, phases and bucket verdicts", "the health thresholds",
         "the options (monitor, gate, nonfinite, dedicated_group)", "total_steps",
         "the closed states' process group taken again")
#: What to do about a fact that differs, where it is not the profile, options or total_steps.
_HINTS = {FACTS[4]: "every rank must have closed the same nfabric states before attaching "
                    "again (runtime/groups.py)"}


def attach_facts(bindings: Bindings, total_steps: int | None, options: Sequence[Any],
                 reused_group: str = "") -> list[int]:
    """`FACTS` as numbers: a digest where the text is long, total_steps itself (-1: None);
    `reused_group`: the name of the closed state's group this attach takes ('' for a new
    one, `runtime/groups.py`)."""
    routes = repr([(b.name, sorted(b.routes.items()), sorted(b.regions.items()))
                   for b in bindings.params.values()])
    health = HealthThresholds.from_profile(bindings.meta).to_dict()  # as the monitor takes them
    return [_digest(repr(bindings.phases) + routes + repr(bindings.buckets)),
            _digest(repr(sorted(health.items()))), _digest(repr(tuple(options))),
            -1 if total_steps is None else int(total_steps), _digest(reused_group)]


def check_ranks_agree(group: Any, facts: list[int] | None, device: torch.device) -> None:
    """All-gather this rank's `facts` (None: its own attach failed, which it raises itself)
    over `group`, a collective every rank of it calls, and raise the same `InputError` on
    every rank whose attach had not failed if any rank failed or any fact differs."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    mine = torch.tensor([0] * (1 + len(FACTS)) if facts is None else [1, *facts],
                        dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    table = torch.stack(rows).cpu().tolist()
    if facts is None:
        return
    failed = [r for r, row in enumerate(table) if row[0] == 0]
    if failed:
        raise InputError(f"rank {failed[0]} could not attach (its own error says why), so no "
                         "rank attaches")
    for k, what in enumerate(FACTS, start=1):
        values = [row[k] for row in table]
        if len(set(values)) > 1:
            other = next(r for r, v in enumerate(values) if v != values[0])
            raise InputError(
                f"ranks attach different fabrics: {what} differ ({_show(what, values[0])} on "
                f"rank 0, {_show(what, values[other])} on rank {other}); "
                + _HINTS.get(what, "every rank must attach the same profile with the same "
                                   "total_steps and options")
                + ", or their collectives stop lining up")


def _digest(text: str) -> int:
    """A 56-bit digest of `text` (fits an int64 tensor)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def _show(what: str, value: int) -> str:
    if what == "total_steps":
        return "None" if value < 0 else str(value)
    return f"digest {value & 0xFFFFFFFF:08x}"
