"""The hook on a GPU, one NCCL rank in this process: training on a side stream.

A thread's current CUDA stream is its own, so the hook's worker thread must issue its work on
the stream DDP's thread is on (`routes/device.py`, `on_stream`): else, under
``with torch.cuda.stream(s):``, it would read buckets before backward had written them.
Skipped without a GPU, and nothing here counts as checked then (docs/capacity.md, "On a
GPU")."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from nfabric_cli.binding import compile_profile, static_profile
from nfabric_cli.runtime.attach import attach
from tests.runtime.models import make_model, train_steps

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture
def one_rank(tmp_path):  # noqa: ANN001, ANN201
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl" if dist.is_nccl_available() else "gloo", store=store,
                            rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _train(stream: torch.cuda.Stream, steps: int = 6) -> tuple[list, list]:
    """Weights after `steps` on `stream` with the fabric (all `int8`: at one rank each route
    applies its codec, nothing sent; several buckets), and per bucket reduced the stream and
    the thread it was reduced on."""

    model = make_model().cuda()
    seen: list[tuple[torch.cuda.Stream, str]] = []
    with torch.cuda.stream(stream):
        ddp = DDP(model, bucket_cap_mb=0.001)  # several buckets: the worker takes all but one
        bindings = compile_profile(static_profile(model, "int8"), model, world_size=1,
                                   bucket_cap_mb=None)
        state = attach(ddp, bindings, total_steps=steps)
        reduce_bucket = state._reduce_bucket

        def watched(*args):  # noqa: ANN002, ANN202
            seen.append((torch.cuda.current_stream(), threading.current_thread().name))
            return reduce_bucket(*args)

        state._reduce_bucket = watched
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        train_steps(ddp, opt, state, 0, 0, steps, device="cuda")
        state.close()
    torch.cuda.synchronize()
    return [p.detach().cpu() for p in model.parameters()], seen


def test_the_worker_issues_on_the_training_stream(one_rank) -> None:  # noqa: ANN001
    default, seen = _train(torch.cuda.default_stream())
    assert len(seen) >= 6 + 1  # every bucket of every step: several a step after the first
    side = torch.cuda.Stream()
    on_side, seen = _train(side)
    # the hook's worker reduced some buckets (all of a step's but the last, DDP's thread's)
    assert any(name.startswith("nfabric") for _, name in seen)
    assert all(s == side for s, _ in seen)  # and on the side stream, not its own default one
    for a, b in zip(default, on_side, strict=True):
        # the same run on either stream; a race would read unwritten gradients (far off),
        # while cuBLAS may pick other kernels on another stream (a last bit, one code step)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
