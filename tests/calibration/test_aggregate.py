"""Aggregation of the simulated ranks: any split of the parameters gives the same bits."""

from __future__ import annotations

import pytest
import torch

from nfabric_cli.calibration.aggregate import (
    PER_GROUP_ELEMS,
    PER_PARAM_ELEMS,
    Aggregator,
    StepRoutes,
    merge_agreement,
    shard,
)
from nfabric_cli.routes import FP32, make_route
from nfabric_cli.routes.spec import RouteSpec

W = 3
NUMELS = [700, 5, 64, 2048, 33, 1500]
NAMES = [f"p{i}" for i in range(len(NUMELS))]
SIGN = RouteSpec("sign", error_feedback=True)
INT8 = RouteSpec("int8", error_feedback=True, rounding="stochastic")
PLAN = StepRoutes(("a", "a", "b", "b", "head", "b"), (SIGN, SIGN, INT8, SIGN, FP32, INT8))


def _grads(step: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(step)
    return [[torch.randn(n, generator=gen) for n in NUMELS] for _ in range(W)]


def _run(split: list[list[int]], steps: int = 4) -> tuple[list[list[torch.Tensor]], list]:
    aggs = [Aggregator(NAMES, W, seed=7, owned=owned) for owned in split]
    outs, agreements = [], []
    for step in range(steps):
        out = [torch.full((n,), float("nan")) for n in NUMELS]
        grads = _grads(step)
        agreements.append(merge_agreement([a.run(step, PLAN, grads, out) for a in aggs]))
        outs.append(out)
    return outs, agreements


@pytest.mark.parametrize("split", [[[0, 2, 4], [1, 3, 5]], [[3], [0, 1, 2, 4, 5]], shard(NUMELS, 3)])
def test_any_split_of_the_parameters_aggregates_bit_for_bit(split: list[list[int]]) -> None:
    """Error feedback over 4 steps, stochastic rounding, two sign scopes and fp32: every value
    and the agreement sums equal one aggregator over all parameters."""
    whole, whole_agree = _run([list(range(len(NUMELS)))])
    parts, parts_agree = _run(split)
    for a, b in zip(whole, parts, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert whole_agree == parts_agree
    assert set(whole_agree[0]) == {"a", "b"}  # sign scopes report agreement; fp32 does not


def test_one_parameter_equals_the_route_and_agreement_is_the_mean_margin() -> None:
    """No error feedback on step 0: the aggregate is the route's own simulate, and
    agree_sum / agree_n is the mean of |2c - W| / W over the elements."""
    spec = RouteSpec("sign")
    grads = _grads(0)
    agg = Aggregator(NAMES, W, 0, owned=[3])
    out = [torch.zeros(n) for n in NUMELS]
    agree = agg.run(0, StepRoutes(("r",) * 6, (spec,) * 6), grads, out)
    expected = make_route(spec).simulate([g[3] for g in grads], (2048,))
    assert torch.equal(out[3], expected)
    assert all(torch.equal(out[i], torch.zeros(NUMELS[i])) for i in (0, 1, 2, 4, 5))  # not owned
    votes = sum((g[3] > 0).long() for g in grads)
    margin = (2 * votes - W).abs().double()
    assert agree["r"] == (float(margin.sum()), 2048.0 * W)


def _load(numels: list[int], keys: list[str], members: list[int]) -> int:
    return (sum(numels[i] + PER_PARAM_ELEMS for i in members)
            + PER_GROUP_ELEMS * len({keys[i] for i in members}))


def test_shard_balances_size_count_and_groups() -> None:
    numels = [36864, 18432, 9216, 9216, 2048, 640, 10] + [64] * 10
    keys = ["body"] * 5 + ["head", "head"] + ["body"] * 10
    plain, grouped = shard(numels, 2), shard(numels, 2, keys)
    for parts in (plain, grouped):
        assert sorted(i for p in parts for i in p) == list(range(len(numels)))
        assert all(p == sorted(p) for p in parts)
    assert {5, 6} <= set(grouped[0]) or {5, 6} <= set(grouped[1])  # the head stays together
    worst = lambda parts: max(_load(numels, keys, p) for p in parts)  # noqa: E731
    assert worst(grouped) < worst(plain)
    loads = [_load(numels, keys, p) for p in grouped]
    assert max(loads) - min(loads) <= max(numels) // 2
    assert shard(numels, 1) == [list(range(len(numels)))]
    assert shard([10, 10], 3) == [[0], [1], []]
