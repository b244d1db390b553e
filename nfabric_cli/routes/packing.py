"""Bit packing of small integer codes into bytes, and base-3 packing of trits.

Packing is little-endian within a byte and sequential across bytes, so packing a
concatenation equals concatenating packings whenever pieces end on a byte boundary; the
sharded reducer relies on this to reduce shards of a packed buffer independently.

numpy's `packbits` and small reshapes keep the encoders near memory speed; shift-and-sum in
torch over 8 strided views is several times slower (see `nfabric bench routes`).
"""

from __future__ import annotations

import numpy as np
import torch

_TRIT_WEIGHTS = np.array([1, 3, 9, 27, 81], dtype=np.uint8)
# 243 x 5 table: byte value -> its five base-3 digits.
_TRIT_TABLE = np.array(
    [[(v // 3**i) % 3 for i in range(5)] for v in range(243)], dtype=np.uint8
)


def bits_for_levels(levels: int) -> int:
    """Smallest width in {1, 2, 4, 8, 16, 32} bits that holds `levels` distinct values."""
    for bits in (1, 2, 4, 8, 16, 32):
        if levels <= 2**bits:
            return bits
    raise ValueError(f"cannot pack {levels} levels")


def packed_nbytes(numel: int, bits: int) -> int:
    return (numel * bits + 7) // 8


def pack_bool(mask: torch.Tensor) -> torch.Tensor:
    """1 bit per element: a bool tensor -> uint8 tensor of ceil(n/8) bytes."""
    arr = mask.numpy() if mask.dtype == torch.bool else mask.numpy().astype(bool)
    return torch.from_numpy(np.packbits(arr, bitorder="little"))


def unpack_bool(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of `pack_bool`: uint8 tensor of 0/1, length `numel`."""
    out = np.unpackbits(packed.numpy(), count=numel, bitorder="little")
    return torch.from_numpy(out)


def pack_uint(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes (each < 2**bits) at `bits` per element into bytes (uint8 tensor)."""
    n = values.numel()
    if bits == 1:
        return pack_bool(values.to(torch.bool))
    if bits in (2, 4):
        per = 8 // bits
        arr = values.numpy().astype(np.uint8, copy=False)
        pad = (-n) % per
        if pad:
            arr = np.concatenate([arr, np.zeros(pad, dtype=np.uint8)])
        arr = arr.reshape(-1, per)
        out = arr[:, 0].copy()
        for i in range(1, per):
            out |= arr[:, i] << np.uint8(bits * i)
        return torch.from_numpy(out)
    if bits in (8, 16, 32):
        dtype = {8: np.uint8, 16: np.uint16, 32: np.uint32}[bits]
        arr = np.ascontiguousarray(values.numpy().astype(dtype, copy=False))
        return torch.from_numpy(arr.view(np.uint8))  # may alias `values` when already uint8
    raise ValueError(f"unsupported width {bits}")


def unpack_uint(packed: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    """Inverse of `pack_uint`: an int64-safe tensor (uint8 for <= 8 bits, else int32/int64)."""
    data = packed.numpy()
    if bits == 1:
        return unpack_bool(packed, numel)
    if bits in (2, 4):
        per = 8 // bits
        mask = np.uint8(2**bits - 1)
        cols = [(data >> np.uint8(bits * i)) & mask for i in range(per)]
        out = np.stack(cols, axis=1).reshape(-1)[:numel]
        return torch.from_numpy(np.ascontiguousarray(out))
    if bits == 8:
        return torch.from_numpy(data[:numel].copy())
    if bits == 16:
        return torch.from_numpy(data.view(np.uint16)[:numel].astype(np.int32))
    if bits == 32:
        return torch.from_numpy(data.view(np.uint32)[:numel].astype(np.int64))
    raise ValueError(f"unsupported width {bits}")


def pack_trits(digits: torch.Tensor) -> torch.Tensor:
    """Base-3 packing: digits in {0, 1, 2}, five per byte (1.6 bits per element)."""
    arr = digits.numpy().astype(np.uint8, copy=False)
    pad = (-arr.size) % 5
    if pad:
        arr = np.concatenate([arr, np.ones(pad, dtype=np.uint8)])  # pad with digit 1 (= zero)
    cols = arr.reshape(-1, 5)
    packed = cols[:, 0].copy()
    for i in range(1, 5):  # uint8 multiply-adds: far faster than an integer matmul; max 242
        packed += cols[:, i] * _TRIT_WEIGHTS[i]
    return torch.from_numpy(packed)


def unpack_trits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of `pack_trits`: uint8 digits in {0, 1, 2}, length `numel`."""
    digits = _TRIT_TABLE[packed.numpy()].reshape(-1)[:numel]
    return torch.from_numpy(np.ascontiguousarray(digits))


def trit_nbytes(numel: int) -> int:
    return (numel + 4) // 5
