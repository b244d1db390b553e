"""Measured admission (`gate="measure"`, issue 16, part 4): with no substrate, whole steps are
timed on both paths (the profile's routes and plain DDP's fp32) and the phase keeps the
faster; every rank decides alike."""

from __future__ import annotations

import functools
import time

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from nfabric_cli.binding import compile_profile, static_profile
from nfabric_cli.errors import InputError
from nfabric_cli.profile.phases import Phase
from nfabric_cli.runtime.attach import attach_with
from nfabric_cli.runtime.controller import StepDecision
from nfabric_cli.runtime.gate import CapacityGate
from nfabric_cli.runtime.inject import Injection
from nfabric_cli.runtime.probe import FP32, LOWBIT, PROBE_ON, WARMUP, MeasuredAdmission, ProbeStep
from tests.distutil import agreed, run_ranks
from tests.runtime.models import make_model, train_steps

PHASE = "all"
# a timed step that starts at a round (a single step, a block's first), one that runs on in a
# block, and a step on a decided path
L, F = ProbeStep(LOWBIT, True, True), ProbeStep(FP32, True, True)
LB, FB = ProbeStep(LOWBIT, True, False), ProbeStep(FP32, True, False)
KEPT_LOW, KEPT_FP32 = ProbeStep(LOWBIT, False, False), ProbeStep(FP32, False, False)


def _cycle(m: MeasuredAdmission, phase: str = PHASE, *, low: float,
           fp32: float) -> tuple[list, tuple | None]:
    """One probe cycle as the hook drives it: at each step, judge a finished pair on the
    given times (as if agreed), then take the step's path; the timed ones record their time.
    Returns the steps' `ProbeStep`s and the decision."""
    out, decided = [], None
    while decided is None:
        due = m.due(phase)
        if due is not None:
            decided = m.decide(phase, *due)
            if decided is not None and decided[0] == PROBE_ON:
                decided = None  # a close call extended the cycle
            if decided is not None:
                break
        step = m.path(phase)
        out.append(step)
        if step.timed:
            m.record(phase, step.path, low if step.path == LOWBIT else fp32)
    return out, decided


def _kept_for(m: MeasuredAdmission, path: str) -> int:
    """Steps on a decided `path` until a re-check begins (that step is taken)."""
    n = 0
    while (step := m.path(PHASE)) == (path, False, False) and m._cycles[PHASE].decision:
        n += 1
    assert m._cycles[PHASE].decision is None, step
    return n


def test_a_close_call_probes_every_pair_then_blocks_then_keeps_the_faster() -> None:
    m = MeasuredAdmission(steps=3, recheck_every=4, warmup=2, block=2, close_blocks=2)
    steps, decided = _cycle(m, low=0.018, fp32=0.020)  # within 1.15x: all three pairs, blocks
    # the warm-up steps run low-bit and are timed too (more low-bit samples); a block's first
    # step starts at a round, its others run on
    assert steps == [L] * 2 + [L, F] * 3 + [L, LB, F, FB] * 2
    assert decided == (LOWBIT, "measured step: low-bit 18.00 ms vs fp32 20.00 ms (median of 2 "
                               "2-step blocks each, mean over ranks); close: re-checked in 4 "
                               "steps")
    assert m.due(PHASE) is None  # decided once
    assert [m.path(PHASE) for _ in range(4)] == [KEPT_LOW] * 4  # kept until the recheck
    # the recheck (after a close call) probes on blocks at once, its warm-up untimed; low-bit
    # is now 1.25x slower, 1.075x pooled with the last check's blocks: fp32, close again
    steps, decided = _cycle(m, low=0.025, fp32=0.02)
    assert steps == [KEPT_LOW] * 2 + [L, LB, F, FB] * 2 and decided[0] == FP32
    assert "low-bit 21.50 ms vs fp32 20.00 ms (median of 2 2-step blocks each and the last " \
        "check's 2" in decided[1]
    assert m.path(PHASE) == KEPT_FP32
    # a resumed run continues the same schedule, with the same decision
    again = MeasuredAdmission(steps=3, recheck_every=4, warmup=2, block=2, close_blocks=2)
    again.load_state_dict(m.state_dict())
    assert [again.path(PHASE) for _ in range(3)] == [KEPT_FP32] * 3
    assert [again.path(PHASE) for _ in range(3)] == [KEPT_LOW] * 2 + [L]  # the next re-check


