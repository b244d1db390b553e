"""Codec throughput per route against a plain read pass over the same buffer, in one run.

Throughput is GB/s of fp32 *input* (4 bytes per element) on one thread; the read pass
(`x.sum()`) is the memory-speed reference, so ratios stay meaningful on a noisy machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from nfabric_cli.routes import ROUTE_NAMES, make_route


def _best_time(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_routes(size: int = 1 << 24, repeats: int = 5, routes: tuple[str, ...] = ROUTE_NAMES) -> dict:
    """Encode/decode GB/s per route and the read-pass GB/s, measured side by side."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(size, generator=torch.Generator().manual_seed(0))
        gb = size * 4 / 1e9
        read = gb / _best_time(lambda: x.sum(), repeats)
        out: dict[str, Any] = {"size": size, "threads": 1, "read_gbps": read, "routes": {}}
        for name in routes:
            route = make_route(name)
            payload = route.encode(x)
            enc = gb / _best_time(lambda r=route: r.encode(x), repeats)
            dec = gb / _best_time(lambda r=route, p=payload: r.decode(p), repeats)
            out["routes"][name] = {
                "encode_gbps": enc,
                "decode_gbps": dec,
                "encode_vs_read": enc / read,
                "decode_vs_read": dec / read,
                "payload_bytes": payload.nbytes,
            }
        return out
    finally:
        torch.set_num_threads(prev)
