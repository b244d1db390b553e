"""Codec throughput per route against a plain read pass over the same buffer, in one run.

Throughput is GB/s of fp32 *input* (4 bytes per element) on one thread; the read pass
(`x.sum()`) is the memory-speed reference, so ratios stay meaningful on a noisy machine. Each
round times, per route, a read pass, the encode and the decode back to back, and every timing
keeps its best over the rounds; a route's ratios divide by the best read pass timed next to
it (as many samples as the codec got), so a quiet moment or a burst of load from other
processes favours neither side. `read_gbps` is the best read pass of the whole run.

Low-bit routes also report `reduce_decode_gbps`: what every rank does after a `reduce`, the
packed combined result of `world_size` ranks (each rank's gradient a rotation of the buffer)
decoded with the agreed scales to fp32, GB/s of fp32 out. Its result codes are wider than the
payload (e.g. 2 bits for sign over 4 ranks), so it is not the same pass as `decode`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch

from nfabric_cli.routes import ROUTE_NAMES, kernels, make_route
from nfabric_cli.routes.base import CodeRoute
from nfabric_cli.routes.chunks import chunk_layout


def _time(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _combined(route: CodeRoute, x: torch.Tensor, world_size: int) -> Callable[[], torch.Tensor]:
    """The reduce path's decode of `world_size` ranks' combined result, ready to time."""
    n = x.numel()
    layout = chunk_layout((n,), route.spec.effective_chunk)
    padded, _ = route._sizes(n, world_size)
    payloads = [route.encode(torch.roll(x, 7919 * r)) for r in range(world_size)]
    values, _ = route.combine([route._pad(p.codes, padded) for p in payloads], world_size)
    packed = route._pack_result(values, world_size)
    scales = payloads[0].scales
    return lambda: route._decode_result(packed, n, world_size, scales, layout)


def bench_routes(
    size: int = 1 << 24,
    repeats: int = 5,
    routes: tuple[str, ...] = ROUTE_NAMES,
    native: bool = True,
    world_size: int = 4,
) -> dict:
    """Encode/decode GB/s per route, the reduce-path decode of `world_size` ranks' combined
    result for low-bit routes, and the read-pass GB/s, measured side by side.

    `native=False` times the pure-torch codecs (as with NFABRIC_NO_NATIVE=1)."""
    prev_threads, prev_env = torch.get_num_threads(), os.environ.get(kernels.DISABLE_ENV)
    torch.set_num_threads(1)
    os.environ[kernels.DISABLE_ENV] = "0" if native else "1"
    try:
        x = torch.randn(size, generator=torch.Generator().manual_seed(0))
        gb = size * 4 / 1e9
        codecs = {name: make_route(name) for name in routes}
        payloads = {name: r.encode(x) for name, r in codecs.items()}  # warm-up
        reduce_decode = {
            name: _combined(r, x, world_size) for name, r in codecs.items()
            if isinstance(r, CodeRoute) and world_size > 1
        }
        best: dict[str, float] = {}

        def keep(key: str, seconds: float) -> None:
            best[key] = min(best.get(key, float("inf")), seconds)

        x.sum()
        for _ in range(repeats):
            for name, route in codecs.items():
                keep(f"{name}.read", _time(x.sum))
                keep(f"{name}.encode", _time(lambda r=route: r.encode(x)))
                keep(f"{name}.decode", _time(lambda r=route, p=payloads[name]: r.decode(p)))
                if name in reduce_decode:
                    keep(f"{name}.reduce_decode", _time(reduce_decode[name]))
        read = gb / min(best[f"{name}.read"] for name in routes)
        out: dict[str, Any] = {
            "size": size, "threads": 1, "kernels": kernels.status(), "read_gbps": read,
            "world_size": world_size, "routes": {},
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
            if name in reduce_decode:
                red = gb / best[f"{name}.reduce_decode"]
                out["routes"][name].update(reduce_decode_gbps=red, reduce_decode_vs_read=red / beside)
        return out
    finally:
        torch.set_num_threads(prev_threads)
        if prev_env is None:
            os.environ.pop(kernels.DISABLE_ENV, None)
        else:
            os.environ[kernels.DISABLE_ENV] = prev_env
