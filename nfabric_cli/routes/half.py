"""`bf16` / `fp16`: halve the bytes with a 16-bit all-reduce (PyTorch's fp16_compress_hook math).

Divide by the world size first (fp16 overflows otherwise), cast, all-reduce in 16 bits, cast
back. The 16-bit sum rounds at every addition, so the simulator adds in gloo's ring order
(`ring.py`, checked for 16-bit buffers too) to agree with the collective bit for bit.
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
