"""Uneven inputs under DDP's `Join`: a rank that runs out of batches early shadows the others'
reduces by calling the communication hook on zero buckets, with no forward, backward or
`observe`. The fabric's collectives must stay in step with the ranks still training."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms.join import Join

from tests.distutil import run_ranks
from tests.runtime.models import tiny_ddp

STEPS = 6


def _worker(rank: int, world: int, route: str | None) -> dict:
    wl, model, ddp, state = tiny_ddp(world, STEPS, route)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    with Join([ddp]):
        for step in range(STEPS - 2 * rank):  # the last rank runs out two steps early
            opt.zero_grad()
            loss = wl.loss(ddp, wl.train_batch(step, rank, world, 0))
            if state is not None:
                state.observe(loss)
            loss.backward()
            opt.step()
    events = []
    if state is not None:
        events = list(state.events)
        state.close()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "events": events}


@pytest.mark.parametrize("route", ["fp32", "sign"])
def test_a_rank_that_joins_early_keeps_the_hooks_collectives_in_step(route: str) -> None:
    """No hang and no event; every rank holds the same weights; on fp32 routes they are plain
    DDP's under Join bit for bit (the shadowing rank's zeros are averaged in alike)."""
    hooked = run_ranks(_worker, 2, route)
    for name, p in hooked[0]["params"].items():
        assert torch.equal(p, hooked[1]["params"][name]), name
    assert hooked[0]["events"] == hooked[1]["events"] == []
    if route == "fp32":
        plain = run_ranks(_worker, 2, None)
        for name, p in plain[0]["params"].items():
            assert torch.equal(p, hooked[0]["params"][name]), name
