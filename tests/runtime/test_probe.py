"""Measured admission (`gate="measure"`, issue 16, part 4): with no substrate, each low-bit
bucket is timed on both paths and keeps the faster; every rank decides alike."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from nfabric_cli.binding import compile_profile, static_profile
from nfabric_cli.errors import InputError
from nfabric_cli.runtime.attach import attach
from nfabric_cli.runtime.gate import CapacityGate
from nfabric_cli.runtime.probe import MeasuredAdmission
from tests.distutil import run_ranks
from tests.runtime.models import make_model, train_steps

KEY = (("a", "b"), "all")


def _cycle(m: MeasuredAdmission, low: list[float], fp32: list[float]) -> list:
    """One probe cycle: the paths it takes, with the given agreed times fed back."""
    paths, events = [], []
    for t in [*low, *fp32]:
        v = m.verdict(KEY)
        paths.append(v.verdict)
        assert m.timed(KEY)
        events.append(m.observe(KEY, t))
    return paths, events


def test_a_probe_cycle_times_both_paths_then_keeps_the_faster() -> None:
    m = MeasuredAdmission(steps=3, recheck_every=4)
    paths, events = _cycle(m, [0.010, 0.030, 0.012], [0.020, 0.021, 0.019])
    assert paths == ["admit"] * 3 + ["fallback"] * 3
    assert events[:-1] == [None] * 5
    assert events[-1] == ("low-bit", "measured: low-bit 12.00 ms vs fp32 20.00 ms (median of "
                                     "3 steps each)")
    for _ in range(4):  # kept, untimed, until the recheck
        v = m.verdict(KEY)
        assert v.admit and (v.fp32_time_s, v.lowbit_time_s) == (0.020, 0.012)
        assert not m.timed(KEY) and m.observe(KEY, 1.0) is None
    # the recheck probes again; now low-bit is slower: fp32 is kept
    paths, events = _cycle(m, [0.05, 0.05, 0.05], [0.02, 0.02, 0.02])
    assert paths == ["admit"] * 3 + ["fallback"] * 3 and events[-1][0] == "fp32"
    assert not m.verdict(KEY).admit
    # a resumed run continues the same schedule
    again = MeasuredAdmission(steps=3, recheck_every=4)
    again.load_state_dict(m.state_dict())
    assert [again.verdict(KEY).verdict for _ in range(3)] == ["fallback"] * 3


def test_a_settled_refusal_is_known_before_the_step_until_the_recheck() -> None:
    """`refuses` (what lets the hook send a step as plain DDP) holds exactly on the steps
    whose verdict is a kept fp32 decision: not while probing, not on the recheck's first."""
    gate = CapacityGate(None, 2, measure=True)
    m = gate.measured
    m.steps, m.recheck_every = 2, 3
    seen = []
    for t in [0.05, 0.05, 0.02, 0.02] * 2 + [0.0] * 3:  # two cycles, fp32 faster, then kept
        refused = gate.refuses(KEY)
        v = m.verdict(KEY)
        seen.append((refused, v.admit))
        assert not refused or not v.admit  # a refusal announced is a refusal taken
        m.observe(KEY, t)
    # cycle 1: 4 probed steps, then 3 kept fp32 steps (refused), then the recheck probes
    assert [r for r, _ in seen] == [False] * 4 + [True] * 3 + [False] * 4
    gate.sight(KEY)  # a step sent as plain DDP still counts towards the next recheck
    assert m.settled(KEY) is not None


def test_the_gate_measures_only_when_asked_and_only_without_a_substrate() -> None:
    assert CapacityGate(None, 2).measured is None  # default: admitted as written
    assert CapacityGate(None, 2, measure=True).measured is not None
    substrate = {"link_gbps": 10.0, "latency_us": 20.0}
    assert CapacityGate(substrate, 2, measure=True).measured is None  # the model prices it
    model = make_model()
    bindings = compile_profile(static_profile(model, "sign"), model, world_size=2,
                               bucket_cap_mb=None)
    from nfabric_cli.runtime.controller import StepController

    with pytest.raises(InputError, match="gate: True, False or 'measure'"):
        StepController(bindings, 4, 2, lambda e: None, gate="measured")


def _measured_run(rank: int, world: int) -> list:
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.001)
    bindings = compile_profile(static_profile(model, "sign"), model, world_size=world,
                               bucket_cap_mb=None)
    state = attach(ddp, bindings, total_steps=10, gate="measure")
    train_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), state, rank, 0, 10)
    state.close()
    return [{k: v for k, v in e.items() if k != "rank"} for e in state.events
            if e.get("from") == "probe"]


def test_every_rank_takes_the_same_measured_decisions() -> None:
    a, b = run_ranks(_measured_run, 2)
    assert a == b and len(a) >= 2  # one decision per rebuilt bucket, after its 6 probe steps
    assert all(e["step"] == a[0]["step"] and e["to"] in ("low-bit", "fp32") for e in a)
    assert all(e["reason"].startswith("measured: low-bit ") and " vs fp32 " in e["reason"]
               for e in a)
