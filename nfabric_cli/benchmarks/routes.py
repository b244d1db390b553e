"""Codec throughput per route against a plain read pass over the same buffer, in one run.

Throughput is GB/s of fp32 *input* (4 bytes per element) on one thread; the read pass
(`x.sum()`) is the memory-speed reference, so ratios stay meaningful on a noisy machine. Each
round times, per route, a read pass, the encode and the decode back to back, and every timing
keeps its best over the rounds; a route's ratios divide by the best read pass timed next to
it (as many samples as the codec got), so a quiet moment or a burst of load from other
processes favours neither side. `read_gbps` is the best read pass of the whole run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch

from nfabric_cli.routes import ROUTE_NAMES, kernels, make_route


def _time(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_routes(
    size: int = 1 << 24,
    repeats: int = 5,
    routes: tuple[str, ...] = ROUTE_NAMES,
    native: bool = True,
) -> dict:
    """Encode/decode GB/s per route and the read-pass GB/s, measured side by side.

    `native=False` times the pure-torch codecs (as with NFABRIC_NO_NATIVE=1)."""
    prev_threads, prev_env = torch.get_num_threads(), os.environ.get(kernels.DISABLE_ENV)
    torch.set_num_threads(1)
    os.environ[kernels.DISABLE_ENV] = "0" if native else "1"
    try:
        x = torch.randn(size, generator=torch.Generator().manual_seed(0))
        gb = size * 4 / 1e9
        codecs = {name: make_route(name) for name in routes}
        payloads = {name: r.encode(x) for name, r in codecs.items()}  # warm-up
        best: dict[str, float] = {}

        def keep(key: str, seconds: float) -> None:
            best[key] = min(best.get(key, float("inf")), seconds)

        x.sum()
        for _ in range(repeats):
            for name, route in codecs.items():
                keep(f"{name}.read", _time(x.sum))
                keep(f"{name}.encode", _time(lambda r=route: r.encode(x)))
                keep(f"{name}.decode", _time(lambda r=route, p=payloads[name]: r.decode(p)))
        read = gb / min(best[f"{name}.read"] for name in routes)
        out: dict[str, Any] = {
            "size": size, "threads": 1, "kernels": kernels.status(), "read_gbps": read,
            "routes": {},
        }
        for name in routes:
            enc, dec = gb / best[f"{name}.encode"], gb / best[f"{name}.decode"]
            beside = gb / best[f"{name}.read"]  # the read pass timed next to this route
            out["routes"][name] = {
                "read_gbps": beside,
                "encode_gbps": enc,
                "decode_gbps": dec,
                "encode_vs_read": enc / beside,
                "decode_vs_read": dec / beside,
                "payload_bytes": payloads[name].nbytes,
            }
        return out
    finally:
        torch.set_num_threads(prev_threads)
        if prev_env is None:
            os.environ.pop(kernels.DISABLE_ENV, None)
        else:
            os.environ[kernels.DISABLE_ENV] = prev_env
