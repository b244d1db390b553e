"""The hook's own process groups: one per open fabric state, lent again once it closes.

`attach` sends the hook's collectives on a copy of DDP's process group (`dedicated_group`),
so that they never interleave with DDP's own or the training loop's on one group. torch keeps
every group it makes until the process group is destroyed, and nothing frees one sooner: on
gloo each holds its threads and a socket per peer. Made anew at every attach, a process that
attaches again and again (a sweep in one process, the HF Trainer's `train()` called twice, a
re-attach per phase) grew each of two ranks by 3 threads and 5 file descriptors an attach.
So a closed state's group goes back here, and the next attach on the same DDP group takes it
instead of making one: of several, the first by name (a group's name is the same on every rank
that made it, whatever order each closed its states in). `attach` checks that every rank takes
the same one (`agreement.py`), so their collectives still line up. Only a state closed clean
gives its group back (`FabricState.close`: no failed reduce, not mid-step), since a failed
one's may hold a collective some rank never matched. The groups of a process group since
destroyed (`destroy_process_group`, then a new one) are dropped at the next attach,
not lent.
"""

from __future__ import annotations

import threading
from typing import Any

import torch.distributed as dist

_LOCK = threading.Lock()
_FREE: dict[Any, list[Any]] = {}  # DDP's group -> copies no open state uses
_LENT: dict[Any, Any] = {}        # a copy an open state uses -> DDP's group it copies


def _alive(group: Any) -> bool:
    """Whether `group` is still one of this process's process groups."""
    if not dist.is_initialized():
        return False
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):  # destroyed (torch 2.13: KeyError)
        return False
    return True


def reusable(parent: Any) -> Any | None:
    """The free copy of `parent` the next attach on it would take (None: it makes one);
    copies of destroyed groups are dropped first."""
    with _LOCK:
        for key in list(_FREE):
            kept = [g for g in _FREE[key] if _alive(key) and _alive(g)]
            if kept:
                _FREE[key] = kept
            else:
                del _FREE[key]
        for group in [g for g in _LENT if not _alive(g)]:
            del _LENT[group]
        free = _FREE.get(parent)
        # by name, not in the order this rank closed them: ranks that closed the same states
        # in another order (a set of states, iterated in id order) take the same one
        return min(free, key=name) if free else None


def lend(parent: Any, reuse: Any | None) -> Any:
    """A copy of `parent` for a new state: `reuse` (what `reusable` said, agreed by every
    rank) or a new group, made collectively on `parent`'s ranks."""
    if reuse is not None:
        with _LOCK:
            _FREE[parent].remove(reuse)
            _LENT[reuse] = parent
        return reuse
    ranks = None if parent is None or parent == dist.group.WORLD else dist.get_process_group_ranks(parent)
    # A subgroup's members alone create its copy (named from its ranks): DDP groups that
    # split the world (replicas beside pipeline stages) each attach on their own ranks, and
    # a world-wide `new_group` that only some ranks enter hangs their rendezvous.
    group = dist.new_group(ranks=ranks, backend=dist.get_backend(parent),
                           use_local_synchronization=ranks is not None)
    with _LOCK:
        _LENT[group] = parent
    return group


def give_back(group: Any) -> None:
    """A closed state's group, free for the next attach on its DDP group (a group `lend` did
    not make, DDP's own under `dedicated_group=False`, is left alone)."""
    with _LOCK:
        parent = _LENT.pop(group, None)
        if parent is not None:
            _FREE.setdefault(parent, []).append(group)


def name(group: Any | None) -> str:
    """`group`'s name, the same on every rank that made it in the same order ('' for None)."""
    return "" if group is None else str(group.group_name)
