"""`glyphs`: a 1M-parameter residual CNN on 128 letter classes rendered from bundled fonts.

The built-in vision workload where the problem nfabric exists to solve shows: with 128
classes, static 1-bit aggregation of every gradient collapses accuracy (the classifier head's
gradient is a few large rows per batch; sign sends every element at the chunk's mean
magnitude), while the head on a wider route recovers it. Data: `glyphs_data.py` (offline,
deterministic, test fonts never seen in training). Model: the `vision` ResNet with four stages
(16, 48, 96, 256 channels at 24, 12, 6, 3 px): about 1.03M parameters, most of them in the
last stage, where the spatial size keeps them cheap.

1200 steps by default (about 12 epochs): at 600 the runs had not settled, and two fp32 runs
differing only in their summation order ended up to 5.7 points apart on the held-out fonts,
more than any tolerance worth checking; at 1200 they end within a point
(`python -m bench.noise_floor`).
"""

from __future__ import annotations

from nfabric_cli.workloads.glyphs_data import load_glyphs
from nfabric_cli.workloads.vision import ImageWorkload

WIDTHS = (16, 48, 96, 256)


class GlyphsWorkload(ImageWorkload):
    """Residual CNN, 128 glyph classes 24x24, split by font; metric: test accuracy."""

    name = "glyphs"

    def __init__(self) -> None:
        super().__init__(load_glyphs(), WIDTHS, default_steps=1200, batch_size=32, lr=0.2,
                         description="residual CNN (1M), 128 font glyph classes 24x24")
