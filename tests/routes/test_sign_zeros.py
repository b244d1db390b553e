"""Sign's vote for an exact zero: an element no rank has a gradient for stays put.

A 1-bit code has no zero. Before profile schema 1.1 every rank voted an exact zero down, so an
element without a gradient (an embedding row not in the batch, a dead unit, a padding row)
was moved by its chunk's scale every step, without bound when there is no error feedback.
Under ``zeros = "split"`` (the default) half the ranks vote it up and half down, alternating
with the step (`base.zero_vote`); ``zeros = "negative"`` keeps the old rule, which schema-1.0
profiles were proven with and still replay.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from nfabric_cli import attach
from nfabric_cli.binding import compile_profile, static_profile
from nfabric_cli.errors import InputError
from nfabric_cli.profile.store import read_profile
from nfabric_cli.routes import make_route
from nfabric_cli.routes.base import codec_noise
from nfabric_cli.routes.spec import RouteSpec
from tests.distutil import run_ranks

SPLIT, NEGATIVE = RouteSpec("sign"), RouteSpec("sign", zeros="negative")


def _half_zero(world: int, n: int = 1024) -> list[torch.Tensor]:
    """Every rank's gradient: the same signs in the first half (so they vote alike), exactly 0
    (+0 and -0) in the second, in the same chunks (so their scale is not 0)."""
    base = torch.randn(n // 2, generator=torch.Generator().manual_seed(world))
    out = []
    for r in range(world):
        g = torch.cat([base * (r + 1), torch.zeros(n // 2)])
        g[n // 2 + 1 :: 2] = -0.0
        out.append(g)
    return out


def _reduce(spec: RouteSpec, grads: list[torch.Tensor], step: int) -> torch.Tensor:
    votes = [codec_noise(spec, 0, step, r, ["p"], [grads[0].numel()]) for r in range(len(grads))]
    return make_route(spec).simulate(grads, (grads[0].numel(),), None, votes)


@pytest.mark.parametrize("world", [2, 4, 6])
def test_an_element_no_rank_has_a_gradient_for_reduces_to_zero_at_an_even_world(world: int) -> None:
    grads = _half_zero(world)
    n = grads[0].numel()
    for step in (0, 1, 7):
        out = _reduce(SPLIT, grads, step)
        assert torch.equal(out[n // 2 :], torch.zeros(n // 2))
        assert torch.equal(out[: n // 2].sign(), grads[0][: n // 2].sign())  # theirs kept
    old = _reduce(NEGATIVE, grads, 0)  # the old rule: down on every rank, minus the scale
    assert (old[n // 2 :] < 0).all()


def test_at_an_odd_world_the_zero_elements_alternate_with_the_step() -> None:
    grads = _half_zero(3)
    n = grads[0].numel()
    a, b = _reduce(SPLIT, grads, 4)[n // 2 :], _reduce(SPLIT, grads, 5)[n // 2 :]
    assert (a > 0).all() and torch.equal(a, -b)  # one step up, the next down: no drift
    assert (_reduce(NEGATIVE, grads, 4)[n // 2 :] < 0).all()


def test_the_zero_vote_is_validated_and_only_kept_where_it_is_not_the_default() -> None:
    with pytest.raises(InputError, match="unknown sign zero vote 'up' \\(split or negative\\)"):
        RouteSpec("sign", zeros="up")
    from nfabric_cli.profile.operating import route_row
    from nfabric_cli.profile.phases import Phase

    phase = Phase("all", 0.0, 1.0)
    assert route_row("*", phase, 0, "sign").zeros is None  # the default, split: unset
    assert route_row("*", phase, 0, "sign", zeros="negative").spec().zeros == "negative"
    assert route_row("*", phase, 0, "int8", zeros="negative").zeros is None  # sign only


def test_profiles_of_schema_1_0_replay_the_old_vote_and_new_ones_keep_theirs(tmp_path: Path) -> None:
    """The committed reference profiles were proven under the old rule: read back, their sign
    rows say "negative", so they replay what their confirmation measured; a profile written
    now says what it holds and reads back the same."""
    old = read_profile("profiles/transformer/transformer.v9.parquet")
    assert old.meta["schema_version"] == "1.0.0"
    assert {r.zeros for r in old.rows} == {"negative"} and {r.route for r in old.rows} == {"sign"}
    mixed = read_profile("profiles/vision/vision.v9.parquet")  # int8 rows keep none
    assert {(r.route, r.zeros) for r in mixed.rows} == {("sign", "negative"), ("int8", None)}
    from nfabric_cli.profile.store import write_profile

    model = nn.Linear(4, 2)
    new = static_profile(model, "sign")
    write_profile(new, tmp_path / "p.parquet")
    again = read_profile(tmp_path / "p.parquet")
    assert again.meta["schema_version"] == "1.1.0"
    assert [r.spec().zeros for r in again.rows] == ["split"]
    write_profile(old, tmp_path / "old.parquet")  # rewritten: the old rule is now written down
    assert {r.zeros for r in read_profile(tmp_path / "old.parquet").rows} == {"negative"}


def test_bindings_of_schema_1_0_replay_the_old_vote(tmp_path: Path) -> None:
    """A bindings file compiled before the column existed holds sign routes of the old rule."""
    import pyarrow.parquet as pq

    from nfabric_cli.binding.store import read_bindings, write_bindings
    from nfabric_cli.profile.parquet import read_metadata, write_table

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    profile = static_profile(model, "sign", [("1.*", "fp32")])
    path = write_bindings(compile_profile(profile, model, world_size=2), tmp_path / "b.parquet")
    assert {s.zeros for b in read_bindings(path).params.values() for s in b.routes.values()} == {
        "split"}
    _, meta = read_metadata(path)
    old = pq.read_table(path).drop_columns(["zeros"])
    write_table(tmp_path / "old.parquet", old, "bindings", {**meta, "schema_version": "1.0.0"})
    routes = {n: s for n, b in read_bindings(tmp_path / "old.parquet").params.items()
              for s in b.routes.values()}
    assert {(s.name, s.zeros) for s in routes.values()} == {("sign", "negative"),
                                                           ("fp32", "split")}


class _Tokens(nn.Module):
    """An embedding of 64 rows of which a batch uses 8: 56 rows get exactly zero gradients."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(64, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids).mean(1))


