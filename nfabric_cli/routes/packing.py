"""Bit packing of small integer codes into bytes, and base-3 packing of trits.

Packing is little-endian within a byte and sequential across bytes, so packing a
concatenation equals concatenating packings whenever pieces end on a byte boundary; the
sharded reducer relies on this to reduce shards of a packed buffer independently.

On the CPU, numpy's `packbits` and small reshapes keep the encoders near memory speed;
shift-and-sum in torch over 8 strided views is several times slower (see `nfabric bench
routes`). On any other device the same bytes come from torch ops (`_torch_*`), so the torch
path of every route runs where its tensors live (a test checks both give the same bytes).
"""

from __future__ import annotations

import functools

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


def _host(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def _shifts(bits: int, per: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, bits * per, bits, dtype=torch.uint8, device=device)


def torch_pack_uint(values: torch.Tensor, bits: int) -> torch.Tensor:
    """`pack_uint` in torch ops, on `values`' device: the same bytes."""
    v = values.reshape(-1)
    if bits in (1, 2, 4):
        per = 8 // bits
        v = v.to(torch.uint8)
        pad = (-v.numel()) % per
        if pad:
            v = torch.cat([v, v.new_zeros(pad)])
        cols = v.reshape(-1, per) << _shifts(bits, per, v.device)
        return cols.sum(dim=1, dtype=torch.int32).to(torch.uint8)  # disjoint bits: sum == or
    if bits in (8, 16, 32):  # little-endian bytes, as numpy's view of the wide dtype
        v = v.to(torch.int64)
        parts = [(v >> (8 * i)) & 0xFF for i in range(bits // 8)]
        return torch.stack(parts, dim=1).reshape(-1).to(torch.uint8)
    raise ValueError(f"unsupported width {bits}")


def torch_unpack_uint(packed: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    """`unpack_uint` in torch ops, on `packed`'s device: the same values and dtypes."""
    if bits in (1, 2, 4):
        per = 8 // bits
        cols = (packed.reshape(-1, 1) >> _shifts(bits, per, packed.device)) & (2**bits - 1)
        return cols.reshape(-1)[:numel].contiguous()
    if bits in (8, 16, 32):
        width = bits // 8
        b = packed.reshape(-1)[: numel * width].to(torch.int64).reshape(-1, width)
        v = b[:, 0].clone()
        for i in range(1, width):
            v |= b[:, i] << (8 * i)
        return v.to({8: torch.uint8, 16: torch.int32, 32: torch.int64}[bits])
    raise ValueError(f"unsupported width {bits}")


def torch_pack_trits(digits: torch.Tensor) -> torch.Tensor:
    """`pack_trits` in torch ops, on `digits`' device: the same bytes."""
    d = digits.reshape(-1).to(torch.int32)
    pad = (-d.numel()) % 5
    if pad:
        d = torch.cat([d, d.new_ones(pad)])  # pad with digit 1 (= zero)
    weights = _trit_weights(d.device)
    return (d.reshape(-1, 5) * weights).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def torch_unpack_trits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """`unpack_trits` in torch ops, on `packed`'s device: the same digits."""
    table = _trit_table(packed.device)
    return table[packed.reshape(-1).long()].reshape(-1)[:numel].contiguous()


# Kept per device: a host-to-GPU copy on every pack would wait for the GPU each time.
@functools.lru_cache(maxsize=8)
def _trit_weights(device: torch.device) -> torch.Tensor:
    return torch.tensor([1, 3, 9, 27, 81], dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=8)
def _trit_table(device: torch.device) -> torch.Tensor:
    return torch.from_numpy(_TRIT_TABLE).to(device)


def pack_bool(mask: torch.Tensor) -> torch.Tensor:
    """1 bit per element: a bool tensor -> uint8 tensor of ceil(n/8) bytes."""
    if not _host(mask):
        return torch_pack_uint(mask.to(torch.bool), 1)
    arr = mask.numpy() if mask.dtype == torch.bool else mask.numpy().astype(bool)
    return torch.from_numpy(np.packbits(arr, bitorder="little"))


def unpack_bool(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of `pack_bool`: uint8 tensor of 0/1, length `numel`."""
    if not _host(packed):
        return torch_unpack_uint(packed, numel, 1)
    out = np.unpackbits(packed.numpy(), count=numel, bitorder="little")
    return torch.from_numpy(out)


def pack_uint(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes (each < 2**bits) at `bits` per element into bytes (uint8 tensor)."""
    n = values.numel()
    if bits == 1:
        return pack_bool(values.to(torch.bool))
    if not _host(values):
        return torch_pack_uint(values, bits)
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
    if bits == 1:
        return unpack_bool(packed, numel)
    if not _host(packed):
        return torch_unpack_uint(packed, numel, bits)
    data = packed.numpy()
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
    if not _host(digits):
        return torch_pack_trits(digits)
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
    if not _host(packed):
        return torch_unpack_trits(packed, numel)
    digits = _TRIT_TABLE[packed.numpy()].reshape(-1)[:numel]
    return torch.from_numpy(np.ascontiguousarray(digits))


def trit_nbytes(numel: int) -> int:
    return (numel + 4) // 5
