"""The routes' torch path on CUDA tensors (the native kernels are the CPU fast path): every
route reduces on the gradients' device and agrees with the CPU within its rounding.

Runs only where torch sees a GPU: on a machine without one these tests are skipped, and
nothing here counts as checked (docs/capacity.md, "On a GPU"). Bit-for-bit agreement with
the CPU is not asked for: CUDA reductions (the chunk scales' mean |g|) sum in another order,
so a scale may differ in its last bits, and a code on a rounding boundary by one step."""

from __future__ import annotations

import pytest
import torch

from nfabric_cli.routes import RouteSpec, make_route

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

SPECS = [RouteSpec("sign"), RouteSpec("sign", chunk=12), RouteSpec("int8"),
         RouteSpec("int8", rounding="stochastic", chunk=100), RouteSpec("int4"),
         RouteSpec("ternary"), RouteSpec("fp16"), RouteSpec("bf16"), RouteSpec("fp32")]


#: one code step per route, relative to the gradients' largest |g| (the chunk scale's bound):
#: a code on a rounding boundary may land one step over when the scale differs in its last bits
STEP = {"sign": 1e-5, "fp32": 1e-6, "fp16": 1e-3, "bf16": 1e-2, "int8": 2 / 127, "int4": 2 / 7,
        "ternary": 1.0}


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label())
@pytest.mark.parametrize("world", [2, 3, 4])
def test_route_reduces_on_the_gpu_as_on_the_cpu(spec: RouteSpec, world: int) -> None:
    route = make_route(spec)
    gen = torch.Generator().manual_seed(world)
    segments = (5, 9000, 1, 7001, 2)
    n = sum(segments)
    grads = [torch.randn(n, generator=gen) * (r + 1) for r in range(world)]
    for g in grads:
        g[::97] = 0.0

    def noise() -> list[torch.Generator]:  # the same draws for both devices (stochastic int8)
        return [torch.Generator().manual_seed(100 + r) for r in range(world)]

    cpu = route.simulate([g.clone() for g in grads], segments, None, noise())
    gpu = route.simulate([g.cuda() for g in grads], segments, None, noise())
    assert gpu.device.type == "cuda" and gpu.dtype == torch.float32
    assert torch.isfinite(gpu).all()
    diff = (gpu.cpu() - cpu).abs()
    top = max(float(g.abs().max()) for g in grads)
    # all within one code step, and nearly all equal but for the scales' last bits
    assert float(diff.max()) <= STEP[spec.name] * top, spec.label()
    assert float((diff <= 1e-5 * top).float().mean()) >= 0.99, spec.label()
