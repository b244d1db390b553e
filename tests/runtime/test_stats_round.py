"""The step's statistics all-reduce travels with the last bucket (issue 16, part 2): it is
issued once everything it sums exists, after the last bucket's middle stage and before that
bucket is waited for, and what every rank combined whole is added to it, not summed twice."""

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
        wholes[-1]["reduced"] = [float(x) for x in self.vec[3:]]  # what the ranks summed
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
        norm2, agree_sum, agree_n = whole["reduced"][:3]  # the scope's row of the vector
        assert norm2 > 0 and agree_sum == agree_n == 0.0
    for agreement in a["agreement"]:
        assert agreement and all(0.0 <= v <= 1.0 for v in agreement.values())
