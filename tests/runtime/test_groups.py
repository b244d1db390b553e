"""The hook's own process group: a closed state's is taken by the next attach on the same DDP
group, so attaching again and again does not grow a rank's threads and sockets; open states
never share one; a destroyed world's groups are forgotten."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from nfabric_cli import attach
from nfabric_cli.binding import static_profile
from nfabric_cli.errors import InputError
from nfabric_cli.runtime import groups
from tests.distutil import run_ranks
from tests.runtime.models import make_model, train_steps


def _threads_and_fds() -> tuple[int, int]:
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def _again_and_again(rank: int, world: int) -> dict:
    model = make_model()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    groups, counts = [], []
    for run in range(6):  # a fresh DDP every other run: the group is DDP's group's copy
        if run % 2:
            model = make_model()
            ddp, opt = DDP(model), torch.optim.SGD(model.parameters(), lr=0.1)
        state = attach(ddp, static_profile(model, "sign"), total_steps=2)
        train_steps(ddp, opt, state, rank, 2 * run, 2 * run + 2)
        state.close()
        groups.append(state.comm.group)
        counts.append(_threads_and_fds())
    models = [make_model(), make_model()]
    ddps = [DDP(m) for m in models]
    both = [attach(d, static_profile(m, "sign"), total_steps=2) for d, m in zip(ddps, models, strict=True)]
    names = [s.comm.group.group_name for s in both]  # open together: a group each
    saved = sorted(state.state_dict()["ranks"])  # a closed state's gather, over a lent group
    for d, m, s in zip(ddps, models, both, strict=True):
        train_steps(d, torch.optim.SGD(m.parameters(), lr=0.1), s, rank, 0, 2)
    for s in (both if rank == 0 else both[::-1]):  # closed in another order on each rank
        s.close()
    again = attach(ddps[0], static_profile(models[0], "sign"), total_steps=2)
    again.close()
    return {"same": all(g is groups[0] for g in groups), "counts": counts,
            "together": [names[0] != names[1], groups[0].group_name in names],
            "dict": saved, "steps": [s.step for s in both],
            "again": again.comm.group.group_name == min(names)}


def test_attach_after_close_takes_the_closed_states_group() -> None:
    """Each attach made a group before: +3 threads and +5 file descriptors a rank per attach at
    two ranks (a sweep, or the HF Trainer's train() called again, in one process)."""
    for r in run_ranks(_again_and_again, 2):
        assert r["same"]
        assert r["counts"][-1] == r["counts"][0], r["counts"]
        assert r["together"] == [True, True]
        assert r["dict"] == [0, 1]  # both ranks' parts
        assert r["steps"] == [2, 2] and r["again"]


def _out_of_order(rank: int, world: int) -> str:
    models = [make_model() for _ in range(3)]
    states = [attach(DDP(m), static_profile(m, "sign"), total_steps=2) for m in models[:2]]
    states[rank].close()  # rank 0 frees the first state's group, rank 1 the second's
    try:
        attach(DDP(models[2]), static_profile(models[2], "sign"), total_steps=2)
    except InputError as exc:
        return str(exc)
    return "attached"


def test_ranks_that_would_take_different_groups_are_refused() -> None:
    results = run_ranks(_out_of_order, 2)
    assert results[0] == results[1]
    assert results[0].startswith("ranks attach different fabrics: the closed states' process "
                                 "group taken again differ (digest ")
    assert results[0].endswith("every rank must have closed the same nfabric states before "
                               "attaching again (runtime/groups.py), or their collectives "
                               "stop lining up")


def _new_world(rank: int, world: int, folder: str) -> list:
    model = make_model()
    state = attach(DDP(model), static_profile(model, "sign"), total_steps=2)
    state.close()  # its group is free, then destroyed with its world
    dist.destroy_process_group()
    store = dist.FileStore(os.path.join(folder, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    ddp = DDP(model)
    again = attach(ddp, static_profile(model, "sign"), total_steps=2)
    train_steps(ddp, torch.optim.SGD(model.parameters(), lr=0.1), again, rank, 0, 2)
    again.close()
    # what is kept for the next attach: the new world's group alone (the old one's threads
    # and sockets are not held alive by this module)
    kept = [(parent is dist.group.WORLD, len(free)) for parent, free in groups._FREE.items()]
    return [again.comm.group is not state.comm.group, again.step, kept]


def test_a_destroyed_worlds_group_is_forgotten(tmp_path) -> None:
    assert run_ranks(_new_world, 2, str(tmp_path), timeout=120) == [[True, 2, [(True, 1)]]] * 2
