"""`state.observe(loss)` belongs between the forward and the backward: observed after the
backward, each loss reaches the health monitor one step late (a spike is judged, and its update
held, on the step after it). The hook notices and says so once; in order, it says nothing."""

from __future__ import annotations

import warnings

import pytest
import torch

from nfabric_cli.errors import InputError
from tests.distutil import run_ranks
from tests.runtime.models import tiny_ddp

STEPS = 4


DERIVED = {"as is": lambda t: t, "float": lambda t: t.float(),
           "reshape": lambda t: t.reshape(1), "scaled": lambda t: 2 * t}


def _worker(rank: int, world: int, late: bool) -> dict[str, list[str]]:
    """Per way of deriving the observed loss, a run of its own: what it warned."""
    said = {}
    for derive, derived in DERIVED.items():
        wl, _, ddp, state = tiny_ddp(world, STEPS)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(STEPS):
                loss = wl.loss(ddp, wl.train_batch(step, rank, world, 0))
                opt.zero_grad()
                if not late:
                    state.observe(derived(loss))
                loss.backward()
                if late:
                    state.observe(derived(loss))
                opt.step()
        state.close()
        said[derive] = [str(w.message) for w in caught if "observe()" in str(w.message)]
    return said


@pytest.mark.parametrize("late", [False, True])
def test_a_loss_observed_after_backward_is_named_once(late: bool) -> None:
    """Also for a tensor derived from the loss before observe (`reshape`, `scaled`; `float`
    of a float32 loss is the loss itself): the backward of the loss passes the derivation's
    input, so it counts as seen."""
    rank0, rank1 = run_ranks(_worker, 2, late)
    assert rank1 == {derive: [] for derive in DERIVED}  # rank 0 speaks for the run
    for derive, said in rank0.items():
        if late:
            assert len(said) == 1, derive
            assert "the health monitor judges each loss one step late" in said[0]
            assert "between the forward and loss.backward()" in said[0]
        else:
            assert said == [], derive


def _one_weight(rank: int, world: int, late: bool) -> tuple[list[str], int]:
    """A loss behind a single trainable tensor (a bias-free probe, prompt tuning): its graph
    ends in the weight's gradient accumulator, which outlives the step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from nfabric_cli import attach
    from nfabric_cli.binding import compile_profile, static_profile

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1, bias=False)
    ddp = DDP(model)
    state = attach(ddp, compile_profile(static_profile(model, "sign"), model, world_size=world,
                                        total_steps=STEPS), total_steps=STEPS)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    fired = [0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            loss = ddp(x).pow(2).mean()
            opt.zero_grad()
            if not late:
                state.observe(loss)
            loss.grad_fn.register_prehook(lambda g: fired.__setitem__(0, fired[0] + 1))
            loss.backward()
            if late:
                state.observe(loss)
            opt.step()
    state.close()
    return [str(w.message) for w in caught if "observe()" in str(w.message)], fired[0]


@pytest.mark.parametrize("late", [False, True])
def test_a_late_observe_is_named_when_one_weight_stands_behind_the_loss(late: bool) -> None:
    """The hook that tells whether backward ran through the loss sat on the weight's
    accumulator: a late observe's fired in the next step's backward (no warning), and every
    step added one more (each backward ran them all)."""
    (said, fired), _ = run_ranks(_one_weight, 2, late)
    assert len(said) == (1 if late else 0), said
    assert fired == STEPS  # (the test's own hook: one per step, each run once)


def _bad(rank: int, world: int) -> list[str]:
    wl, _, ddp, state = tiny_ddp(world, STEPS)
    said = []
    for bad in (torch.ones(3), torch.ones(0), "1.5", None, True):
        try:
            state.observe(bad)
        except InputError as exc:
            said.append(str(exc))
    state.close()
    return said


def test_observe_refuses_what_is_not_one_loss() -> None:
    said, _ = run_ranks(_bad, 2)
    assert said == [
        "observe() takes the step's loss as one number, got a tensor of shape (3,): reduce it "
        "first (loss.mean())",
        "observe() takes the step's loss as one number, got a tensor of shape (0,): reduce it "
        "first (loss.mean())",
        "observe() takes the step's loss (a tensor or a number), got str",
        "observe() takes the step's loss (a tensor or a number), got NoneType",
        "observe() takes the step's loss (a tensor or a number), got bool",
    ]
