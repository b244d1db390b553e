"""Record a real bucket trace: 2 gloo ranks train a tiny model with `attach(trace_dir=...)`."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from nfabric_cli import attach
from nfabric_cli.binding import compile_profile, static_profile
from tests.distutil import run_ranks
from tests.runtime.models import make_model, train_steps

STEPS = 3


def _record(rank: int, world: int, trace_dir: str) -> int:
    model = make_model()
    ddp = DDP(model)
    profile = static_profile(model, "sign", [("head.*", "fp32")])
    bindings = compile_profile(profile, model, world_size=world, bucket_cap_mb=None)
    state = attach(ddp, bindings, total_steps=STEPS, trace_dir=trace_dir)
    train_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), state, rank, 0, STEPS)
    state.close()
    return rank


def record_trace(trace_dir: str, world: int = 2) -> None:
    """A trace of `STEPS` steps: one bucket, a sign/sharded body group and an fp32 head group."""
    run_ranks(_record, world, trace_dir)