def test_a_close_call_probes_on_in_blocks() -> None:
    """Within 1.15x after the fourth pair: probe on in three pairs of 4-step blocks and decide
    on the medians of the blocks' median periods; a gap of 1.25x decides after four pairs; a
    run resumed mid-block keeps the blocks."""
    m = MeasuredAdmission(steps=4, recheck_every=100, warmup=2)
    blocks = [0.019, 0.0205, 0.0195, 0.5] + [0.0195] * 4 + [0.0210] * 4  # 20.0 (a pause), 19.5, 21
    lows = iter([0.020] * 2 + [0.0215, 0.0230, 0.0225, 0.0205] + blocks)
    fulls = iter([0.0210, 0.0220, 0.0200, 0.0240] + [0.0215] * 12)
    steps, decided, extended = [], None, []
    while decided is None:
        due = m.due(PHASE)
        if due is not None and (decided := m.decide(PHASE, *due)) is not None:
            if decided[0] != PROBE_ON:
                break
            extended.append((len(steps), decided[1]))
            decided = None
        if len(steps) == 2 + 2 * 4 + 5:  # mid-block: resume from a checkpoint
            resumed = MeasuredAdmission(steps=4, recheck_every=100, warmup=2)
            resumed.load_state_dict(m.state_dict())
            m = resumed
        step = m.path(PHASE)
        steps.append(step)
        m.record(PHASE, step.path, next(lows) if step.path == LOWBIT else next(fulls))
    # after four pairs the medians were 22.0 vs 21.5 ms (fp32 ahead); the blocks say low-bit
    assert steps == [L] * 2 + [L, F] * 4 + ([L] + [LB] * 3 + [F] + [FB] * 3) * 3
    assert extended == [(10, "close call: low-bit 22.00 ms vs fp32 21.50 ms (median of 4 steps "
                             "each, within 1.15x): probing on in 3 pairs of 4-step blocks")]
    assert decided == (LOWBIT, "measured step: low-bit 20.00 ms vs fp32 21.50 ms (median of 3 "
                               "4-step blocks each, mean over ranks); close: re-checked in 100 "
                               "steps")
    m = MeasuredAdmission(steps=4, recheck_every=100, warmup=2)
    steps, decided = _cycle(m, low=0.025, fp32=0.020)  # 1.25x: four pairs decide
    assert len(steps) == 2 + 2 * 4 and decided[0] == FP32
    with pytest.raises(ValueError, match="block and close_blocks must be >= 1"):
        MeasuredAdmission(block=0)
    with pytest.raises(ValueError, match="1 <= close <= decisive"):
        MeasuredAdmission(close=2.5)


def test_a_state_saved_before_blocks_probes_again() -> None:
    """A state from before blocks (no version; its samples single steps, field 6 a count of
    single-step pairs) is not judged on this schedule: every cycle in it probes again, from
    the step it was saved at."""
    older = {"cycles": {"a": [0, 15, 0, {LOWBIT: [0.02], FP32: [0.021]}, None, "", 12],
                        "b": [0, 40, 34, {LOWBIT: [0.02] * 12, FP32: [0.021] * 12}, FP32,
                              "close", 12, 1, {LOWBIT: [0.02] * 12, FP32: [0.021] * 12}]}}
    m = MeasuredAdmission(steps=4, recheck_every=100, warmup=2)
    m.load_state_dict(older)
    assert m.state_dict() == {"version": 2, "cycles": {
        name: [seen, seen, 0, {LOWBIT: [], FP32: [], WARMUP: []}, None, "", None, 0, {}, 1.0]
        for name, seen in (("a", 15), ("b", 40))}}
    assert m.path("a") == L and m.path("b") == L  # a new cycle's warm-up


