"""`sign` (G-Binary, sign-count): 1 bit per element on the way in.

Each rank sends the packed bits of g > 0 and its per-chunk mean |g|; ranks agree on the mean
scale. An exact zero has no sign: it votes as the rank's noise says (`base.zero_vote`, under
the spec's default ``zeros = "split"``: half the ranks up, half down, alternating each step,
so an element without a gradient on any rank ties at an even world size and stays put), or
down on every rank (``zeros = "negative"``, the rule profiles of schema 1.0 were proven with).
The reducer counts positive votes per element, c in [0, W]:
- `majority` (default): the result is sign(2c - W). Tie rule: with an even world size a tie
  (c = W/2) gives 0, i.e. no update for that element; so the result travels in 1 bit for odd W
  and 2 bits for even W. Every rank decodes scale * result.
- `count`: the result is the count itself, decoded as scale * (2c - W) / W (a scaled vote mean).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nfabric_cli.routes import kernels
from nfabric_cli.routes.base import (
    CodeRoute,
    Noise,
    Payload,
    Segments,
    ZeroVote,
    check_input,
    codec_noise,
)
from nfabric_cli.routes.chunks import ChunkLayout, check_segments, chunk_layout
from nfabric_cli.routes.packing import pack_bool, unpack_bool
from nfabric_cli.routes.tally import Sink, Tally


class SignRoute(CodeRoute):
    name = "sign"
    elems_per_byte = 8
    scale_agreement = "mean"
    max_world_size = 255  # counts are combined in uint8 range

    def local_scales(self, x: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
        k = kernels.native(x)
        if k is not None:
            return k.sign_encode(x, layout, bits=False)[0]
        # vector_norm(ord=1) sums left to right in float32; the native kernel does the same.
        return layout.reduce(
            x, lambda v: torch.linalg.vector_norm(v, ord=1, dim=1) / v.shape[1]
        )

    def encode_codes(self, x, layout, scales, gen, out=None):  # noqa: ANN001 - see CodeRoute
        k, up = kernels.native(x), _zeros_up(gen)
        return k.sign_bits(x, up) if k is not None else pack_bool(x >= 0 if up else x > 0)

    def default_noise(self, rank: int) -> Noise:
        return codec_noise(self.spec, 0, 0, rank, (), ())  # step 0's zero vote, if split

    def encode(
        self, x: torch.Tensor, segments: Segments = None, noise: Noise = None,
        out: torch.Tensor | None = None,
    ) -> Payload:
        """Scales and bits in one visit per chunk (same bytes as `CodeRoute.encode`); the
        native kernel writes the bits into `out` when given (the exchange's wire buffer: no
        copy, no fresh pages), the torch path into new memory."""
        k = kernels.native(x)
        if k is None:
            return super().encode(x, segments, noise, out)
        x = check_input(x).float()
        segs = check_segments(x.numel(), segments)
        scales, bits = k.sign_encode(x, chunk_layout(segs, self.spec.effective_chunk),
                                     up=_zeros_up(noise), out=out)
        return Payload(bits, scales, x.numel(), segs)

    def combine(
        self, shards: Sequence[torch.Tensor], world_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k = kernels.native(shards[0])
        if k is not None:
            return k.sign_combine(shards, keep_count=self.spec.mode == "count")
        n = shards[0].numel() * 8
        count = unpack_bool(shards[0], n).to(torch.int64)
        for s in shards[1:]:
            count += unpack_bool(s, n)
        margin = 2 * count - world_size
        # Agreement |2c/W - 1|: 1 when unanimous, near 0 when the votes are coin flips.
        agree = margin.abs().float() / world_size
        return (count if self.spec.mode == "count" else torch.sign(margin)), agree

    def combine_packed(
        self, shards: Sequence[torch.Tensor], world_size: int, valid: int,
        stats: Sink | None,
    ) -> torch.Tensor:
        """The majority vote natively bit-sliced (64 votes per word op); else as CodeRoute."""
        k = kernels.native(shards[0])
        if k is None or self.spec.mode != "majority":
            return super().combine_packed(shards, world_size, valid, stats)
        return k.sign_majority(shards, Tally.of(stats, valid))

    def silent_margin(self, world_size: int) -> int:
        """An element no rank has a gradient for: under "split" half the ranks vote it up (a
        tie, margin 0) at an even world size, one more or one fewer at an odd one (margin 1);
        under "negative" all vote it down (margin W)."""
        return world_size % 2 if self.spec.zeros == "split" else world_size

    def native_combine(self, world_size: int) -> tuple[str, torch.Tensor]:
        counts = torch.arange(world_size + 1)
        return "bit", counts if self.spec.mode == "count" else torch.sign(2 * counts - world_size)

    def result_range(self, world_size: int) -> tuple[int, int]:
        if self.spec.mode == "count":
            return 0, world_size
        return -1, 1

    def result_bits(self, world_size: int) -> int:
        if self.spec.mode == "majority" and world_size % 2 == 1:
            return 1  # no ties possible: the result is +-1
        return super().result_bits(world_size)

    def _pack_result(self, values: torch.Tensor, world_size: int) -> torch.Tensor:
        if self.spec.mode == "majority" and world_size % 2 == 1:
            return pack_bool(values > 0)
        return super()._pack_result(values, world_size)

    def result_map(self, world_size: int) -> tuple[int, int]:
        if self.spec.mode == "majority" and world_size % 2 == 1:
            return 2, -1  # bit 1 is +1, bit 0 is -1
        return super().result_map(world_size)

    def decode_mode(self, scales: torch.Tensor, world_size: int) -> tuple[torch.Tensor, int, float]:
        return (scales, 2, float(world_size)) if self.spec.mode == "count" else (scales, 0, 1.0)

    def _decode_values_torch(
        self, values: torch.Tensor, scales: torch.Tensor, layout: ChunkLayout, world_size: int
    ) -> torch.Tensor:
        v = values.float()
        if self.spec.mode == "count":
            v = (2 * v - world_size) / world_size
        return layout.scale_into(v, scales, torch.empty(values.numel(), device=values.device))

    def local_decode(self, payload: Payload, layout: ChunkLayout) -> torch.Tensor:
        k = kernels.native(payload.codes)
        if k is not None:
            return k.sign_decode(payload.codes, layout, payload.scales)
        bits = unpack_bool(payload.codes, payload.numel).float()
        return layout.scale_into(bits * 2 - 1, payload.scales, torch.empty_like(bits))


def _zeros_up(noise: Noise) -> bool:
    """Whether exact zeros vote up (a 1 bit): only where the noise is an up `ZeroVote`."""
    return isinstance(noise, ZeroVote) and noise.up
