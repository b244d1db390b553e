"""`bf16` / `fp16`: halve the bytes with a 16-bit all-reduce (PyTorch's fp16_compress_hook math).

Divide by the world size first (fp16 overflows otherwise), cast, all-reduce in 16 bits, cast
back. The 16-bit sum's rounding depends on the reduction order inside the backend, so the
simulator agrees with the collective to within a 16-bit ulp, not bit for bit.
"""

from __future__ import annotations

import torch

from nfabric_cli.routes.fp32 import FloatRoute


class Bf16Route(FloatRoute):
    name = "bf16"
    wire_dtype = torch.bfloat16


class Fp16Route(FloatRoute):
    name = "fp16"
    wire_dtype = torch.float16