def test_a_close_decision_is_rechecked_sooner_and_a_clear_one_resets_it() -> None:
    """Decided within 1.15x: re-checked after 100 steps, then 200 while the calls stay close,
    on three fresh pairs of blocks; a clear gap stands `recheck_every` steps."""
    m = MeasuredAdmission(steps=4, recheck_every=500, warmup=2, close_recheck=100)
    steps, decided = _cycle(m, low=0.0225, fp32=0.0215)  # 1.05x: blocks, then fp32
    assert len(steps) == 2 + 2 * 4 + 2 * 4 * 3 and decided[0] == FP32
    assert decided[1].endswith("(median of 3 4-step blocks each, mean over ranks); close: "
                               "re-checked in 100 steps")
    assert _kept_for(m, FP32) == 100
    steps, decided = _cycle(m, low=0.0200, fp32=0.0215)  # fresh samples: low-bit, close again
    assert len(steps) == 2 + 2 * 4 * 3 - 1 and decided[0] == LOWBIT  # its warm-up was taken
    assert decided[1].endswith("re-checked in 200 steps")
    # a re-check after a close call: one pair 2x apart (a paused block) does not end it, two do
    again = MeasuredAdmission(steps=4, recheck_every=500, warmup=2, close_recheck=100)
    again.load_state_dict(m.state_dict())
    assert _kept_for(again, LOWBIT) == 200
    steps, decided = _cycle(again, low=0.0200, fp32=0.0441)
    assert len(steps) == 2 + 2 * 2 * 4 - 1 and decided[0] == LOWBIT
    assert "(fastest of 2 low-bit and 2 fp32 4-step blocks" in decided[1]
    resumed = MeasuredAdmission(steps=4, recheck_every=500, warmup=2, close_recheck=100)
    resumed.load_state_dict(m.state_dict())
    m = resumed  # a resumed run keeps the shorter re-check
    assert _kept_for(m, LOWBIT) == 200
    # 1.4x on this check's blocks, 1.16x pooled with the last check's (25.0 against 21.5 ms):
    # beyond close, so it stands the full 500 steps, but a re-check after a close call takes
    # three pairs of blocks to say so, not four single-step pairs
    steps, decided = _cycle(m, low=0.0300, fp32=0.0215)
    assert len(steps) == 2 + 2 * 4 * 3 - 1 and decided[0] == FP32 and "re-checked" not in decided[1]
    assert "low-bit 25.00 ms vs fp32 21.50 ms (median of 3 4-step blocks each and the last " \
        "check's 3" in decided[1]
    assert _kept_for(m, FP32) == 500
    steps, decided = _cycle(m, low=0.0400, fp32=0.0190)  # 2.1x: still one pair decides
    assert len(steps) == 2 + 2 - 1 and decided[0] == FP32
    with pytest.raises(ValueError, match="close_recheck"):
        MeasuredAdmission(close_recheck=-1)


def test_a_recheck_pools_its_blocks_with_the_last_close_check() -> None:
    """One noisy stretch does not overturn a close call for 500 steps: a re-check's medians
    pool its three pairs of blocks with the last check's, and a lasting change takes over at
    the second re-check. A resumed run keeps the pool; a state saved without one loads with
    none."""
    m = MeasuredAdmission(steps=4, recheck_every=500, warmup=2, close_recheck=100)
    _, decided = _cycle(m, low=0.0225, fp32=0.0215)  # 1.05x: fp32, close
    assert decided[0] == FP32
    assert _kept_for(m, FP32) == 100
    resumed = MeasuredAdmission(steps=4, recheck_every=500, warmup=2, close_recheck=100)
    resumed.load_state_dict(m.state_dict())  # mid-way through the re-check's warm-up
    # this check alone reads low-bit 1.18x faster (18.2 ms); pooled, 20.35 against 21.5 ms
    _, decided = _cycle(resumed, low=0.0182, fp32=0.0215)
    assert decided == (LOWBIT, "measured step: low-bit 20.35 ms vs fp32 21.50 ms (median of 3 "
                               "4-step blocks each and the last check's 3, mean over ranks); "
                               "close: re-checked in 200 steps")
    assert _kept_for(resumed, LOWBIT) == 200
    _, decided = _cycle(resumed, low=0.0182, fp32=0.0215)  # the change lasted: 1.18x pooled too
    assert decided[0] == LOWBIT and "low-bit 18.20 ms" in decided[1]
    assert "re-checked" not in decided[1]  # beyond close: stands recheck_every, pool dropped
    assert resumed.state_dict()["cycles"][PHASE][8] != {}
    older = resumed.state_dict()
    older["cycles"][PHASE] = older["cycles"][PHASE][:-2]  # saved before the pool existed
    again = MeasuredAdmission(steps=4, recheck_every=500, warmup=2, close_recheck=100)
    again.load_state_dict(older)
    assert again.state_dict()["cycles"][PHASE][8:] == [{}, 1.0]


