"""`state.observe(loss)` belongs between the forward and the backward: observed after the
backward, each loss reaches the health monitor one step late (a spike is judged, and its update
held, on the step after it). The hook notices and says so once; in order, it says nothing."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.distutil import run_ranks
from tests.runtime.models import tiny_ddp

STEPS = 4


def _worker(rank: int, world: int, late: bool) -> list[str]:
    wl, _, ddp, state = tiny_ddp(world, STEPS)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            loss = wl.loss(ddp, wl.train_batch(step, rank, world, 0))
            opt.zero_grad()
            if not late:
                state.observe(loss)
            loss.backward()
            if late:
                state.observe(loss)
            opt.step()
    state.close()
    return [str(w.message) for w in caught if "observe()" in str(w.message)]


@pytest.mark.parametrize("late", [False, True])
def test_a_loss_observed_after_backward_is_named_once(late: bool) -> None:
    rank0, rank1 = run_ranks(_worker, 2, late)
    assert rank1 == []  # rank 0 speaks for the run
    if late:
        assert len(rank0) == 1
        assert "the health monitor judges each loss one step late" in rank0[0]
        assert "between the forward and loss.backward()" in rank0[0]
    else:
        assert rank0 == []