def _unused_rows(rank: int, world: int, zeros: str) -> dict:
    model = _Tokens()
    before = model.embed.weight.detach().clone()
    ddp = DDP(model)
    profile = static_profile(model, "sign")  # no error feedback: nothing pulls a row back
    if zeros == "negative":
        import dataclasses

        profile.rows = [dataclasses.replace(r, zeros="negative") for r in profile.rows]
    state = attach(ddp, compile_profile(profile, model, world_size=world), total_steps=12)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(12):
        ids = torch.randint(0, 8, (8, 5), generator=gen)  # tokens 0-7 only
        loss = F.cross_entropy(ddp(ids), torch.randint(0, 4, (8,), generator=gen))
        state.observe(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    state.close()
    after = model.embed.weight.detach()
    return {"unused_moved": float((after[8:] - before[8:]).abs().max()),
            "used_moved": float((after[:8] - before[:8]).abs().max())}


@pytest.mark.slow
@pytest.mark.parametrize("zeros", ["split", "negative"])
def test_embedding_rows_not_in_any_batch_stay_put_on_real_ranks(zeros: str) -> None:
    """2 gloo ranks, the hook on sign without error feedback, 12 steps of SGD with momentum:
    the 56 rows no batch used are bit for bit where they started; under the old vote they
    moved further than the trained rows (0.0046 against 0.0025: each step minus the scale,
    momentum adding up)."""
    for rank in run_ranks(_unused_rows, 2, zeros):
        assert rank["used_moved"] > 0.001
        if zeros == "split":
            assert rank["unused_moved"] == 0.0
        else:
            assert rank["unused_moved"] > rank["used_moved"]
