"""The fabric DDP communication hook: `fabric_hook(state, bucket) -> Future`.

DDP takes one hook per model, so this one dispatches every bucket: it splits the flat buffer
into per-parameter slices, groups them by route, runs each group's collective and
writes the results back at the original offsets. The reduction runs on the state's single
worker thread, in bucket order (the last bucket, once the worker is done, on DDP's own thread:
backward has nothing left to overlap), so (a) backward keeps computing while buckets reduce, and (b)
every rank issues the same collectives in the same order even though each bucket issues
several (a chain of `Future.then` callbacks issuing collectives from backend threads can
interleave differently on different ranks). All bucket futures of a step complete together
after the last bucket, once the step's health statistics are agreed: that is what lets a
non-finite step be neutralised on every rank before DDP copies any result into `.grad`.

Example::

    state = nfabric_cli.attach(ddp_model, "bindings.parquet", total_steps=1000)
"""

# No `from __future__ import annotations` here: DDP inspects the hook's annotations at
# register time and expects the real `dist.GradBucket` / `torch.futures.Future` objects.
import torch
import torch.distributed as dist

from nfabric_cli.runtime.state import FabricState


def fabric_hook(state: FabricState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reduce one DDP bucket through the fabric's routes (see module docstring)."""
    return state.submit(bucket.buffer(), list(bucket.parameters()), bucket.is_last())
