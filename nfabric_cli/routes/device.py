"""Host tensors onto the gradients' device without a host synchronisation."""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`. To a GPU through pinned memory, without waiting: a plain
    copy from pageable memory waits for the GPU's queued work, once per call, and the hook
    makes one host read a step (`runtime/agree.py`, `host_read`)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
