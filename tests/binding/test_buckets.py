"""The bucket plan equals the layout a real 1-rank gloo DDP uses (recorded by a comm hook)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from nfabric_cli.binding.buckets import (
    bucket_caps,
    bucket_slots,
    first_step_buckets,
    plan_buckets,
    trace_ready_order,
)
from nfabric_cli.binding.fingerprint import trainable_parameters
from tests.binding import models


@pytest.fixture()
def gloo(tmp_path):
    assert not dist.is_initialized()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def real_layout(model: nn.Module, inputs: torch.Tensor, steps: int = 2, **ddp_kwargs):
    """[(bucket index, [(name, offset, numel)...])] of DDP's last backward."""
    names = {p: n for n, p in model.named_parameters()}
    ddp = nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
    seen: list = []

    def record(state, bucket):
        base = bucket.buffer().data_ptr()
        item = bucket.buffer().element_size()
        seen.append(
            (
                bucket.index(),
                [
                    (names[p], (g.data_ptr() - base) // item, g.numel())
                    for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True)
                ],
            )
        )
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    ddp.register_comm_hook(None, record)
    for _ in range(steps):
        seen.clear()
        ddp(inputs).float().sum().backward()
    return sorted(seen)


def planned_layout(model: nn.Module, **kwargs):
    params = trainable_parameters(model)
    buckets = plan_buckets(params, **kwargs)
    slots = bucket_slots(buckets, params)
    return [
        (i, [(n, slots[n].offset, slots[n].numel) for n in names])
        for i, names in enumerate(buckets)
    ]


def traced(model: nn.Module, inputs: torch.Tensor) -> list[str]:
    return trace_ready_order(model, lambda: model(inputs).float().sum().backward())


def test_caps_follow_installed_ddp():
    first, cap = bucket_caps(None)
    assert cap == 25 * 1024 * 1024
    assert first == dist._DEFAULT_FIRST_BUCKET_BYTES == 1024 * 1024
    first, cap = bucket_caps(0.5)
    assert cap == 524288
    from torch.nn.parallel import distributed as ddp_mod

    # torch >= 2.12 caps the first bucket with an explicit bucket_cap_mb too; older: 1 MB.
    expected_first = 524288 if hasattr(ddp_mod, "_BucketCapacityConfig") else 1024 * 1024
    assert first == expected_first


def test_parameters_of_one_module_split_across_buckets(gloo):
    model, x = models.split(), torch.randn(2, 8)
    order = traced(model, x)
    assert order[:3] == ["head.bias", "head.weight", "mid.bias"]
    plan = planned_layout(model, bucket_cap_mb=0.25, ready_order=order)
    assert plan == real_layout(model, x, bucket_cap_mb=0.25)
    assert plan[0] == (
        0,
        [("head.bias", 0, 10), ("head.weight", 10, 60000), ("mid.bias", 60010, 6000)],
    )
    assert plan[1] == (1, [("mid.weight", 0, 600000)])
    assert plan[2] == (2, [("first.bias", 0, 100), ("first.weight", 100, 800)])


def test_default_order_matches_membership_and_traced_order_matches_offsets(gloo):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(300, 400), nn.LayerNorm(400), nn.ReLU(), nn.Linear(400, 500), nn.Linear(500, 10)
    )
    x = torch.randn(4, 300)
    real = real_layout(model, x, bucket_cap_mb=0.5)
    # Without a trace, membership is DDP's; only the LayerNorm's weight/bias order differs.
    guess = planned_layout(model, bucket_cap_mb=0.5)
    assert [sorted(n for n, _, _ in b) for _, b in guess] == [
        sorted(n for n, _, _ in b) for _, b in real
    ]
    assert [n for n, _, _ in guess[1][1]] == ["1.bias", "1.weight", "0.bias", "0.weight"]
    assert [n for n, _, _ in real[1][1]] == ["1.weight", "1.bias", "0.bias", "0.weight"]
    assert planned_layout(model, bucket_cap_mb=0.5, ready_order=traced(model, x)) == real


def first_layout(model: nn.Module, **kwargs):
    params = trainable_parameters(model)
    buckets = first_step_buckets(params, **kwargs)
    slots = bucket_slots(buckets, params)
    return [(i, [(n, slots[n].offset, slots[n].numel) for n in names])
            for i, names in enumerate(buckets)]


@pytest.mark.parametrize("find_unused", [False, True])
def test_first_step_uses_ddps_initial_assignment(gloo, find_unused):
    model, x = models.split(), torch.randn(2, 8)
    kwargs = {"bucket_cap_mb": 0.25, "find_unused_parameters": find_unused}
    first = first_layout(model, **kwargs)
    assert first == real_layout(model, x, steps=1, **kwargs)
    if find_unused:  # kept for good: the plan
        assert first == planned_layout(model, **kwargs)
    else:  # one bucket in registration order, whatever the cap; rebuilt after the step
        assert [n for n, _, _ in first[0][1]] == [n for n, _ in model.named_parameters()]
        assert len(first) == 1 and len(planned_layout(model, **kwargs)) == 3


def test_default_cap_single_bucket_with_small_first_bucket(gloo):
    model, x = models.nested(), torch.randn(2, 8)
    plan = planned_layout(model, bucket_cap_mb=None, ready_order=traced(model, x))
    assert len(plan) == 1  # 1,000-odd elements: far below the 1 MB first bucket
    assert plan == real_layout(model, x)


def test_find_unused_parameters_uses_ddp_initial_assignment(gloo):
    model, x = models.split(), torch.randn(2, 8)
    plan = planned_layout(model, bucket_cap_mb=0.25, find_unused_parameters=True)
    assert plan == real_layout(model, x, bucket_cap_mb=0.25, find_unused_parameters=True)
    # Registration order, buckets reversed: the last bucket holds the first parameters.
    assert plan[-1][1][0][0] == "first.weight"


def test_unused_branch_is_planned_and_matches_ddp(gloo):
    model, x = models.unused(), torch.randn(2, 8)
    plan = planned_layout(model, bucket_cap_mb=None, find_unused_parameters=True)
    assert {n for _, b in plan for n, _, _ in b} == {
        "used.weight",
        "used.bias",
        "spare.weight",
        "spare.bias",
        "head.weight",
        "head.bias",
    }
    assert plan == real_layout(model, x, find_unused_parameters=True)


def test_ready_order_rejects_unknown_names_and_appends_missing():
    model = models.unused()
    params = trainable_parameters(model)
    order = ["head.bias", "head.weight", "used.bias", "used.weight"]
    (bucket,) = plan_buckets(params, ready_order=order)
    assert bucket == [*order, "spare.bias", "spare.weight"]
    with pytest.raises(Exception, match="nope"):
        plan_buckets(params, ready_order=["nope"])
    with pytest.raises(Exception, match="bucket cap must be a finite number > 0"):
        plan_buckets(params, bucket_cap_mb=0)


@pytest.mark.parametrize("find_unused", [False, True])
def test_tied_and_nested_models_match_ddp(gloo, find_unused):
    for model, x in (
        (models.tied(), torch.tensor([[1, 2, 3]])),
        (models.nested(), torch.randn(2, 8)),
    ):
        order = None if find_unused else traced(model, x)
        plan = planned_layout(
            model, bucket_cap_mb=0.001, find_unused_parameters=find_unused, ready_order=order
        )
        assert len(plan) >= 2
        real = real_layout(model, x, bucket_cap_mb=0.001, find_unused_parameters=find_unused)
        assert plan == real
