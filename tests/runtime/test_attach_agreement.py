"""Every rank attaches the same fabric: a rank with another total_steps, profile or seed is
refused at attach, in one line on every rank, not far into the run in a gloo abort."""

from __future__ import annotations

import pytest
from torch.nn.parallel import DistributedDataParallel as DDP

from nfabric_cli.binding import static_profile
from nfabric_cli.errors import InputError
from nfabric_cli.profile import parse_phases
from nfabric_cli.runtime.attach import attach
from tests.distutil import run_ranks
from tests.runtime.models import make_model


def _attach(rank: int, world: int, case: str) -> str:
    model = make_model()
    ddp = DDP(model)
    route = "int8" if case == "profile" and rank == 1 else "sign"
    profile = static_profile(model, route, [("head.*", "fp32")], parse_phases("0.5"))
    steps = 6 if case == "total_steps" and rank == 1 else 10
    seed = rank if case == "seed" else 0
    try:
        state = attach(ddp, profile, total_steps=steps, seed=seed)
    except InputError as exc:
        return str(exc)
    state.close()
    return "attached"


@pytest.mark.parametrize(("case", "what", "values"), [
    ("total_steps", "total_steps", "10 on rank 0, 6 on rank 1"),
    ("seed", "seed", "0 on rank 0, 1 on rank 1"),
    ("profile", "the profile's routes and phases", "digest "),
    ("same", None, None),
])  # fmt: skip
def test_ranks_that_attach_different_fabrics_are_refused_on_every_rank(case, what, values):
    results = run_ranks(_attach, 2, case)
    if what is None:
        assert results == ["attached", "attached"]
        return
    assert results[0] == results[1]  # the same line on both ranks
    assert results[0].startswith(f"ranks attach different fabrics: {what} differ (")
    assert values in results[0]
    assert "\n" not in results[0]


def test_a_seed_that_is_not_an_integer_is_refused() -> None:
    assert run_ranks(_seed_a, 1) == ["seed must be an integer, got 'a'"]


def _seed_a(rank: int, world: int) -> str:
    model = make_model()
    try:
        attach(DDP(model), static_profile(model, "sign"), total_steps=4, seed="a")
    except InputError as exc:
        return str(exc)
    return "attached"
