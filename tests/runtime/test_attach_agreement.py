"""Every rank attaches the same fabric: a rank with another total_steps, profile, thresholds
or options is refused at attach, in one line on every rank (not far into the run, in a gloo
abort), and a rank whose own attach fails takes the others down with it (not a hang)."""

from __future__ import annotations

import numpy
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
    if case == "health" and rank == 1:
        profile.meta["health"] = {"loss_spike": 4.0}
    steps = {"total_steps": 6, "failed": 0}.get(case, 10) if rank == 1 else 10
    options = {"monitor": False} if case == "options" and rank == 1 else {}
    try:
        state = attach(ddp, profile, total_steps=steps, seed=rank, **options)  # seeds may differ
    except InputError as exc:
        return str(exc)
    state.close()
    return "attached"


@pytest.mark.parametrize(("case", "what", "values"), [
    ("total_steps", "total_steps", "(10 on rank 0, 6 on rank 1)"),
    ("profile", "the profile's routes, phases and bucket verdicts", "(digest "),
    ("health", "the health thresholds", "(digest "),
    ("options", "the options (monitor, gate, nonfinite, dedicated_group)", "(digest "),
    ("same", None, None),
])  # fmt: skip
def test_ranks_that_attach_different_fabrics_are_refused_on_every_rank(case, what, values):
    results = run_ranks(_attach, 2, case)
    if what is None:
        assert results == ["attached", "attached"]
        return
    assert results[0] == results[1]  # the same line on both ranks
    assert results[0].startswith(f"ranks attach different fabrics: {what} differ {values}")
    assert "\n" not in results[0]


def test_a_rank_whose_attach_fails_takes_the_others_with_it() -> None:
    # rank 1's loader says 0 steps: it raises its own error, rank 0 does not wait for it
    assert run_ranks(_attach, 2, "failed") == [
        "rank 1 could not attach (its own error says why), so no rank attaches",
        "total steps must be a whole number >= 1, got 0"]


def test_a_seed_that_is_not_an_integer_is_refused_and_a_numpy_one_taken() -> None:
    assert run_ranks(_seed, 1, "a") == ["seed must be an integer, got 'a'"]
    assert run_ranks(_seed, 1, True) == ["seed must be an integer, got True"]
    assert run_ranks(_seed, 1, numpy.int64(3)) == ["attached"]  # a numpy integer is one


def _seed(rank: int, world: int, seed: object) -> str:
    model = make_model()
    try:
        attach(DDP(model), static_profile(model, "sign"), total_steps=4, seed=seed).close()
    except InputError as exc:
        return str(exc)
    return "attached"
