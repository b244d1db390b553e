"""Native codec kernels: `_kernels.c`, compiled on first use, with the torch code as fallback.

Single-threaded torch elementwise ops run at a few percent of memory speed here, and every
encoder needs a per-chunk reduction followed by an elementwise pass; the C kernels fuse them
and visit each chunk once while it is in cache. They perform the same IEEE operations in the
same order as the torch reference in sign.py / intq.py / ternary.py, so payloads and decoded
values are bit-identical whichever path runs (the simulator and a rank without a compiler keep
agreeing with everyone else).

Built by `native_build.py` (system C compiler, cached by hash), loaded here with ctypes. `native()` is None (torch fallback) with `NFABRIC_NO_NATIVE=1`, without a working
compiler, or when the load-time check finds torch behaving unlike what the kernels mirror;
`status()` says which and why.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import threading
from collections.abc import Sequence

import torch

from nfabric_cli.routes.chunks import ChunkLayout, chunk_layout
from nfabric_cli.routes.native_build import ISA_FLAGS, build
from nfabric_cli.routes.tally import Tally

__all__ = ["ISA_FLAGS", "Kernels", "build", "native", "status", "variant"]

#: Set to 1 to force the pure-torch path (checked on every call, so tests can flip it).
DISABLE_ENV = "NFABRIC_NO_NATIVE"
#: Set to a build name (e.g. "baseline") to use that build (results are identical).
ISA_ENV = "NFABRIC_NATIVE_ISA"

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float
_SIGNATURES: dict[str, list] = {
    "nf_isa": [],
    "nf_cpu_has_avx2": [],
    "nf_advise_huge": [_P, _I],
    "nf_abs_max": [_P, _P, _I, _P],
    "nf_sign_bits": [_P, _I, _P, _I],
    "nf_sign_encode": [_P, _I, _P, _I, _P, _P, _I],
    "nf_sign_decode": [_P, _P, _I, _P, _P],
    "nf_quantize": [_P, _P, _P, _I, _P, _F, _P],
    "nf_int_encode": [_P, _P, _I, _F, _P, _P, ctypes.c_int],
    "nf_pack_nibbles": [_P, _I, _P],
    "nf_int_decode": [_P, ctypes.c_int, _P, _I, _P, _P, _P],
    "nf_ternary_rows": [_P, _I, _I, _F, _P, _P, _P, _P],
    "nf_ternary_finish": [_P, _P],
    "nf_ternary_decode": [_P, _P, _I, _P, _P],
    "nf_sum_codes": [_P, _I, _I, ctypes.c_int, _I, _P],
    "nf_sign_combine": [_P, _I, _I, ctypes.c_int, _P, _P],
    "nf_sign_majority": [_P, _I, _I, _P, _I, _P, _P],
    "nf_combine_pack": [_P, _I, _I, ctypes.c_int, _I, _P, ctypes.c_int, _P, _I, _P, _P],
    "nf_decode_values": [_P, _P, _I, _P, ctypes.c_int, _F, _P],
    "nf_decode_codes": [_P, ctypes.c_int, _I, _I, _P, _I, _P, ctypes.c_int, _F, _P],
    "nf_combine_decode": [_P, _I, _I, ctypes.c_int, _I, _P, _P, _I, _P, ctypes.c_int, _F, _I,
                          _P, _P, _I, _P],
    "nf_combine_decode_local": [_P, _I, _I, ctypes.c_int, _I, _F, _P, _I, _I, _P, _I, _P],
}
#: Code kinds `sum_codes` adds up, with elements per byte.
SUM_KINDS: dict[str, tuple[int, int]] = {"int8": (0, 1), "nibble": (1, 2), "trit": (2, 5), "bit": (3, 8)}


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class _Margins:
    """A `Tally`'s ranges as the kernels take them (int64 element ends, ascending) and the int64
    vote-margin sums they write per range; `add` hands the sums to the tally. No tally, no
    ranges: the kernels skip the margins."""

    def __init__(self, tally: Tally | None, elements: int) -> None:
        self.tally = tally
        n = len(tally.ends) if tally is not None else 0
        if n and tally.ends[-1] > elements:  # agree_n counts to the last end: all must exist
            raise ValueError(f"margin ranges end at {tally.ends[-1]}, past {elements} elements")
        self.n = n
        self.ends = (ctypes.c_int64 * n)(*tally.ends) if n else None
        self.sums = (ctypes.c_int64 * n)() if n else None

    def add(self, world_size: int) -> None:
        if self.tally is not None:
            self.tally.add(list(self.sums) if self.sums is not None else [], world_size)


@functools.lru_cache(maxsize=4096)
def _blocks(layout: ChunkLayout) -> torch.Tensor:
    """The layout as int64 (start, nchunks, length) triples, the kernels' view of it."""
    return torch.tensor([v for b in layout.blocks for v in (b.start, b.nchunks, b.length)],
                        dtype=torch.int64)


