"""`ternary` (G-Ternary): gated {-1, 0, +1} votes, base-3 packed at 1.6 bits per element.

Per chunk, elements with |g| < tau * absmax are gated to 0; the rest send their sign. The
chunk's scale is the mean |g| of the elements that passed the gate, so scale * sign keeps the
magnitude of what was sent. Ranks agree on the mean scale; the reducer sums votes exactly
(range [-W, W]) and every rank decodes mean_scale * votes / W.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nfabric_cli.routes import kernels
from nfabric_cli.routes.base import CodeRoute, Noise, Payload, Segments, check_input
from nfabric_cli.routes.chunks import ChunkLayout, check_segments, chunk_layout
from nfabric_cli.routes.packing import pack_trits, unpack_trits

# Kept counts are summed by torch in float32; the native kernel counts exactly. They agree while
# a chunk has at most 2**24 elements, so longer chunks take the torch path.
_NATIVE_MAX_CHUNK = 1 << 24


class TernaryRoute(CodeRoute):
    name = "ternary"
    elems_per_byte = 5
    pad_byte = 121  # five digits of 1, i.e. five zero votes
    scale_agreement = "mean"
    max_world_size = 127  # votes are combined in int8 range

    def _native(self, layout: ChunkLayout, t: torch.Tensor) -> kernels.Kernels | None:
        k = kernels.native(t)
        if k is None or max((b.length for b in layout.blocks), default=0) > _NATIVE_MAX_CHUNK:
            return None
        return k

    def _gate(self, x: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
        # The native gate computes the same threshold in float32 (kernels.ternary_gate).
        thresh = layout.reduce(x, lambda v: v.abs().amax(dim=1)) * self.spec.tau
        mag = x.abs()
        per_elem = layout.scale_into(torch.ones_like(x), thresh, torch.empty_like(x))
        return torch.le(per_elem, mag) & (mag > 0)

    def local_scales(self, x: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
        k = self._native(layout, x)
        if k is not None:
            total, count, _ = k.ternary_gate(x, layout, self.spec.tau, sums=True)
            return total / count.clamp_min(1.0)
        keep = self._gate(x, layout)
        kept = torch.where(keep, x.abs(), torch.zeros_like(x))
        total = layout.reduce(kept, lambda v: v.sum(dim=1))
        count = layout.reduce(keep.float(), lambda v: v.sum(dim=1))
        return total / count.clamp_min(1.0)

    def _votes(self, x: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
        keep = self._gate(x, layout)
        return torch.where(keep, torch.sign(x), torch.zeros_like(x)).to(torch.int8)

    def encode_codes(self, x, layout, scales, gen, out=None):  # noqa: ANN001 - see CodeRoute
        k = self._native(layout, x)
        if k is not None:
            return k.ternary_gate(x, layout, self.spec.tau, packed=True)[2]
        return pack_trits((self._votes(x, layout) + 1).view(torch.uint8))

    def encode(
        self, x: torch.Tensor, segments: Segments = None, noise: Noise = None,
        out: torch.Tensor | None = None,
    ) -> Payload:
        """Gate once for scales and codes (same bytes as `CodeRoute.encode`); the codes are
        new memory (`out` is not used)."""
        x = check_input(x).float()
        segs = check_segments(x.numel(), segments)
        layout = chunk_layout(segs, self.spec.effective_chunk)
        k = self._native(layout, x)
        if k is None:
            return super().encode(x, segments, noise)
        total, count, codes = k.ternary_gate(x, layout, self.spec.tau, sums=True, packed=True)
        return Payload(codes, total / count.clamp_min(1.0), x.numel(), segs)

    def payload_nbytes(self, numel: int) -> int:
        return (numel + 4) // 5

    def combine(self, shards: Sequence[torch.Tensor], world_size: int) -> tuple[torch.Tensor, None]:
        k = kernels.native(shards[0])
        if k is not None:
            return k.sum_codes(shards, "trit", offset=-len(shards)), None
        n = shards[0].numel() * 5
        total = unpack_trits(shards[0], n).to(torch.int64)
        for s in shards[1:]:
            total += unpack_trits(s, n)
        return total - len(shards), None

    def native_combine(self, world_size: int) -> tuple[str, int]:
        return "trit", -world_size  # digits hold vote + 1

    def result_range(self, world_size: int) -> tuple[int, int]:
        return -world_size, world_size

    def _decode_values_torch(
        self, values: torch.Tensor, scales: torch.Tensor, layout: ChunkLayout, world_size: int
    ) -> torch.Tensor:
        return layout.scale_into(values.float(), scales / world_size,
                                 torch.empty(values.numel(), device=values.device))

    def decode_mode(self, scales: torch.Tensor, world_size: int) -> tuple[torch.Tensor, int, float]:
        return scales / world_size, 0, 1.0

    def local_decode(self, payload: Payload, layout: ChunkLayout) -> torch.Tensor:
        k = kernels.native(payload.codes)
        if k is not None:
            return k.ternary_decode(payload.codes, layout, payload.scales)
        votes = unpack_trits(payload.codes, payload.numel).float() - 1.0
        return layout.scale_into(votes, payload.scales, torch.empty_like(votes))
