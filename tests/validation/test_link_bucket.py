"""The shaped link's token bucket: small, so a link emulates its rate for bursts too."""

from __future__ import annotations

import pytest

from nfabric_cli.ranks.netns import burst_bytes


@pytest.mark.parametrize(("mbit", "bucket"), [(20, 65536), (50, 65536), (500, 65536),
                                              (1000, 125_000), (10_000, 1_250_000)])
def test_the_bucket_holds_1_ms_at_the_rate_and_at_least_one_gso_segment(mbit: float,
                                                                       bucket: int) -> None:
    """1 ms at the rate, at least 64 KiB. At 10 ms, 500 Mbit/s held 625 KB, about one fp32
    step of the transformer at two ranks, which then crossed at loopback speed after any idle
    stretch (`burst_bytes`'s docstring)."""
    assert burst_bytes(mbit) == bucket


def test_the_bucket_is_a_small_part_of_an_fp32_step_at_500_mbit() -> None:
    fp32_step = 800_000  # transformer, W = 2: bytes through `lo` per fp32 step
    assert burst_bytes(500) < fp32_step / 10  # was 625 000 at 10 ms
