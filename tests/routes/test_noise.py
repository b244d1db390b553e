"""Stochastic rounding noise: per parameter, independent of grouping, off the global RNG."""

from __future__ import annotations

import torch

from nfabric_cli.routes import make_route
from nfabric_cli.routes.base import ZeroVote, codec_noise
from nfabric_cli.routes.spec import RouteSpec


def test_stochastic_noise_is_per_parameter_whatever_the_grouping() -> None:
    """The hook reduces per bucket, the simulator per model-wide group: each parameter's noise
    depends only on (seed, step, rank, name), and the global RNG is left alone."""
    spec = RouteSpec("int8", rounding="stochastic")
    before = torch.get_rng_state()
    ab = codec_noise(spec, 3, 5, 1, ["a", "b"], [4, 6])
    ba = codec_noise(spec, 3, 5, 1, ["b", "a"], [6, 4])
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(ab[:4], ba[6:]) and torch.equal(ab[4:], ba[:6])
    assert torch.equal(codec_noise(spec, 3, 5, 1, ["a"], [4]), ab[:4])
    assert not torch.equal(codec_noise(spec, 3, 5, 2, ["a", "b"], [4, 6]), ab)  # other rank
    assert not torch.equal(codec_noise(spec, 3, 6, 1, ["a", "b"], [4, 6]), ab)  # other step
    assert codec_noise(RouteSpec("int8"), 3, 5, 1, ["a"], [4]) is None
    # sign's noise is its vote for exact zeros: up where rank + step is even ("split"), none
    # (down on every rank) under the rule of schema-1.0 profiles
    assert codec_noise(RouteSpec("sign"), 3, 5, 1, ["a"], [4]) == ZeroVote(True)
    assert codec_noise(RouteSpec("sign"), 3, 5, 2, ["a"], [4]) == ZeroVote(False)
    assert codec_noise(RouteSpec("sign"), 3, 6, 2, ["a"], [4]) == ZeroVote(True)
    assert codec_noise(RouteSpec("sign", zeros="negative"), 3, 5, 1, ["a"], [4]) is None
    # the noise is what the codec adds: a passed tensor equals drawing it from a generator
    route = make_route(spec)
    x = torch.randn(10, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(11)
    drawn = torch.rand(10, generator=torch.Generator().manual_seed(11))
    assert torch.equal(route.roundtrip(x, None, gen), route.roundtrip(x, None, drawn))
