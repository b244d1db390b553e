"""PyTorch's PowerSGD hook as a baseline arm on gloo, with DDP's gradients in several buckets.

Its hook `.wait()`s inside `Future.then` callbacks, which gloo runs on the group's two worker
threads: with two buckets' chains in flight it deadlocked (the validate arm hung at step
`start_powerSGD_iter`). The arm runs the buckets one at a time (`baselines._after_last`).
"""

from __future__ import annotations

import faulthandler

import pytest
import torch
import torch.distributed as dist
from torch import nn

from nfabric_cli.ranks.functions import run_function_ranks
from nfabric_cli.validation import baselines

pytestmark = pytest.mark.slow  # real gloo ranks


def _train_powersgd(rank: int, world_size: int, serial: bool) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])  # 257 KB per layer
    # A deadlock queues collectives that never start, which no group timeout sees: the rank
    # exits after 30 s instead, and the test fails rather than hanging the suite.
    faulthandler.dump_traceback_later(30, exit=True)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.25)
    meter = baselines.HookByteMeter(world_size, rank)
    state = baselines.powersgd_state(None, meter, rank=2, start_iter=2, seed=0)
    state.serial = serial
    starts: list[tuple[int, int]] = []  # (bucket index, other buckets' reductions in flight)
    futures: list[torch.futures.Future] = []
    hook = state.hook

    # In flight = a hook future not yet done. A counter decremented in a done-callback would
    # lag: a future reads done() before its callbacks have run (CI saw a 1 there once).
    def recording(inner: object, bucket: dist.GradBucket) -> torch.futures.Future:
        starts.append((bucket.index(), sum(not f.done() for f in futures)))
        futures.append(hook(inner, bucket))
        return futures[-1]

    state.hook = recording
    ddp.register_comm_hook(state, baselines.metered_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss = ddp(torch.randn(16, 256, generator=gen)).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    faulthandler.cancel_dump_traceback_later()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"losses": losses, "params": flat, "starts": starts, "iter": state.inner.iter,
            "sent": meter.sent}


def test_powersgd_runs_several_buckets_on_gloo_one_at_a_time():
    a, b = run_function_ranks(_train_powersgd, 2, True)
    assert torch.equal(a["params"], b["params"])  # the ranks stayed in step
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in (a, b))
    buckets = {i for i, _ in a["starts"]}
    assert len(buckets) >= 3  # the case that deadlocked
    assert a["iter"] == 6  # PowerSGD counted every step (compressing from step 2)
    # each bucket's hook started with no other bucket's reduction in flight
    assert [n for _, n in a["starts"]] == [0] * len(a["starts"])
    # compressed steps send less than the fp32 warm-up steps
    assert a["sent"][-1] < a["sent"][0]
