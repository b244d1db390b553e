"""Gradient accumulation without `ddp.no_sync()`: every micro-batch is a reduction, and a
fabric step; the run is told once, from the optimizer steps that do not follow them."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from torch.optim.optimizer import _global_optimizer_post_hooks

import nfabric_cli
from nfabric_cli.runtime.accumulation import RUNS, StepWitness
from tests.distutil import run_ranks
from tests.runtime.models import tiny_ddp


def _reductions(witness: StepWitness, opt: torch.optim.Optimizer,
                stepped) -> list[tuple[int, list[int]]]:
    """128 reductions, an optimizer step after each where `stepped(i)`: where the witness
    spoke, and what it found."""
    said = []
    for i in range(128):
        found = witness.reduction()
        if found is not None:
            said.append((i, found))
        if stepped(i):
            opt.step()
    return said


def _every(k: int):  # noqa: ANN202
    return lambda i: (i + 1) % k == 0


@pytest.mark.parametrize(("stepped", "said"), [
    (_every(1), []),  # one reduction per optimizer step: never
    # k micro-batches a step: found at the reduction after the fourth step, whatever k
    (_every(2), [(8, [2] * RUNS)]),
    (_every(4), [(16, [4] * RUNS)]),
    (_every(14), [(56, [14] * RUNS)]),
    (_every(15), [(60, [15] * RUNS)]),
    (_every(30), [(120, [30] * RUNS)]),
    (lambda i: i % 5 in (1, 4), [(10, [2, 3, 2, 3])]),  # 2 and 3 in turn
    # three steps in a row after two, then one after one: the count starts again
    (lambda i: i % 7 in (1, 3, 5, 6), []),
    # a rank that joined early (Join, uneven inputs) reduces zeros without stepping: one long
    # run, then (the next epoch) one reduction a step again
    (lambda i: i < 12 or i >= 12 + 64, []),
    # a GradScaler's skips at the start (no optimizer.step()), and one now and then later
    (lambda i: i >= 5 and i % 9 != 0, []),
], ids=["1", "2", "4", "14", "15", "30", "2-3", "3-then-1", "joined", "scaler-skips"])
def test_optimizer_steps_after_several_reductions_each_are_found_once(stepped, said):
    w = torch.nn.Parameter(torch.zeros(3))
    witness = StepWitness([w])
    opt = torch.optim.SGD([w], lr=0.1)
    assert _reductions(witness, opt, stepped) == said
    witness.close()


class _Unhashable(torch.optim.SGD):
    def __eq__(self, other: object) -> bool:  # (and so no __hash__: not a weak key)
        return self is other


def test_two_optimizers_over_the_model_end_one_run() -> None:
    """Two optimizers over the model (Muon beside AdamW, say) step together: two steps
    between two reductions end one run, and a step per reduction is never named."""
    w, v = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    for k, said in ((1, []), (2, [(8, [2] * RUNS)])):
        witness = StepWitness([w, v])
        a, b = torch.optim.SGD([w], lr=0.1), torch.optim.Adam([v])
        found = []
        for i in range(32):
            if (r := witness.reduction()) is not None:
                found.append((i, r))
            if (i + 1) % k == 0:
                a.step()
                b.step()
        # (two per boundary; judged at 8: the hook is gone, nothing counted after)
        assert found == said and witness.steps == (2 * 32 if not said else 2 * RUNS)
        witness.close()


def test_the_global_hook_never_fails_an_optimizers_step():
    w = torch.nn.Parameter(torch.ones(3))
    witness = StepWitness([w])
    opt = _Unhashable([w], lr=0.5)
    w.grad = torch.ones(3)
    opt.step()  # stepped; not counted (not seen), rather than a TypeError after the update
    assert torch.equal(w.detach(), torch.full((3,), 0.5)) and witness.steps == 0
    witness.close()


def test_only_steps_of_the_models_own_optimizers_count_and_a_closed_witness_counts_none():
    w, other = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    witness = StepWitness([w])
    # another model's optimizer steps after every reduction: none of them is this model's,
    # so nothing is judged (no step of its own seen yet)
    assert _reductions(witness, torch.optim.SGD([other], lr=0.1), _every(1)) == []
    assert witness.steps == 0
    opt = torch.optim.Adam([{"params": [other]}, {"params": [w]}])  # one group of several
    opt.step()
    assert witness.steps == 1
    witness.close()
    opt.step()
    assert witness.steps == 1
    gc.collect()
    hooks = len(_global_optimizer_post_hooks)
    StepWitness([w])  # dropped unclosed (a state that was never closed): its hook goes too
    gc.collect()
    assert len(_global_optimizer_post_hooks) == hooks


STEPS = 18  # optimizer steps, two micro-batches each: found at the ninth reduction


def _said(state, train) -> list:  # noqa: ANN001
    """`train()`, then close `state`: its fabric step, then every nfabric warning of both."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train()
        steps = state.step
        state.close()
    return [steps] + [str(w.message) for w in caught if "nfabric" in str(w.message)]


