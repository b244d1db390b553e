"""The traffic meter's totals: kept as rows arrive, equal to the rows' sums, and rebuilt from a
checkpointed state."""

from __future__ import annotations

import random

from nfabric_cli.routes.plan import WireBytes
from nfabric_cli.runtime.traffic import TrafficMeter


def _from_rows(m: TrafficMeter) -> dict:
    rows, fp32 = m.state_dict()["rows"], m.state_dict()["fp32"]
    per_route: dict[str, int] = {}
    for _, _, route, sent, received in rows:
        per_route[route] = per_route.get(route, 0) + sent + received
    total = sum(per_route.values())
    ref = sum(t for _, t in fp32)
    return {"steps": len({r[0] for r in rows} | {s for s, _ in fp32}), "bytes": total,
            "fp32_bytes": ref, "traffic_fraction": total / ref, "per_route": per_route,
            "no_control": total - per_route.get("control", 0)}


def test_the_kept_totals_are_the_rows_sums_and_survive_a_checkpoint() -> None:
    rng = random.Random(0)
    m = TrafficMeter()
    for step in range(300):
        for route in rng.sample(["sign/sharded", "fp32", "int8/sharded", "control"], 2):
            m.add(step, "warmup" if step < 30 else "main", route,
                  WireBytes(rng.randrange(1000), rng.randrange(1000)))
            m.add(step, "main", route, WireBytes(5, 7))  # a second bucket on the same route
        if step % 7:  # steps without a reference row: only those with one count in fp32
            m.add_fp32_reference(step, WireBytes(4000, 4000))
    _check(m)
    got = m.summary()
    resumed = TrafficMeter()
    resumed.add(0, "main", "stale", WireBytes(1, 1))  # replaced by the state, totals too
    resumed.load_state_dict(m.state_dict())
    assert resumed.summary() == got
    resumed.add(300, "main", "fp32", WireBytes(10, 10))
    resumed.add_fp32_reference(300, WireBytes(10, 10))
    assert resumed.summary()["bytes"] == got["bytes"] + 20
    assert resumed.summary()["steps"] == 301 and "stale" not in resumed.per_route()
    _check(resumed)


def _check(m: TrafficMeter) -> None:
    want, got = _from_rows(m), m.summary()
    for key in ("steps", "bytes", "fp32_bytes", "traffic_fraction", "per_route"):
        assert got[key] == want[key], key
    assert m.total_bytes(include_control=False) == want["no_control"]