def inv_qmax(qmax: int) -> float:
    """1 / qmax as a float32 (an exact Python float): an int code q decodes as (q * this) * s,
    products the torch path and the kernels round alike (q * this = +-1 exactly at +-qmax)."""
    return float(torch.tensor(1.0 / qmax, dtype=torch.float32))


@functools.lru_cache(maxsize=4)
def _int_lut(qmax: int, bits: int) -> torch.Tensor:
    """Decoded value per packed code, computed by torch itself: codes.float() * inv_qmax."""
    if bits == 8:
        codes = torch.arange(256, dtype=torch.int64).to(torch.uint8).view(torch.int8)
    else:
        codes = torch.arange(16, dtype=torch.uint8).to(torch.int8) - 8
    return codes.float().mul_(inv_qmax(qmax))


def _src(x: torch.Tensor, layout: ChunkLayout | None = None) -> torch.Tensor:
    """The kernels read raw float32 memory: refuse anything else rather than read garbage."""
    if x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError(f"native kernels take contiguous float32, got {x.dtype}")
    if layout is not None and x.numel() != layout.numel:
        raise ValueError(f"{x.numel()} elements for a layout of {layout.numel}")
    return x


def _need(t: torch.Tensor, nbytes: int, what: str) -> torch.Tensor:
    t = t.contiguous()
    if t.numel() * t.element_size() < nbytes:
        raise ValueError(f"{what}: {t.numel() * t.element_size()} bytes, need {nbytes}")
    return t


def _dest(out: torch.Tensor, dtype: torch.dtype, numel: int, what: str,
          exact: bool = False) -> torch.Tensor:
    """The first `numel` elements of a caller's destination, written in place: it must be
    contiguous `dtype` (a copy would leave the caller's buffer unwritten), of at least (with
    `exact`, just) `numel` elements. Codes go to the front of a wire buffer; a decode fills
    its whole `out`."""
    short = out.numel() != numel if exact else out.numel() < numel
    if out.dtype != dtype or not out.is_contiguous() or short:
        raise ValueError(f"{what}: need contiguous {dtype} of {'' if exact else '>= '}{numel} "
                         f"elements, got {out.dtype} {tuple(out.shape)}")
    return out[:numel]


HUGE_MIN_BYTES = 4 << 20
#: Elements of kept |x| the ternary gate hands torch per row-sum call (1 MiB: stays in cache).
TILE_ELEMS = 1 << 18


