"""Built-in workloads: build, train, evaluate; determinism; disjoint covering shards; heads."""

from __future__ import annotations

import fnmatch
import math

import numpy as np
import pytest
import torch

from nfabric_cli.errors import InputError
from nfabric_cli.workloads.base import Workload
from nfabric_cli.workloads.common import warmup_cosine
from nfabric_cli.workloads.registry import BUILTINS, get_workload
from tests.workloads.helpers import train

NAMES = tuple(BUILTINS)


@pytest.fixture(scope="module")
def workloads() -> dict[str, Workload]:
    found = {name: get_workload(name) for name in NAMES}
    # glyphs scores its first 1,024 test images here (data v1's test set): 0.7 s, not 3
    found["glyphs"].eval_limit = 1024
    return found


@pytest.mark.parametrize("name", NAMES)
def test_protocol_and_head(workloads: dict[str, Workload], name: str) -> None:
    w = workloads[name]
    assert isinstance(w, Workload)
    assert w.name == name
    model = w.build_model(0)
    names = [n for n, _ in model.named_parameters()]
    head = [n for n in names if fnmatch.fnmatchcase(n, w.head_selector)]
    # The head is exactly the output layer (`head.weight`, plus `head.bias` when it has one).
    assert head == [n for n in ("head.weight", "head.bias") if n in names]
    assert "head.weight" in head
    assert not list(model.buffers()), "buffers would be broadcast by DDP"
    assert len(w.data_fingerprint()) == 64


@pytest.mark.parametrize("name", NAMES)
def test_every_parameter_gets_a_gradient(workloads: dict[str, Workload], name: str) -> None:
    """DDP without find_unused_parameters needs a gradient for every parameter every step."""
    w = workloads[name]
    model = w.build_model(1)
    w.loss(model, w.train_batch(0, 0, 2, 1)).backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []
    # Non-zero where the init allows it (the CNN zero-inits each block's last norm scale, so
    # the convs inside a block get exactly zero gradient at step 0, by design).
    assert model.head.weight.grad.abs().sum() > 0
    assert model.get_parameter(next(iter(dict(model.named_parameters())))).grad.abs().sum() > 0


@pytest.mark.parametrize(
    ("name", "steps", "bound"),
    [
        ("vision", 60, 0.4),  # chance 0.1; measured 0.59
        ("transformer", 100, 0.4),  # chance 0.1; measured 0.60
        ("lm", 60, None),  # bound: the unigram cross-entropy, 3.24 nats; measured 2.89
        # chance 1/128 = 0.008; measured 0.019 (one rank, warm-up; 4 ranks x 600 steps: 0.94)
        ("glyphs", 50, 0.014),
    ],
)
def test_short_training_learns(
    workloads: dict[str, Workload], name: str, steps: int, bound: float | None
) -> None:
    w = workloads[name]
    before = w.evaluate(w.build_model(0))
    after = w.evaluate(train(w, steps, 1, 0))
    if w.higher_is_better:
        assert before < 0.2 and after > bound
    else:
        assert math.isclose(before, math.log(len(w.corpus.vocab)), rel_tol=0.05)
        assert after < w.unigram_loss() < before


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_weights_batches_and_metric(
    workloads: dict[str, Workload], name: str
) -> None:
    w = workloads[name]
    a, b, c = w.build_model(3), w.build_model(3), w.build_model(4)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert any(
        not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters(), strict=True)
    )
    for step in (0, 5, 1000):  # random access: step 1000 needs no earlier call
        x1, x2 = w.train_batch(step, 1, 2, 3), w.train_batch(step, 1, 2, 3)
        assert all(torch.equal(t1, t2) for t1, t2 in zip(x1, x2, strict=True))
        assert len(x1[0]) == w.batch_size
    assert not torch.equal(w.train_batch(0, 1, 2, 3)[0], w.train_batch(0, 1, 2, 4)[0])
    state = torch.random.get_rng_state()
    m1, m2 = train(w, 2, 2, 3), train(w, 2, 2, 3)
    assert torch.equal(torch.random.get_rng_state(), state), "global RNG must be untouched"
    assert w.evaluate(m1) == w.evaluate(m2)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shards_disjoint_and_covering(
    workloads: dict[str, Workload], name: str, world_size: int
) -> None:
    w = workloads[name]
    shards = [np.asarray(w.shard_indices(r, world_size)) for r in range(world_size)]
    joined = np.concatenate(shards)
    assert len(joined) == len(np.unique(joined))  # disjoint
    assert np.array_equal(np.sort(joined), np.arange(len(joined)))  # covering
    for rank, shard in enumerate(shards):
        # A rank draws every batch from its own shard, without repeats inside an epoch.
        per_epoch = w.steps_per_epoch(world_size)
        seen = np.concatenate(
            [w.batch_indices(s, rank, world_size, 7) for s in range(min(per_epoch, 40))]
        )
        assert np.isin(seen, shard).all()
        assert len(seen) == len(np.unique(seen))


def test_reshuffled_every_epoch(workloads: dict[str, Workload]) -> None:
    w = workloads["vision"]
    per_epoch = w.steps_per_epoch(2)  # 718 samples per rank // 32 = 22
    assert per_epoch == 22
    first = w.batch_indices(0, 0, 2, 0)
    again = w.batch_indices(per_epoch, 0, 2, 0)
    assert not np.array_equal(first, again)
    epoch0 = np.concatenate([w.batch_indices(s, 0, 2, 0) for s in range(per_epoch)])
    epoch1 = np.concatenate([w.batch_indices(s + per_epoch, 0, 2, 0) for s in range(per_epoch)])
    assert len(np.intersect1d(epoch0, epoch1)) > 600  # same shard, new order


def test_bad_rank_and_world_size(workloads: dict[str, Workload]) -> None:
    w = workloads["vision"]
    with pytest.raises(InputError, match="rank 2 is not in a world of size 2"):
        w.train_batch(0, 2, 2, 0)
    with pytest.raises(InputError, match="world size 64 is too large .* 22 samples"):
        w.train_batch(0, 0, 64, 0)
    with pytest.raises(InputError, match="step must be >= 0"):
        w.train_batch(-1, 0, 2, 0)


def test_evaluate_restores_mode_and_unwraps(workloads: dict[str, Workload]) -> None:
    w = workloads["transformer"]
    model = w.build_model(0)
    metric = w.evaluate(model)
    assert model.training

    class Wrapper(torch.nn.Module):  # what DDP looks like from outside: `.module`
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.module = inner

    assert w.evaluate(Wrapper(model)) == metric


def test_warmup_cosine_schedule() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    sched = warmup_cosine(opt, total_steps=100, warmup_frac=0.1)
    lrs = []
    for _ in range(100):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(0.1)
    assert lrs[9] == pytest.approx(1.0)
    assert lrs[10] == pytest.approx(1.0)
    assert lrs[55] == pytest.approx(0.5, abs=0.03)
    assert lrs[99] == pytest.approx(0.5 * (1 + math.cos(math.pi * 89 / 90)))
