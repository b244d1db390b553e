"""Device helpers for the hook's hot path: host tensors onto the gradients' device without a
host synchronisation, and the hook's worker thread on the stream of the thread it serves."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`. To a GPU through pinned memory, without waiting: a plain
    copy from pageable memory waits for the GPU's queued work, once per call, and the hook
    makes one host read a step (`runtime/agree.py`, `host_read`)."""
    if device.type != "cuda" or host.device.type != "cpu":  # (already there: no copy)
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def current_stream(t: torch.Tensor) -> Any:
    """The calling thread's current CUDA stream on `t`'s device (None off a GPU)."""
    return torch.cuda.current_stream(t.device) if t.device.type == "cuda" else None


def on_stream(stream: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` issuing its GPU work on `stream` (None: as the thread is). A thread's
    current stream is its own, the device's default one on a new thread: the hook's worker
    runs each bucket on the stream DDP's thread handed it over on (`current_stream`), else a
    run on a side stream (``with torch.cuda.stream(s):``) would have it read buckets before
    backward wrote them and DDP copy results before it wrote them. On one stream the GPU
    runs both threads' work in the order they hand it over."""
    if stream is None:
        return fn(*args)
    with torch.cuda.stream(stream):  # (also the stream's device, for calls that take none)
        return fn(*args)