class Kernels:
    """Typed wrappers over the C functions; tensors are float32 / uint8 / int8, contiguous."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        for name, args in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, (ctypes.c_int if not args else None)
        self.isa = {2: "avx2", 1: "sse2", 0: "portable"}[lib.nf_isa()]

    def empty(self, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """torch.empty, with a huge-page hint on large buffers (fewer page faults)."""
        out = torch.empty(n, dtype=dtype)
        if n * out.element_size() >= HUGE_MIN_BYTES:
            self.lib.nf_advise_huge(out.data_ptr(), n * out.element_size())
        return out

    # -- shared ---------------------------------------------------------------------------
    def abs_max(self, x: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
        """Per-chunk max |x|: +0 for an all-zero chunk, NaN if the chunk holds a NaN."""
        blocks, out = _blocks(layout), torch.empty(layout.nchunks)
        self.lib.nf_abs_max(_src(x, layout).data_ptr(), blocks.data_ptr(), len(layout.blocks),
                            out.data_ptr())
        return out

    # -- sign -----------------------------------------------------------------------------
    def sign_encode(
        self, x: torch.Tensor, layout: ChunkLayout, bits: bool = True, up: bool = False,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(per-chunk mean |x|, packed bits of x > 0, or x >= 0 with `up`, or None) in one
        visit per chunk; the bits into the first bytes of `out` (uint8) when given."""
        n, blocks = x.numel(), _blocks(layout)
        scales = torch.empty(layout.nchunks)
        packed = None
        if bits:
            nbytes = (n + 7) // 8
            packed = (torch.empty(nbytes, dtype=torch.uint8) if out is None
                      else _dest(out, torch.uint8, nbytes, "sign bits"))
        self.lib.nf_sign_encode(_src(x, layout).data_ptr(), n, blocks.data_ptr(), len(layout.blocks),
                                scales.data_ptr(), _ptr(packed), int(up))
        return scales, packed

    def sign_bits(self, x: torch.Tensor, up: bool = False) -> torch.Tensor:
        """Packed bits of x > 0 (with `up`, x >= 0: exact zeros, -0 too, vote up)."""
        out = torch.empty((x.numel() + 7) // 8, dtype=torch.uint8)
        self.lib.nf_sign_bits(_src(x).data_ptr(), x.numel(), out.data_ptr(), int(up))
        return out

    def sign_decode(self, codes: torch.Tensor, layout: ChunkLayout, scales: torch.Tensor) -> torch.Tensor:
        codes = _need(codes, (layout.numel + 7) // 8, "sign payload")
        scales = _need(scales.float(), 4 * layout.nchunks, "sign scales")
        out = self.empty(layout.numel)
        self.lib.nf_sign_decode(codes.data_ptr(), _blocks(layout).data_ptr(), len(layout.blocks),
                                scales.data_ptr(), out.data_ptr())
        return out

    # -- int8 / int4 ------------------------------------------------------------------------
    def quantize(
        self, x: torch.Tensor, layout: ChunkLayout, inv: torch.Tensor, qmax: int,
        noise: torch.Tensor | None = None, out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """int8 codes clamp(round(x * inv)) per chunk, or clamp(floor(x * inv + noise)); into
        `out` (int8, contiguous, numel elements) when given."""
        inv = _need(inv.float(), 4 * layout.nchunks, "inverse scales")
        if noise is not None:
            noise = _need(noise, 4 * x.numel(), "rounding noise")
        if out is None:
            out = self.empty(x.numel(), torch.int8)
        else:
            out = _dest(out, torch.int8, x.numel(), "int8 codes")
        self.lib.nf_quantize(_src(x, layout).data_ptr(), _ptr(noise), _blocks(layout).data_ptr(),
                             len(layout.blocks), inv.data_ptr(), float(qmax), out.data_ptr())
        return out

    def int_encode(
        self, x: torch.Tensor, layout: ChunkLayout, qmax: int, nibbles: bool = False,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-chunk absmax, uint8 payload of nearest-rounded codes) in one visit per chunk:
        int8 codes one per byte, or with `nibbles` int4 codes (+8) two per byte; the payload
        into the first bytes of `out` (uint8) when given."""
        absmax, n = torch.empty(layout.nchunks), x.numel()
        nbytes = (n + 1) // 2 if nibbles else n
        if out is None:
            out = self.empty(nbytes, torch.uint8)
        else:
            out = _dest(out, torch.uint8, nbytes, "int codes")
        self.lib.nf_int_encode(_src(x, layout).data_ptr(), _blocks(layout).data_ptr(),
                               len(layout.blocks), float(qmax), absmax.data_ptr(),
                               out.data_ptr(), int(nibbles))
        return absmax, out

    def pack_nibbles(self, codes: torch.Tensor) -> torch.Tensor:
        """int4 codes in [-8, 7] -> (code + 8) two per byte, low nibble first."""
        out = torch.empty((codes.numel() + 1) // 2, dtype=torch.uint8)
        self.lib.nf_pack_nibbles(codes.contiguous().data_ptr(), codes.numel(), out.data_ptr())
        return out

    def int_decode(
        self, codes: torch.Tensor, bits: int, qmax: int, layout: ChunkLayout, scales: torch.Tensor
    ) -> torch.Tensor:
        codes = _need(codes, (layout.numel * bits + 7) // 8, f"int{bits} payload")
        scales = _need(scales.float(), 4 * layout.nchunks, f"int{bits} scales")
        out = self.empty(layout.numel)
        self.lib.nf_int_decode(codes.data_ptr(), bits, _blocks(layout).data_ptr(),
                               len(layout.blocks), _int_lut(qmax, bits).data_ptr(),
                               scales.data_ptr(), out.data_ptr())
        return out

    # -- ternary --------------------------------------------------------------------------------
    def ternary_gate(
        self, x: torch.Tensor, layout: ChunkLayout, tau: float,
        sums: bool = False, packed: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Gate |x| >= absmax * tau (and > 0) per chunk: (sum of kept |x|, kept count) when
        `sums`, the base-3 packed votes + 1 when `packed`. Kept sums are torch's own row sums
        (their order follows torch's vector width) over a cache-sized tile of kept |x| the
        kernel writes; with several threads torch may split a row, so then the tile is the
        whole [nchunks, length] block, the very view the torch path sums."""
        n = _src(x, layout).numel()
        totals, counts = (torch.empty(layout.nchunks), torch.empty(layout.nchunks)) if sums else (None, None)
        codes = torch.empty((n + 4) // 5, dtype=torch.uint8) if packed else None
        state = torch.zeros(3, dtype=torch.int64)
        scratch = None
        c = 0
        for b in layout.blocks:
            rows = b.nchunks
            if sums and b.nchunks * b.length > TILE_ELEMS and torch.get_num_threads() == 1:
                rows = max(TILE_ELEMS // b.length, 1)
            if sums and (scratch is None or scratch.numel() < rows * b.length):
                scratch = torch.empty(min(b.nchunks, rows) * b.length)
            for r in range(0, b.nchunks, rows):
                g = min(rows, b.nchunks - r)
                self.lib.nf_ternary_rows(
                    x.data_ptr() + 4 * (b.start + r * b.length), g, b.length, tau, _ptr(scratch),
                    None if counts is None else counts.data_ptr() + 4 * (c + r),
                    _ptr(codes), state.data_ptr(),
                )
                if totals is not None:
                    torch.sum(scratch[: g * b.length].view(g, b.length), dim=1,
                              out=totals[c + r : c + r + g])
            c += b.nchunks
        if codes is not None:
            self.lib.nf_ternary_finish(codes.data_ptr(), state.data_ptr())
        return totals, counts, codes

    def ternary_decode(self, codes: torch.Tensor, layout: ChunkLayout, scales: torch.Tensor) -> torch.Tensor:
        codes = _need(codes, (layout.numel + 4) // 5, "ternary payload")
        scales = _need(scales.float(), 4 * layout.nchunks, "ternary scales")
        out = self.empty(layout.numel)
        self.lib.nf_ternary_decode(codes.data_ptr(), _blocks(layout).data_ptr(),
                                   len(layout.blocks), scales.data_ptr(), out.data_ptr())
        return out

    # -- aggregation ------------------------------------------------------------------------------
    def _shard_ptrs(self, shards: Sequence[torch.Tensor]) -> tuple[ctypes.Array, int]:
        nbytes = shards[0].numel()
        if any(s.dtype != torch.uint8 or s.numel() != nbytes or not s.is_contiguous() for s in shards):
            raise ValueError("shards must be contiguous uint8 tensors of equal length")
        return (ctypes.c_void_p * len(shards))(*[s.data_ptr() for s in shards]), nbytes

    def sum_codes(self, shards: Sequence[torch.Tensor], kind: str, offset: int = 0) -> torch.Tensor:
        """offset + int64 per-element sum over the shards of raw codes: `int8` values, `nibble`s
        (0..15), base-3 `trit` digits or `bit`s; every shard is the same number of bytes."""
        code, per = SUM_KINDS[kind]
        ptrs, nbytes = self._shard_ptrs(shards)
        out = self.empty(nbytes * per, torch.int64)
        self.lib.nf_sum_codes(ptrs, len(shards), nbytes, code, offset, out.data_ptr())
        return out

    def sign_combine(
        self, shards: Sequence[torch.Tensor], keep_count: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed sign votes from W ranks -> (sign(2c - W), or the count c with `keep_count`;
        agreement |2c - W| / W), c = positive votes per element."""
        if len(shards) > 255:
            raise ValueError(f"sign votes combine at most 255 ranks, got {len(shards)}")
        ptrs, nbytes = self._shard_ptrs(shards)
        values, agree = self.empty(8 * nbytes, torch.int64), self.empty(8 * nbytes)
        self.lib.nf_sign_combine(ptrs, len(shards), nbytes, int(keep_count), values.data_ptr(),
                                 agree.data_ptr())
        return values, agree

    def combine_pack(
        self, shards: Sequence[torch.Tensor], kind: str, bits: int, *, offset: int = 0,
        table: torch.Tensor | None = None, tally: Tally | None = None,
    ) -> torch.Tensor:
        """The combined result of the shards' codes, packed at `bits`, in one pass: per element
        the code `table[c]` (int32, one entry per possible sum) or `c + offset`, c = the sum of
        the shards' raw `kind` codes (as `sum_codes`); with a `tally`, the sum of |2c - W| per
        range of it is added to it (the sign vote's agreement)."""
        if bits not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"unsupported code width {bits}")
        code, per = SUM_KINDS[kind]
        ptrs, nbytes = self._shard_ptrs(shards)
        if (nbytes * per * bits) % 8:
            raise ValueError(f"{nbytes * per} codes of {bits} bits do not fill whole bytes")
        if table is not None and (table.dtype != torch.int32 or table.numel() < len(shards) + 1):
            raise ValueError("table must be int32 with one entry per count 0..W")
        out = self.empty(nbytes * per * bits // 8, torch.uint8)
        m = _Margins(tally, nbytes * per)
        self.lib.nf_combine_pack(ptrs, len(shards), nbytes, code, offset, _ptr(table), bits,
                                 m.ends, m.n, out.data_ptr(), m.sums)
        m.add(len(shards))
        return out

    def sign_majority(self, shards: Sequence[torch.Tensor],
                      tally: Tally | None = None) -> torch.Tensor:
        """The sign majority vote of W shards of packed votes (each a multiple of 8 bytes),
        packed as `SignRoute._pack_result` packs it (1 bit for odd W, 2 for even), the sum of
        |2c - W| per range of `tally` added to it; bit-sliced, 64 elements per word."""
        if not 1 <= len(shards) <= 255:
            raise ValueError(f"sign votes combine 1 to 255 ranks, got {len(shards)}")
        ptrs, nbytes = self._shard_ptrs(shards)
        if nbytes % 8:
            raise ValueError(f"shards of {nbytes} bytes: need a multiple of 8")
        bits = 1 if len(shards) % 2 else 2
        out = self.empty(nbytes * bits, torch.uint8)
        m = _Margins(tally, 8 * nbytes)
        self.lib.nf_sign_majority(ptrs, len(shards), nbytes, m.ends, m.n, out.data_ptr(), m.sums)
        m.add(len(shards))
        return out

    def decode_values(
        self, values: torch.Tensor, layout: ChunkLayout, scales: torch.Tensor, mode: int, d: float = 1.0
    ) -> torch.Tensor:
        """Combined int64 values -> float32 with per-chunk scales s: mode 0 `v * s`, 1
        `(v / d) * s`, 2 `((2v - d) / d) * s` (each step rounded to float32, as torch does)."""
        values = values.contiguous()
        if values.dtype != torch.int64 or values.numel() != layout.numel:
            raise ValueError(f"need {layout.numel} int64 values, got {values.numel()} {values.dtype}")
        scales = _need(scales.float(), 4 * layout.nchunks, "scales")
        out = self.empty(layout.numel)
        self.lib.nf_decode_values(values.data_ptr(), _blocks(layout).data_ptr(), len(layout.blocks),
                                  scales.data_ptr(), mode, d, out.data_ptr())
        return out

    def decode_codes(
        self, packed: torch.Tensor, bits: int, layout: ChunkLayout, scales: torch.Tensor,
        mode: int, d: float = 1.0, mul: int = 1, lo: int = 0, out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`decode_values(mul * code + lo)` straight from packed codes (uint8, `bits` per element,
        little-endian; 16/32-bit codes as native words), bit for bit, without the int64 values.
        `out`: a contiguous float32 tensor of `layout.numel` to decode into (e.g. the bucket)."""
        if bits not in (1, 2, 4, 8, 16, 32) or mode not in (0, 1, 2):
            raise ValueError(f"unsupported code width {bits} or decode mode {mode}")
        if packed.dtype != torch.uint8:
            raise ValueError(f"packed codes must be uint8, got {packed.dtype}")
        packed = _need(packed, (layout.numel * bits + 7) // 8, "packed result")
        if packed.data_ptr() % max(bits // 8, 1):
            packed = packed.clone()  # wide codes are read as aligned words
        scales = _need(scales.float(), 4 * layout.nchunks, "scales")
        if out is None:
            out = self.empty(layout.numel)
        else:
            _dest(out, torch.float32, layout.numel, "decode out", exact=True)
        self.lib.nf_decode_codes(packed.data_ptr(), bits, mul, lo, _blocks(layout).data_ptr(),
                                 len(layout.blocks), scales.data_ptr(), mode, d, out.data_ptr())
        return out


    def combine_decode(
        self, shards: Sequence[torch.Tensor], kind: str, layout: ChunkLayout, scales: torch.Tensor,
        mode: int, d: float, out: torch.Tensor, *, offset: int = 0,
        values: torch.Tensor | None = None, tally: Tally | None = None,
    ) -> None:
        """Decode into `out` (float32, `layout.numel`) the combined value of every element of
        the shards' raw `kind` codes, `values[c]` (one per possible sum c) or `c + offset`,
        scaled per chunk as `decode_codes` scales (mode, d): `combine_pack` then
        `decode_codes`, bit for bit, without the packed result. With a `tally`, the sum of
        |2c - W| per range of it is added to it."""
        code, per = SUM_KINDS[kind]
        ptrs, nbytes = self._shard_ptrs(shards)
        if nbytes * per < layout.numel:
            raise ValueError(f"{nbytes * per} codes for a layout of {layout.numel}")
        if values is not None:
            values = values.to(torch.int64).contiguous()
            if values.numel() < len(shards) + 1:
                raise ValueError("values must have one entry per count 0..W")
        scales = _need(scales.float(), 4 * layout.nchunks, "scales")
        _dest(out, torch.float32, layout.numel, "decode out", exact=True)
        m = _Margins(tally, layout.numel)
        self.lib.nf_combine_decode(ptrs, len(shards), nbytes, code, offset, _ptr(values),
                                   _blocks(layout).data_ptr(), len(layout.blocks),
                                   scales.data_ptr(), mode, d, layout.numel, out.data_ptr(),
                                   m.ends, m.n, m.sums)
        m.add(len(shards))


    def combine_decode_local(
        self, shards: Sequence[torch.Tensor], kind: str, offset: int, inv: float,
        layout: ChunkLayout, scales: torch.Tensor, out: torch.Tensor,
    ) -> None:
        """Decode into `out` (float32, `layout.numel`) the mean over the W shards, in rank
        order, of each one's codes (raw `kind` code + `offset`) decoded on its own per-chunk
        scales (`scales`: W rows): (sum_r ((q_r * inv) * s_r)) / W, as torch computes it."""
        code, per = SUM_KINDS[kind]
        ptrs, nbytes = self._shard_ptrs(shards)
        if nbytes * per < layout.numel:
            raise ValueError(f"{nbytes * per} codes for a layout of {layout.numel}")
        scales = _need(scales.float(), 4 * len(shards) * layout.nchunks, "scales")
        _dest(out, torch.float32, layout.numel, "decode out", exact=True)
        self.lib.nf_combine_decode_local(ptrs, len(shards), nbytes, code, offset, inv,
                                         _blocks(layout).data_ptr(), len(layout.blocks),
                                         layout.nchunks, scales.data_ptr(), layout.numel,
                                         out.data_ptr())


def _check_torch_agrees(k: Kernels) -> str | None:
    """The kernels mirror four torch behaviours that IEEE rules alone do not fix; confirm them
    on this torch build. Returns what disagrees, or None."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(11 * 1000 + 3, generator=gen) * torch.rand(11 * 1000 + 3, generator=gen) ** 4
    layout = chunk_layout((x.numel(),), 1000)
    ref = layout.reduce(x, lambda v: torch.linalg.vector_norm(v, ord=1, dim=1) / v.shape[1])
    if not torch.equal(k.sign_encode(x, layout, bits=False)[0], ref):
        return "torch.linalg.vector_norm(ord=1) no longer sums left to right in float32"
    if torch.full((33,), float("nan")).to(torch.int8).any():
        return "torch casts NaN to a non-zero int8"
    a = x.abs() + 1e-30
    if not torch.equal(127 / a, a.reciprocal() * 127):
        return "torch's `int / tensor` is no longer reciprocal-then-multiply"
    if not torch.equal(a * 0.3, a * torch.tensor(0.3, dtype=torch.float32)):
        return "torch's `tensor * float` no longer multiplies in float32"
    return None


_lock = threading.RLock()
_loaded: dict[str, tuple[Kernels | None, str]] = {}


def _load_one(isa: str) -> tuple[Kernels | None, str]:
    """Build, load and check one variant: (kernels or None, why)."""
    try:
        kernels = Kernels(ctypes.CDLL(str(build(isa))))
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        detail = (getattr(exc, "stderr", b"") or b"").decode(errors="replace").strip()
        return None, f"torch fallback: native {isa} build failed: {exc} {detail[:300]}".strip()
    problem = _check_torch_agrees(kernels)
    if problem is not None:
        return None, f"torch fallback: {problem}"
    return kernels, f"native ({kernels.isa})"


def variant(isa: str) -> Kernels | None:
    """One build of the kernels (a key of ISA_FLAGS), or None where it cannot run."""
    if isa not in _loaded:
        with _lock:
            if isa == "avx2" and isa not in _loaded:
                base = variant("baseline")
                if base is None:
                    _loaded[isa] = _loaded["baseline"]
                elif not base.lib.nf_cpu_has_avx2():
                    _loaded[isa] = (None, "torch fallback: no AVX2 on this CPU")
            if isa not in _loaded:
                _loaded[isa] = _load_one(isa)
    return _loaded[isa][0]


def _choose() -> tuple[Kernels | None, str]:
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return None, f"torch fallback: {DISABLE_ENV}={os.environ[DISABLE_ENV]}"
    isa = os.environ.get(ISA_ENV, "")
    if isa not in ISA_FLAGS:
        isa = "avx2" if variant("avx2") is not None else "baseline"
    variant(isa)
    return _loaded[isa]


def native(t: torch.Tensor | None = None) -> Kernels | None:
    """The fastest native kernels that run here, or None when the torch fallback must run:
    always for a tensor `t` off the CPU (the kernels read host memory; the torch path runs on
    any device)."""
    if t is not None and t.device.type != "cpu":
        return None
    return _choose()[0]


def status() -> str:
    """'native (avx2)', 'native (sse2)', 'native (portable)' or 'torch fallback: <why>'."""
    return _choose()[1]
