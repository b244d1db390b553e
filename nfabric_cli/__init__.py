"""nfabric: safe, measurable low-bit gradient communication for PyTorch DDP.

Data flows one way: spec -> profile -> bindings -> runtime -> report.
The public runtime entry point is :func:`attach`.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "attach"]


def __getattr__(name: str):
    # Lazy so that `import nfabric_cli` (and the CLI's start-up) does not import torch.distributed.
    if name == "attach":
        from nfabric_cli.runtime.attach import attach

        return attach
    raise AttributeError(name)
