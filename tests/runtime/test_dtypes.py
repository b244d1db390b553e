"""bf16 models: full precision is the gradients' own dtype, on the wire and in every count."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from nfabric_cli import attach
from nfabric_cli.binding import compile_profile, static_profile
from nfabric_cli.routes import make_route
from nfabric_cli.runtime.attach import attach_with
from tests.distutil import run_ranks
from tests.runtime.models import batch, make_model, train_steps

STEPS = 3


def _run(ddp, state, rank: int) -> None:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = batch(step, rank)
        loss = F.cross_entropy(ddp(x.to(torch.bfloat16)).float(), y)
        if state is not None:
            state.observe(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _bf16_worker(rank: int, world: int, route: str, direct: bool) -> dict:
    fp32_model = make_model()
    profile = static_profile(fp32_model, route)  # made from the fp32 model, as profiles are
    plain_model = copy.deepcopy(fp32_model).to(torch.bfloat16)
    fabric_model = copy.deepcopy(plain_model)
    plain = DDP(plain_model, bucket_cap_mb=0.001)
    fabric = DDP(fabric_model, bucket_cap_mb=0.001)
    bindings = compile_profile(profile, fabric_model, world_size=world, bucket_cap_mb=None)
    state = attach_with(fabric, bindings, total_steps=STEPS, direct_fp32=direct)
    _run(plain, None, rank)
    _run(fabric, state, rank)
    state.close()
    same = all(torch.equal(a, b) for a, b in zip(plain.parameters(), fabric.parameters(),
                                                 strict=True))
    return {"same": same, "summary": state.meter.summary(),
            "numel": sum(p.numel() for p in fabric_model.parameters()),
            "dtypes": {b.dtype for b in bindings.params.values()}}


@pytest.mark.slow
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "worker"])
def test_a_bf16_model_on_the_full_precision_route_is_plain_bf16_ddp(direct: bool) -> None:
    for r in run_ranks(_bf16_worker, 2, "fp32", direct):
        assert r["same"]  # bit-identical to plain DDP on the bf16 model: reduced in bf16
        assert r["dtypes"] == {"bfloat16"}
        s = r["summary"]
        # 2 ranks all-reducing in bf16: each rank sends and receives 2 bytes an element
        # (an up-cast to fp32 on the wire would make it 4 + 4)
        assert s["per_route"]["fp32"] == STEPS * r["numel"] * (2 + 2)
        assert s["fp32_bytes"] == s["per_route"]["fp32"]  # the reference is what was sent
        assert s["reference"] == "full precision (bfloat16)"


@pytest.mark.slow
def test_low_bit_savings_on_a_bf16_model_are_counted_against_bf16() -> None:
    sign = run_ranks(_bf16_worker, 2, "sign", True)[0]["summary"]
    fp = run_ranks(_bf16_worker, 2, "fp32", True)[0]["summary"]
    assert sign["fp32_bytes"] == fp["fp32_bytes"] == fp["bytes"]  # bf16 DDP's own bytes
    assert sign["traffic_fraction"] == pytest.approx(sign["bytes"] / fp["bytes"])


def test_the_wire_bytes_of_full_precision_follow_the_dtype() -> None:
    n = 1000
    f32 = make_route("fp32").wire_bytes(n, 4, 1).total
    assert make_route("fp32", torch.bfloat16).wire_bytes(n, 4, 1).total * 2 == f32
    assert make_route("fp32", torch.float16).wire_bytes(n, 4, 1).total * 2 == f32
    assert make_route("sign", torch.bfloat16).wire_bytes(n, 4, 1) == \
        make_route("sign").wire_bytes(n, 4, 1)  # low-bit formats do not depend on it
    model = make_model()
    profile = static_profile(model, "sign")
    bf16 = compile_profile(profile, copy.deepcopy(model).to(torch.bfloat16), world_size=4)
    f32b = compile_profile(profile, model, world_size=4)
    assert bf16.bytes_per_step("all")[1] * 2 == f32b.bytes_per_step("all")[1]
    assert bf16.bytes_per_step("all")[0] == f32b.bytes_per_step("all")[0]


def _compiled_worker(rank: int, world: int) -> dict:
    """DDP(torch.compile(model)) with a profile made from the bare model: the names gain
    `_orig_mod.`, the profile still fits, and it trains as the uncompiled model does. (The
    eager backend keeps inductor's compile time out of the suite; the wrapper and its names
    are the same for every backend.)"""
    results = []
    for compiled in (False, True):
        model = make_model()
        profile = static_profile(model, "sign", [("head.*", "fp32")])
        net = torch.compile(model, backend="eager") if compiled else model
        ddp = DDP(net)  # dynamo's DDP optimizer wants DDP's default buckets
        state = attach(ddp, profile, total_steps=STEPS)
        train_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), state, rank, 0, STEPS)
        state.close()
        results.append({"names": sorted(state.bindings.params), "bytes": state.bytes_per_route(),
                        "params": [p.detach().clone() for p in model.parameters()],
                        "match": state.bindings.meta.get("model_match")})
    plain, comp = results
    return {"names": comp["names"], "match": comp["match"], "bytes_equal": plain["bytes"] ==
            comp["bytes"], "sign": comp["bytes"].get("sign/sharded", 0),
            "same": all(torch.equal(a, b) for a, b in zip(plain["params"], comp["params"],
                                                          strict=True))}


@pytest.mark.slow
def test_a_compiled_model_takes_the_bare_models_profile_and_trains_alike() -> None:
    for r in run_ranks(_compiled_worker, 2):
        assert r["names"] and all(n.startswith("_orig_mod.") for n in r["names"])
        assert r["match"]["compiled"] is True
        assert r["sign"] > 0 and r["bytes_equal"] and r["same"]


class _Big(torch.nn.Module):
    """One 10,000-element fp16 weight whose gradient is 1000 everywhere: finite, with a norm
    of 1e5, past fp16's 65504."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(10_000))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w.float() * x).sum()  # the loss in float32: -1e7 after one step


