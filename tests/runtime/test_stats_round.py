"""The step's statistics travel with the last bucket (issue 16, part 2): the round is made
once every other bucket has landed and before the last one starts, rides on that bucket's
all-gather (its own all-reduce only where the bucket has none), and what every rank combined
whole is added to it, not summed twice."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from nfabric_cli.binding import compile_profile, static_profile
from nfabric_cli.runtime import agree, bucket
from nfabric_cli.runtime import state as state_mod
from nfabric_cli.runtime.attach import attach
from tests.distutil import run_ranks
from tests.runtime.models import make_model, train_steps


def _order(rank: int, world: int) -> dict:
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.001)  # several buckets per step
    bindings = compile_profile(static_profile(model, "sign"), model, world_size=world,
                               bucket_cap_mb=None)
    state = attach(ddp, bindings, total_steps=3, gate=False)
    log: list[tuple[str, int]] = []
    finish, round_init = bucket.BucketJob.finish, agree.StatsRound.__init__

    def logged_finish(job):  # noqa: ANN001, ANN202
        log.append(("finish", job.index))
        return finish(job)

    def logged_round(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        log.append(("round", -1))
        return round_init(self, *args, **kwargs)

    wholes: list[dict] = []
    result = agree.StatsRound.result

    def kept_whole(self, updates, whole=None):  # noqa: ANN001, ANN202
        wholes.append({k: float(v) for k, v in (whole or {}).items()})
        wholes[-1]["reduced"] = agree._unpack(self.vec.tolist(), self.scopes,  # the ranks' sum
                                              self.n_seconds)
        return result(self, updates, whole)

    agree.StatsRound.result = kept_whole
    bucket.BucketJob.finish, agree.StatsRound.__init__ = logged_finish, logged_round
    agreements: list[dict] = []
    decide = state.controller.decide

    def kept(step, loss, nonfinite, norms, agreement, updates):  # noqa: ANN001, ANN202
        agreements.append(dict(agreement))
        return decide(step, loss, nonfinite, norms, agreement, updates)

    state.controller.decide = kept
    try:
        train_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), state, rank, 0, 3)
    finally:
        bucket.BucketJob.finish, agree.StatsRound.__init__ = finish, round_init
        agree.StatsRound.result = result
    state.close()
    numel = sum(p.numel() for p in model.parameters())
    return {"log": log, "agreement": agreements, "whole": wholes, "numel": numel,
            "scopes": list(state._scopes)}


def test_the_round_is_issued_before_the_last_bucket_is_waited_for() -> None:
    assert state_mod.StatsRound is agree.StatsRound
    a, b = run_ranks(_order, 2)
    assert a["log"] == b["log"] and a["agreement"] == b["agreement"]
    steps, current = [], []
    for event in a["log"]:
        current.append(event)
        if event[0] == "finish" and len(current) > 1 and current[-2][0] == "round":
            steps.append(current)
            current = []
    assert len(steps) == 3 and not current
    for n, events in enumerate(steps):
        last = max(i for kind, i in events if kind == "finish")
        assert last >= 1 or n == 0  # two buckets once DDP has rebuilt them after step 0
        # pipelined: bucket k - 1 lands after bucket k starts; the round goes out before the
        # last bucket lands, after every other one has
        assert events[-2:] == [("round", -1), ("finish", last)]
        assert [i for _, i in events[:-2]] == list(range(last))
    # at W = 2 every sign piece gathers codes: its agreement is complete on each rank, counted
    # once per element and rank (agree_n = W x elements, the same on both ranks) and not in
    # the all-reduced vector (summed there it would count twice)
    def sums(r: dict) -> list[dict]:  # (the vector's norms are each rank's own before the sum)
        return [{k: v for k, v in w.items() if k != "reduced"} for w in r["whole"]]

    assert sums(a) == sums(b) and len(a["whole"]) == 3
    (scope,) = a["scopes"]
    for whole in a["whole"]:
        assert whole[f"agree_n:{scope}"] == 2 * a["numel"]
        reduced = whole["reduced"]
        assert reduced.norm2[scope] > 0 and reduced.loss is not None
        assert reduced.sums == {f"agree_sum:{scope}": 0.0, f"agree_n:{scope}": 0.0}
    for agreement in a["agreement"]:
        assert agreement and all(0.0 <= v <= 1.0 for v in agreement.values())


def _rides(rank: int, world: int, last_fp32: bool) -> dict:
    """Three steps of a many-bucket model on sign (optionally the first layer, which DDP puts
    in the step's last bucket, on fp32): the statistics' all-reduces, and what each rank
    packed and agreed."""
    from nfabric_cli.routes.comm import Comm

    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.001)
    rules = [("body.0.*", "fp32")] if last_fp32 else []
    bindings = compile_profile(static_profile(model, "sign", rules), model, world_size=world,
                               bucket_cap_mb=None)
    state = attach(ddp, bindings, total_steps=3, gate=False)
    reduces: list[str] = []
    own: list[list[float]] = []
    agreed: list[list[float]] = []
    allreduce, payload, result = Comm.allreduce_async, agree.StatsRound.payload, agree.StatsRound.result

    def counted(self, t, op=None):  # noqa: ANN001, ANN202
        reduces.append(str(t.dtype))
        return allreduce(self, t) if op is None else allreduce(self, t, op)

    def packed(self):  # noqa: ANN001, ANN202
        out = payload(self)
        own.append(self.vec.tolist())
        return out

    def read(self, updates, whole=None):  # noqa: ANN001, ANN202
        out = result(self, updates, whole)  # (an all-reduce has landed in `vec` only now)
        agreed.append(self.vec.tolist())
        return out

    Comm.allreduce_async, agree.StatsRound.payload, agree.StatsRound.result = counted, packed, read
    try:
        train_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), state, rank, 0, 3)
    finally:
        Comm.allreduce_async, agree.StatsRound.payload, agree.StatsRound.result = allreduce, payload, result
    state.close()
    return {"reduces": reduces, "own": own, "agreed": agreed}


def test_the_statistics_ride_on_the_last_all_gather() -> None:
    """No round of their own: every rank appends its vector to its row of the last bucket's
    all-gather and sums the rows in rank order, so both ranks hold the same sums, bit for bit
    the sum of what each packed."""
    a, b = run_ranks(_rides, 2, False)
    assert a["reduces"] == b["reduces"] == []  # sign at W = 2: all-gathers only
    assert len(a["own"]) == len(b["own"]) == len(a["agreed"]) == 3
    assert a["agreed"] == b["agreed"]
    for mine, theirs, total in zip(a["own"], b["own"], a["agreed"], strict=True):
        assert mine != theirs  # each rank's own loss and norms ...
        assert total == [x + y for x, y in zip(mine, theirs, strict=True)]  # ... summed


def test_a_last_bucket_without_an_all_gather_sends_its_own_round() -> None:
    a, b = run_ranks(_rides, 2, True)
    assert a["reduces"] == b["reduces"]
    # DDP's first step buckets in registration order (a sign bucket last): the round rode;
    # from step 1 its rebuilt buckets end with body.0, on fp32: one all-reduce of its own a step
    assert len(a["own"]) == len(b["own"]) == 1
    assert a["reduces"].count("torch.float64") == 2
    assert a["agreed"] == b["agreed"] and len(a["agreed"]) == 3
