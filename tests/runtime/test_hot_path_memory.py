"""The hook reduces low-bit buckets without full-size copies (issue 16, part 1).

A bucket of low-bit parameters is encoded from, and decoded into, the bucket's own memory, and
at W = 2 (where every route gathers its codes) its codes are written into the kept wire buffer:
the only tensors the reduce allocates there are per-chunk scales. Counted with torch.profiler's allocation sizes over everything the hook runs (inline
in the backward thread here, as in `test_host_reads.py`), on 2 real gloo ranks. The bucket
holds weights and biases of several regions in an order where a region's parameters are not
consecutive, so the gather-and-scatter case is covered too.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function

from nfabric_cli.binding import compile_profile, static_profile
from nfabric_cli.runtime.attach import attach
from tests.distutil import run_ranks
from tests.runtime.test_host_reads import _Inline

WIDTH = 384  # a 147k-element weight: 576 KiB, so a full-size copy stands out


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, 4))


def _descendants(event):  # noqa: ANN001, ANN202 - torch.autograd.profiler FunctionEvent
    for child in event.cpu_children:
        yield child
        yield from _descendants(child)


def _both(rank: int, world: int) -> list[list[int]]:
    # weights on sign, biases on int8 (interleaved in the bucket: neither group is consecutive)
    return [_largest_allocation(rank, world, route, rules)
            for route, rules in (("sign", []), ("sign", [("*.bias", "int8")]))]


def _largest_allocation(rank: int, world: int, route: str, rules: list) -> list[int]:
    model = _model()
    ddp = DDP(model, bucket_cap_mb=25, gradient_as_bucket_view=True)  # one bucket
    prof_ = static_profile(model, route, rules)
    state = attach(ddp, compile_profile(prof_, model, world_size=world, bucket_cap_mb=None),
                   total_steps=3)
    state._pool = _Inline()
    reduce_bucket = state._reduce_bucket

    def labelled(*args):  # noqa: ANN002, ANN202
        with record_function("nfabric.reduce_bucket"):
            return reduce_bucket(*args)

    state._reduce_bucket = labelled
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, WIDTH, generator=gen), torch.randint(0, 4, (16,), generator=gen)

    def step() -> None:
        loss = nn.functional.cross_entropy(ddp(x), y)
        state.observe(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()

    step()  # the first step builds kernels, plans and DDP's bucket order
    step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    state.close()
    hooks = [e for e in prof.events() if e.name == "nfabric.reduce_bucket"]
    sizes = [d.self_cpu_memory_usage for h in hooks for d in _descendants(h)]
    bucket_bytes = 4 * sum(p.numel() for p in model.parameters())
    return [len(hooks), max(sizes, default=0), bucket_bytes]


def test_a_low_bit_bucket_reduces_in_its_own_memory() -> None:
    for per_case in run_ranks(_both, 2):
        for hooks, largest, bucket_bytes in per_case:
            assert hooks == 1
            # At W = 2 every route gathers its codes, encoded straight into the kept wire
            # buffer: what is left to allocate is per-chunk scales (608 and 288 bytes here). A
            # full-size copy would be >= 1/3 of the bucket, sign's bits in new memory 1/32.
            assert 0 < largest < bucket_bytes / 256, (largest, bucket_bytes)