def test_a_decisive_pair_ends_the_probe_early() -> None:
    """On a slow link one fp32 step is many low-bit ones: one pair decides (2x apart); one
    pair 1.6x apart, within a fast step's jitter, does not."""
    m = MeasuredAdmission(steps=4, recheck_every=10, warmup=2)
    assert m.probing(PHASE)  # (a phase not seen yet: its cycle starts at its first step)
    steps, decided = _cycle(m, low=0.029, fp32=0.233)
    assert steps == [L] * 2 + [L, F]
    assert decided[0] == LOWBIT and "(fastest of 3 low-bit and 1 fp32 steps" in decided[1]
    # 8.0x apart: the next fp32 probe step would cost 7 low-bit steps more, so the decision
    # stands 7x `recheck_every` (see test_a_clear_decision_stands_longer_the_further_apart)
    assert decided[1].endswith("; re-checked in 70 steps")
    kept = []
    for _ in range(70):
        kept.append((m.probing(PHASE), m.path(PHASE)))
    assert kept == [(False, KEPT_LOW)] * 70
    assert m.probing(PHASE)  # `probing` names the step `path` takes next: the re-check's
    assert m.path(PHASE) == L and m.due(PHASE) is None  # rechecking: warm-up
    m = MeasuredAdmission(steps=4, recheck_every=10, warmup=0)
    steps, decided = _cycle(m, low=0.040, fp32=0.019)  # 2.1x the other way
    assert decided[0] == FP32 and len(steps) == 2
    m = MeasuredAdmission(steps=4, recheck_every=10, warmup=0)
    steps, decided = _cycle(m, low=0.0055, fp32=0.0089)  # 1.6x: every pair, then low-bit
    assert decided[0] == LOWBIT and len(steps) == 8


def test_a_clear_decision_stands_longer_the_further_apart() -> None:
    """A re-check on a slow link times one fp32 step, the cost of (ratio - 1) low-bit steps:
    a clear decision stands `recheck_every` x (ratio - 1) / (decisive - 1) steps, at least
    `recheck_every`, at most `stretch` times it; a close one is unchanged."""
    for low, fp32, stands in ((0.010, 0.021, 110), (0.010, 0.040, 300), (0.010, 0.330, 800),
                              (0.033, 0.010, 230), (0.0105, 0.010, 25)):
        m = MeasuredAdmission(steps=4, recheck_every=100, warmup=2, close_recheck=25)
        _, decided = _cycle(m, low=low, fp32=fp32)
        assert _kept_for(m, decided[0]) == stands, (low, fp32)
        assert m._cycles[PHASE].decision is None  # probing again
    with pytest.raises(ValueError, match="stretch"):
        MeasuredAdmission(stretch=0.5)


def test_a_new_phase_decides_on_the_last_cycles_fp32_time_when_it_is_decisive() -> None:
    """Plain DDP's path is the same in every phase: a phase's first cycle compares its first
    low-bit steps with the fastest fp32 step of the cycle decided last, and skips its own fp32
    step when they are `decisive` apart; otherwise (or on a re-check) it probes as usual."""
    m = MeasuredAdmission(steps=4, recheck_every=100, warmup=2)
    assert _cycle(m, low=0.010, fp32=0.130)[0] == [L] * 3 + [F]  # the first phase: its own
    steps, decided = _cycle(m, "main", low=0.008, fp32=0.140)
    assert steps == [L] * 3 and decided[0] == LOWBIT  # no fp32 step
    assert "(fastest of 3 low-bit steps and the last cycle's fastest fp32 step" in decided[1]
    assert "low-bit 8.00 ms vs fp32 130.00 ms" in decided[1]
    # not decisive on the carried time: the new phase times its own fp32 step
    steps, decided = _cycle(m, "late", low=0.080, fp32=0.130)
    assert steps == [L] * 3 + [F] + [L, F] * 3 and decided[0] == LOWBIT
    assert "fastest of" not in decided[1]  # decided on its own pairs' medians
    # the fastest fp32 time carried is the last decision's (130 ms at `late`)
    steps, _ = _cycle(m, "later", low=0.050, fp32=0.200)
    assert steps == [L] * 3
    # a re-check times fp32 itself (the first phase's, once its 13x decision stood 800 steps;
    # its first warm-up step went untimed in `_kept_for`)
    assert _kept_for(m, LOWBIT) == 800
    steps, decided = _cycle(m, low=0.010, fp32=0.130)
    assert steps[-1] == F and "fastest of 2 low-bit and 1 fp32 steps" in decided[1]


