"""The hook reads device values to the host once per step (issue 16, part 6).

On a GPU every `float(t)`, `t.item()` or `t.tolist()` waits for the device: the hook keeps the
step's statistics as tensors (gradient and update norms, sign agreement margins, the observed
loss) and reads them in one `agree.host_read`. Counted on CPU: the hook's work runs inline in
the backward thread here (its worker thread is replaced), under torch.profiler, with
`Tensor.tolist` counted too."""

from __future__ import annotations

import concurrent.futures

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

from nfabric_cli.binding import compile_profile, static_profile
from nfabric_cli.runtime import agree
from nfabric_cli.runtime.attach import attach
from tests.distutil import run_ranks
from tests.runtime.models import make_model, train_steps


class _Inline:
    """An executor running each job at once, on the calling thread."""

    def submit(self, fn, *args):  # noqa: ANN001, ANN201
        fut: concurrent.futures.Future = concurrent.futures.Future()
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the state's callback
            fut.set_exception(exc)
        return fut

    def shutdown(self, wait: bool = True) -> None: ...


def _reads_per_step(rank: int, world: int) -> list[int]:
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.001)  # several buckets: one read per step, not per bucket
    profile_ = static_profile(model, "sign", [("head.*", "fp32")])
    state = attach(ddp, compile_profile(profile_, model, world_size=world, bucket_cap_mb=None),
                   total_steps=4)
    state._pool = _Inline()
    reduce_bucket, buckets = state._reduce_bucket, [0]

    def counted_bucket(*args):  # noqa: ANN002, ANN202
        buckets[0] += 1
        return reduce_bucket(*args)

    state._reduce_bucket = counted_bucket
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    train_steps(ddp, opt, state, rank, 0, 1)  # the first step loads kernels and plans
    tolist, counted = torch.Tensor.tolist, [0]

    def counting(self):  # noqa: ANN001, ANN202
        counted[0] += 1
        return tolist(self)

    before, buckets[0] = agree.HOST_READS[0], 0
    torch.Tensor.tolist = counting
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            train_steps(ddp, opt, state, rank, 1, 4)
    finally:
        torch.Tensor.tolist = tolist
    state.close()
    scalar_reads = sum(1 for e in prof.events() if e.name == "aten::_local_scalar_dense")
    return [scalar_reads, counted[0], agree.HOST_READS[0] - before, state.step, buckets[0]]


def test_the_hook_reads_the_device_once_per_step() -> None:
    for scalar_reads, tolists, reads, step, buckets in run_ranks(_reads_per_step, 2):
        assert buckets >= 2 * 3  # several buckets in each of the 3 steps counted
        assert step == 4
        assert scalar_reads == 0  # no float(), item(), int() or bool() of a tensor anywhere
        assert reads == 3 and tolists == 3  # the step's one read, and no other
