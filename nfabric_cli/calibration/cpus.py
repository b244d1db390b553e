"""How many processes a simulation may use, and with how many threads each.

The simulated ranks run one intra-op thread each, as every real rank does; the parent uses
one process per usable CPU, at most one per simulated rank. Optimizers in `PER_PARAMETER` may
step disjoint parameter shards side by side (forked children) with the whole step's result.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_processes(world_size: int) -> int:
    """One process per usable CPU, at most one per simulated rank."""
    return max(1, min(world_size, usable_cpus()))


#: Optimizers whose step updates each parameter from its own gradient and state alone (for
#: a parameter without a gradient it does nothing), so stepping disjoint shards of the
#: parameters gives the whole step's result. Exact types: a subclass may couple parameters.
PER_PARAMETER: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
    torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad,
    torch.optim.Adadelta, torch.optim.Rprop, torch.optim.ASGD,
)


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch with one intra-op thread (as every real rank and forked child does). Already
    on one thread (a whole simulated run sits inside one of these), it changes nothing: no
    thread-pool resize per step."""
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