def test_a_pause_between_steps_does_not_keep_fp32_on_a_slow_link() -> None:
    """A period holds what the loop did between two steps: an evaluation makes the timed
    low-bit period seconds long on a link where fp32 is 8x slower. Judged on that pair alone
    (as medians of one sample each were) it would keep fp32; the warm-up steps' low-bit
    periods and the fastest-sample rule keep low-bit."""
    m = MeasuredAdmission(steps=4, recheck_every=10, warmup=2)
    for t in (0.045, 0.030):  # warm-up: the first one slowed by allocation
        assert m.path(PHASE) == L
        m.record(PHASE, LOWBIT, t)
    assert m.path(PHASE) == L
    m.record(PHASE, LOWBIT, 3.0)  # the pause
    assert m.path(PHASE) == F
    m.record(PHASE, FP32, 0.233)
    assert m.due(PHASE) == (0.030, 0.233)
    assert m.decide(PHASE, *m.due(PHASE))[0] == LOWBIT


def test_fastest_before_the_last_pair_medians_after_it() -> None:
    """Early (a decisive gap) on each path's fastest sample; a close call, after the last pair,
    on medians of equal counts (the fastest of more samples is lower by the count alone)."""
    m = MeasuredAdmission(steps=3, recheck_every=10, warmup=0, decisive=100.0)
    due = []
    for t_low, t_fp in [(0.010, 0.020), (0.500, 0.021), (0.012, 0.019)]:  # one slow outlier
        assert m.path(PHASE) == L
        m.record(PHASE, LOWBIT, t_low)
        assert m.path(PHASE) == F
        m.record(PHASE, FP32, t_fp)
        due.append(m.due(PHASE))
        if len(due) < 3:
            assert m.decide(PHASE, *due[-1]) is None  # 2x apart at most: probe on
    assert due == [(0.010, 0.020), (0.010, 0.020), (0.012, 0.020)]
    # a run resumed mid-cycle lost its in-flight times: nothing to decide, so it probes again
    fresh = MeasuredAdmission(steps=1, recheck_every=10, warmup=1)
    assert [fresh.path(PHASE) for _ in range(3)] == [L, L, F]
    assert fresh.due(PHASE) is None  # no times recorded
    assert [fresh.path(PHASE) for _ in range(3)] == [L, L, F]
    fresh.record(PHASE, LOWBIT, 0.01)
    fresh.record(PHASE, FP32, 0.02)
    assert fresh.due(PHASE) == (0.01, 0.02)
    with pytest.raises(ValueError, match="probe steps, block and close_blocks must be >= 1"):
        MeasuredAdmission(steps=0)


def test_the_gate_measures_only_when_asked_and_only_without_a_substrate() -> None:
    assert CapacityGate(None, 2).measured is None  # default: admitted as written
    measured = CapacityGate(None, 2, measure=True)
    assert measured.measured is not None
    assert not measured.refuses((("a",), PHASE))  # the hook asks the probe, per step
    substrate = {"link_gbps": 10.0, "latency_us": 20.0}
    assert CapacityGate(substrate, 2, measure=True).measured is None  # the model prices it
    model = make_model()
    bindings = compile_profile(static_profile(model, "sign"), model, world_size=2,
                               bucket_cap_mb=None)
    from nfabric_cli.runtime.controller import StepController

    with pytest.raises(InputError, match="gate: True, False or 'measure'"):
        StepController(bindings, 4, 2, lambda e: None, gate="measured")


class _LowBitSlower(MeasuredAdmission):
    """Decides as if low-bit were a second slower per step: the fp32 path is taken for sure."""

    def decide(self, phase: str, lowbit_s: float, fp32_s: float) -> tuple[str, str]:
        return super().decide(phase, lowbit_s + 1.0, fp32_s)