def _worker(rank: int, world: int, no_sync: bool, silenced: bool = False) -> list[str]:
    wl, _, ddp, state = tiny_ddp(world, STEPS)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)

    def train() -> None:
        if silenced:  # (a GAN's, SAM's loop: several backward passes a step by design)
            warnings.filterwarnings("ignore", category=nfabric_cli.AccumulationWarning)
        for step in range(STEPS):
            opt.zero_grad()
            for micro in range(2):
                batch = wl.train_batch(2 * step + micro, rank, world, 0)
                if no_sync and micro == 0:
                    with ddp.no_sync():
                        wl.loss(ddp, batch).backward()
                else:
                    loss = wl.loss(ddp, batch)
                    state.observe(loss)
                    loss.backward()
            opt.step()

    return _said(state, train)


@pytest.mark.parametrize("no_sync", [False, True])
def test_accumulation_without_no_sync_is_named_once_and_with_it_nothing(no_sync: bool) -> None:
    (steps0, *said0), (steps1, *said1) = run_ranks(_worker, 2, no_sync)
    assert not [s for s in said1 if "optimizer steps came" in s]  # rank 0 speaks for the run
    if no_sync:  # one reduction, one fabric step, per optimizer step
        assert steps0 == steps1 == STEPS and said0 == []
        return
    assert steps0 == steps1 == 2 * STEPS  # every micro-batch reduced, counted as a step
    (found,) = [s for s in said0 if "optimizer steps came after" in s]
    assert found.startswith(f"nfabric: each of the last {RUNS} optimizer steps came after 2 "
                            "reductions, and nfabric counts each reduction as a step")
    assert "gradient accumulation without ddp.no_sync()?" in found
    assert "under `with ddp.no_sync():`" in found
    # past total_steps halfway through the run, the warning names the same cause
    (past,) = [s for s in said0 if "is past total_steps" in s]
    assert f"step {STEPS + 1} is past total_steps={STEPS}" in past and "ddp.no_sync()" in past
    (closed,) = [s for s in said0 if "closed at step" in s]  # and so does close()
    assert f"step {2 * STEPS} of total_steps={STEPS}" in closed and "ddp.no_sync()" in closed


def test_the_accumulation_warning_is_its_own_category() -> None:
    """A loop that means several reductions a step silences that line alone: the ones about
    total_steps still come."""
    (steps, *said), _ = run_ranks(_worker, 2, False, True)
    assert steps == 2 * STEPS and not [s for s in said if "optimizer steps came" in s]
    assert len(said) == 2 and "is past total_steps" in said[0] and "closed at step" in said[1]
    assert issubclass(nfabric_cli.AccumulationWarning, UserWarning)


JOINED_STEPS, EARLY = 60, 20  # rank 0 runs out of batches 20 steps before rank 1


def _joined_worker(rank: int, world: int) -> list[str]:
    from torch.distributed.algorithms.join import Join

    wl, _, ddp, state = tiny_ddp(world, JOINED_STEPS)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)

    def train() -> None:
        with Join([ddp]):
            for step in range(JOINED_STEPS - EARLY * (1 - rank)):
                opt.zero_grad()
                loss = wl.loss(ddp, wl.train_batch(step, rank, world, 0))
                state.observe(loss)
                loss.backward()
                opt.step()

    return _said(state, train)


def test_a_rank_that_joined_early_is_not_named() -> None:
    """Under `Join` the rank that ran out reduces zeros, one reduction per step of the others,
    with no optimizer step of its own: one run of 20 that no step ends."""
    assert run_ranks(_joined_worker, 2) == [[JOINED_STEPS]] * 2