def _big_worker(rank: int, world: int, route: str = "sign", model_dtype: torch.dtype =
                 torch.float16, grad: float = 1000.0) -> dict:
    model = _Big()
    profile = static_profile(model, route)
    model = model.to(model_dtype)
    ddp = DDP(model)
    state = attach(ddp, profile, total_steps=STEPS)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    for _ in range(STEPS):
        loss = ddp(torch.full((10_000,), grad))
        state.observe(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    state.close()
    return {"skipped": list(state.controller.skipped_steps),
            "w": sorted(set(model.w.detach().float().tolist()))}


@pytest.mark.slow
def test_an_fp16_model_with_a_gradient_norm_past_65504_is_not_skipped() -> None:
    """The hook's norms of an fp16 bucket are taken in float32: a norm of 1e5 once came out
    inf, read as a non-finite step, and the finite step was zeroed on every rank."""
    for r in run_ranks(_big_worker, 2):
        assert r["skipped"] == []
        # sign at two ranks: every element moves by lr x the chunk's mean |g| (1000) a step
        assert r["w"] == [pytest.approx(-STEPS * 1e-3 * 1000, rel=1e-2)]


@pytest.mark.slow
def test_an_fp16_wire_that_overflows_is_a_skipped_step_not_an_infinite_update() -> None:
    """fp32 model, `fp16` route, gradient 1e5 on both ranks: each sends 5e4, and their fp16
    sum overflows (as with PyTorch's fp16_compress_hook). The reduced update's norm shows it,
    and the step is zeroed on every rank instead of reaching SGD as -inf."""
    for r in run_ranks(_big_worker, 2, "fp16", torch.float32, 1e5):
        assert r["skipped"] == list(range(STEPS))
        assert r["w"] == [0.0]