def _measured(world: int, steps: int, phases: list[Phase] | None = None,
              injections: tuple = ()) -> tuple:
    """A small all-sign model in DDP (several buckets) with the measured gate attached:
    (model, ddp, state)."""
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.001)
    bindings = compile_profile(static_profile(model, "sign", phases=phases), model,
                               world_size=world, bucket_cap_mb=None)
    state = attach_with(ddp, bindings, total_steps=steps, gate="measure", injections=injections)
    return model, ddp, state


def _measured_run(rank: int, world: int, nan_at: int | None = None,
                  phases: list[Phase] | None = None) -> dict:
    steps = 12
    faults = () if nan_at is None else (Injection("nan", nan_at, 1),)
    model, ddp, state = _measured(world, steps, phases, faults)
    state.gate.measured = _LowBitSlower(steps=2, recheck_every=100, warmup=1)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    weights = []
    for step in range(steps):
        train_steps(ddp, opt, state, rank, step, step + 1)
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    state.close()
    frame = state.traffic_frame()
    return {"events": agreed(e for e in state.events if e.get("from") == "probe"),
            "skipped": state.skipped_steps, "weights": weights,
            "control_steps": sorted(set(frame[frame.route == "control"].step)),
            "sign_steps": sorted(set(frame[frame.route == "sign/sharded"].step))}


@functools.cache
def _runs() -> tuple[dict, dict]:
    """Both ranks' `_measured_run` with a NaN on rank 1 at step 6, a plain-DDP step after the
    decision (shared by the tests below: read, don't modify)."""
    return tuple(run_ranks(_measured_run, 2, 6))


def test_every_rank_decides_alike_and_an_fp32_step_is_plain_ddp() -> None:
    a, b = _runs()
    assert {k: v for k, v in a.items() if k != "weights"} == {
        k: v for k, v in b.items() if k != "weights"}
    assert all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"], strict=True))
    # one decision, after the warm-up step and one pair: a second apart is decisive
    (event,) = a["events"]
    assert event["step"] == 3 and (event["scope"], event["to"]) == ("step", "fp32")
    assert event["reason"].startswith("measured step: low-bit ") and " vs fp32 " in event["reason"]
    # warm-up and the low-bit probes went through the worker (sign bytes, a statistics round);
    # the fp32 probes and every step after the decision went out as plain DDP: neither
    assert a["sign_steps"] == a["control_steps"] == [0, 1]


def test_phases_routed_alike_share_one_probe_cycle() -> None:
    """A warm-up phase and a main phase with the same routes (vision.v5's) are probed once:
    the cycle begun in the warm-up (steps 0-2) decides at step 3, in the main phase, which
    keeps the decision instead of spending another step on the slower path."""
    phases = [Phase("warmup", 0.0, 0.2), Phase("main", 0.2, 1.0)]
    a, b = run_ranks(_measured_run, 2, None, phases)
    assert a["events"] == b["events"]
    (event,) = a["events"]
    assert event["step"] == 3 and event["to"] == "fp32"
    assert a["sign_steps"] == a["control_steps"] == [0, 1]


def test_a_nan_on_a_plain_ddp_step_of_a_lowbit_phase_is_neutralised() -> None:
    """The measured gate sends steps 2.. as plain DDP; rank 1's NaN at step 6 would poison
    every rank's weights there. It is zeroed on both ranks instead (plain SGD: step 6 leaves
    the weights as they were), with the same skip on both, and no statistics round added."""
    a, b = _runs()
    assert a["skipped"] == b["skipped"] == [6]
    assert a["sign_steps"] == a["control_steps"] == [0, 1]
    for wa, wb in zip(a["weights"], b["weights"], strict=True):
        assert torch.isfinite(wa).all() and torch.equal(wa, wb)
    assert torch.equal(a["weights"][6], a["weights"][5])
    assert not torch.equal(a["weights"][7], a["weights"][6])  # training goes on after it
    assert all(not torch.equal(a["weights"][i + 1], a["weights"][i]) for i in range(5))


def _held_run(rank: int, world: int) -> dict:
    """`_measured_run`'s gate with the monitor holding every scope for steps 0-4, released
    from step 5 on: what the probe decided, and when."""
    from nfabric_cli.benchmarks.runtime import hold_everything

    model, ddp, state = _measured(world, 10)
    state.gate.measured = probe = _LowBitSlower(steps=2, recheck_every=100, warmup=1)
    free = state.monitor.state_dict()
    hold_everything(state)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    train_steps(ddp, opt, state, rank, 0, 5)
    waiting = probe.probing("main") and not probe._cycles
    state.monitor.load_state_dict(free)  # the hold ends
    train_steps(ddp, opt, state, rank, 5, 10)
    state.close()
    return {"waiting": waiting, "events": agreed(e for e in state.events
                                                 if e.get("from") == "probe")}


def test_the_probe_waits_while_the_monitor_holds_every_scope() -> None:
    """Held, a "low-bit" step is the held path (fp32 and the statistics round): timed as
    low-bit, the gate compared two fp32 paths and kept fp32 at step 3. The probe waits for
    the hold to end and then runs its cycle, deciding three steps later as the unheld run
    does at step 3 (`test_every_rank_decides_alike_and_an_fp32_step_is_plain_ddp`)."""
    a, b = run_ranks(_held_run, 2)
    assert a == b and a["waiting"]
    (event,) = a["events"]
    assert event["step"] == 8 and event["to"] == "fp32"


def _failed_probe_run(rank: int, world: int) -> dict:
    """`_measured_run`'s gate, step 1 (a timed low-bit probe step) failing at its last bucket
    on every rank; the run catches it, takes 0.5 s to recover and goes on."""
    model, ddp, state = _measured(world, 6)
    state.gate.measured = probe = MeasuredAdmission(steps=2, recheck_every=100, warmup=1)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    train_steps(ddp, opt, state, rank, 0, 1)
    reduce_bucket = state._reduce_bucket

    def failing(*args):  # noqa: ANN002, ANN202
        if args[3]:
            raise RuntimeError("last bucket broke")
        return reduce_bucket(*args)

    state._reduce_bucket = failing
    with pytest.raises(RuntimeError, match="last bucket broke"):
        train_steps(ddp, opt, state, rank, 1, 2)
    state._reduce_bucket = reduce_bucket
    time.sleep(0.5)  # the caller's recovery
    train_steps(ddp, opt, state, rank, 1, 4)
    (cycle,) = probe._cycles.values()
    state.close()
    return {"counts": {k: len(v) for k, v in cycle.times.items()}, "decision": cycle.decision,
            "step": state.step}


def test_a_failed_steps_period_is_no_sample_of_its_path() -> None:
    """A timed step that fails is over at its last bucket: its period is dropped, not recorded
    at the next step's first bucket with the caller's recovery in it (0.5 s here, which as a
    low-bit sample decided fp32 at once against the next fp32 step). Cycle positions: 0 the
    warm-up, 1 the failed low-bit step, then 2 fp32, 3 low-bit (the pair at 1-2 lacks its
    low-bit sample: nothing to decide), 4 (not timed yet): one sample of each, undecided."""
    a, b = run_ranks(_failed_probe_run, 2)
    for r in (a, b):
        assert r == {"counts": {WARMUP: 1, LOWBIT: 1, FP32: 1}, "decision": None, "step": 4}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_finds_any_nan_or_infinity_anywhere(dtype: torch.dtype) -> None:
    # the gated-off step's check (`all_finite`: min and max per buffer): every position of a
    # vector-sized and an odd-sized buffer, beside finite ones
    from nfabric_cli.runtime.state import all_finite

    clean = [torch.randn(1000).to(dtype), torch.empty(0, dtype=dtype), torch.randn(37).to(dtype)]
    assert all_finite(clean) and all_finite([])
    for bad in (float("nan"), float("inf"), -float("inf")):
        for i in (0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 36):
            t = [c.clone() for c in clean]
            t[2][i] = bad
            assert not all_finite(t), (bad, i)
        t = [c.clone() for c in clean]
        t[0][999] = bad
        assert not all_finite(t), bad


class _NeverDecides(MeasuredAdmission):
    """Probes on for as many pairs as it is given, counting the agreements it judges."""

    def decide(self, phase: str, lowbit_s: float, fp32_s: float) -> None:
        self.agreed = getattr(self, "agreed", 0) + 1


def _probe_periods(rank: int, world: int, probe: MeasuredAdmission | None = None,
                   steps: int = 9, round_s: float = 1.0) -> dict:
    _, ddp, state = _measured(world, steps)
    probe = state.gate.measured = probe or _NeverDecides(steps=10, recheck_every=100, warmup=1)
    rounds, probe_round = [], state._probe_round

    def slow_round(times: tuple[float, float]) -> tuple[float, float]:
        rounds.append((state.step, times != (0.0, 0.0)))
        time.sleep(round_s)  # a barrier can take this long when one rank arrives late
        return probe_round(times)

    state._probe_round = slow_round
    train_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), state, rank, 0, steps)
    state.close()
    (cycle,) = probe._cycles.values()
    events = [e["reason"] for e in state.events if e.get("from") == "probe"]
    return {"agreed": getattr(probe, "agreed", 0), "rounds": rounds, "events": events,
            **cycle.times}


def test_every_timed_step_starts_after_a_round_and_no_period_holds_it() -> None:
    """The all-reduce that agrees the times (at the first bucket of the low-bit step after
    each pair) is a barrier: a round trip plus the ranks' skew, 2.7 ms median on transformer.
    Timed in the low-bit periods alone it made low-bit read ~9 % slow; left out of them alone,
    the fp32 periods still held the skew. Every timed step now starts at a round (an empty
    one where no pair is due) and its period starts after it."""
    for times in run_ranks(_probe_periods, 2):
        assert times["agreed"] == 3  # at steps 3, 5, 7: after the pairs ending at 2, 4, 6
        # one round a step, every step of the cycle being timed; the agreements at 3, 5, 7
        assert times["rounds"] == [(s, s in (3, 5, 7)) for s in range(9)]
        # warm-up step 0; low-bit steps 1, 3, 5, 7 and fp32 steps 2, 4, 6 (8's ends after the run)
        assert len(times[WARMUP]) == 1
        assert len(times[LOWBIT]) == 4 and len(times[FP32]) == 3
        assert max(times[WARMUP] + times[LOWBIT] + times[FP32]) < 0.5, times


def test_a_block_starts_at_a_round_and_its_steps_run_on() -> None:
    """On a close call the probe times blocks: a round before each block's first step only,
    so its other steps run as a run of that path would (the ranks not held in step). One
    single-step pair (steps 1-2, after the warm-up step 0) is a close call at any gap here;
    then a 3-step block on each path (3-5, 6-8) and the decision at step 9."""
    probe = MeasuredAdmission(steps=1, recheck_every=100, warmup=1, decisive=1e9, close=1e9,
                              block=3, close_blocks=1)
    for times in run_ranks(functools.partial(_probe_periods, probe=probe, steps=11), 2):
        assert times["rounds"] == [(s, s in (3, 9)) for s in (0, 1, 2, 3, 6, 9)]
        assert times["events"][0].startswith("close call: ")
        assert "(median of 1 3-step blocks each, mean over ranks)" in times["events"][1]
        # the blocks' samples (the singles were set aside at the close call); no period
        # holds a round's second
        assert len(times[LOWBIT]) == len(times[FP32]) == 1 and not times[WARMUP]
        assert max(times[LOWBIT] + times[FP32]) < 0.5, times


def _clipping_slowly(rank: int, world: int) -> dict:
    """`_probe_periods` where every clipped parameter takes a tenth of a second more."""
    apply_ = StepDecision.apply_
    clipped: list[int] = []

    def slow(self, scope, update, full):  # noqa: ANN001, ANN202
        if full and scope in self.clips:
            clipped.append(1)
            time.sleep(0.1)
        return apply_(self, scope, update, full)

    StepDecision.apply_ = slow
    try:
        times = _probe_periods(rank, world, round_s=0.0)
    finally:
        StepDecision.apply_ = apply_
    return {**times, "clipped": len(clipped)}


def test_a_ramps_clip_is_left_out_of_the_probes_fp32_periods() -> None:
    """Every fp32 probe step after a low-bit one opens a ramp that clips (docs/health.md, "The
    gate's switches ramp"): the switch's cost, not the fp32 path's, so the period leaves it
    out (else a close call leans towards low-bit: 0.3x a 47M-parameter model's compute)."""
    for times in run_ranks(_clipping_slowly, 2):
        # every parameter of the fp32 steps 2, 4, 6 and 8 (whose period ends after the run):
        # each step's period over 0.5 s without the rule
        assert times["clipped"] == 4 * len(list(make_model().parameters())) > 4 * 5
        assert len(times[FP32]) == 3
        assert max(times[WARMUP] + times[LOWBIT] + times[FP32]) < 0.5, times
