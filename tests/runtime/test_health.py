"""Health monitor: trips, cooldown, hysteresis, pinning, the "all" scope, windows, determinism."""

from __future__ import annotations

import json
import math
import random

import pytest

from nfabric_cli.errors import InputError
from nfabric_cli.runtime.health import (
    HealthEvent,
    HealthMonitor,
    HealthThresholds,
    StepStats,
)

# Small windows so every sequence below is short enough to follow by hand.
# Blow-ups trip here (grad_blowup_trips=1), the simplest way to drive the state machine; the
# default, a blow-up guarded in place, has its own tests below.
T = HealthThresholds(window=5, min_history=3, cooldown=2, healthy_to_readmit=2, max_trips=3,
                     grad_blowup_trips=1)


def make_monitor(routes: dict[str, str] | None = None, **overrides) -> HealthMonitor:
    thresholds = HealthThresholds.from_dict({**T.to_dict(), **overrides})
    monitor = HealthMonitor(["a", "b"], thresholds)
    monitor.set_routes(routes or {"a": "sign", "b": "int8"})
    monitor.on_phase_change("p0", 0)
    return monitor


def feed(monitor: HealthMonitor, a_norms: list[float], start: int = 0) -> list[HealthEvent]:
    """Feed steps start.. with scope a's norms as given, b steady at 1.0, loss steady at 1.0."""
    events = []
    for i, a in enumerate(a_norms):
        stats = StepStats(start + i, 1.0, False, {"a": a, "b": 1.0})
        events += monitor.check(stats)
    return events


def as_tuples(events: list[HealthEvent]) -> list[tuple]:
    return [(e.step, e.scope, e.from_route, e.to_route, e.reason) for e in events]


def test_blowup_trips_scope_cooldown_then_readmit_at_exact_steps():
    m = make_monitor()
    forced = []
    for step, a in enumerate([1, 1, 1, 20, 1, 1, 1, 1, 1]):
        m.check(StepStats(step, 1.0, False, {"a": a, "b": 1.0}))
        forced.append(m.forced_fp32("a"))
    # trip at 3; cooldown steps 4-5; healthy checks 6, 7 -> re-admitted at 7
    assert as_tuples(m.events) == [
        (3, "a", "sign", "fp32", "grad-norm blow-up 20.0x median"),
        (7, "a", "fp32", "sign", "re-admitted after 2 healthy checks"),
    ]
    assert forced == [False, False, False, True, True, True, True, False, False]
    assert not m.forced_fp32("b") and m.effective_route("b") == "int8"
    assert m.effective_route("a") == "sign"
    assert m.state()["scopes"]["a"]["trips"] == 1


def test_collapse_and_sign_agreement_trip_their_scope_only():
    m = make_monitor()
    feed(m, [1, 1, 1])
    events = m.check(StepStats(3, 1.0, False, {"a": 1.0, "b": 5e-4}))
    assert as_tuples(events) == [(3, "b", "int8", "fp32", "grad-norm collapse 0.0005x median")]
    events = m.check(StepStats(4, 1.0, False, {"a": 1.0, "b": 1.0}, {"a": 0.01}))
    assert as_tuples(events) == [(4, "a", "sign", "fp32", "sign agreement 0.010 < 0.02")]
    assert m.effective_route("a") == m.effective_route("b") == "fp32"
    assert not m.forced_fp32("all")


def test_a_scope_with_no_gradient_on_any_rank_is_absent_not_collapsed():
    """Exactly zero over every rank is what DDP reduces for parameters no rank used (an expert
    not taken): no verdict, no window entry, no healthy check towards re-admission. A norm
    just above zero is still a collapse."""
    m = make_monitor()
    feed(m, [1, 1, 1])
    assert m.check(StepStats(3, 1.0, False, {"a": 1.0, "b": 0.0}, {"b": 1.0})) == []
    assert m.detections == [] and m.state()["scopes"]["b"]["status"] == "ok"
    assert list(m._norm_windows["b"]) == [1.0, 1.0, 1.0]
    events = m.check(StepStats(4, 1.0, False, {"a": 1.0, "b": 1e-30}))
    assert as_tuples(events) == [(4, "b", "int8", "fp32", "grad-norm collapse 1e-30x median")]
    for step in (5, 6, 7, 8):  # cooldown to 6, then probation: absent checks do not count
        m.check(StepStats(step, 1.0, False, {"a": 1.0, "b": 0.0}))
    assert m.forced_fp32("b")
    feed(m, [1, 1], start=9)
    assert not m.forced_fp32("b")  # re-admitted on two present healthy checks


def test_a_collapse_on_a_batch_already_fit_is_no_trip():
    """A near-zero loss has a near-zero gradient with nothing wrong: transformer.v8 at 4x its
    length collapsed 1000x on losses 140-250x below the median. The collapse trips only while
    the loss keeps at least `grad_collapse_loss` of its median (0: always)."""
    for loss, trips in ((0.05, False), (0.1, True), (1.0, True), (-1.0, True)):
        m = make_monitor()
        feed(m, [1, 1, 1])
        events = m.check(StepStats(3, loss, False, {"a": 1.0, "b": 5e-4}))
        assert bool(events) == trips, loss
        assert m.detections == ([(3, "b", "grad-norm collapse 0.0005x median")] if trips else [])
    m = make_monitor(grad_collapse_loss=0.0)
    feed(m, [1, 1, 1])
    assert m.check(StepStats(3, 1e-6, False, {"a": 1.0, "b": 5e-4}))  # the test turned off
    m = make_monitor()  # no loss observed: judged on the norm alone, as before
    for step in range(3):
        m.check(StepStats(step, None, False, {"a": 1.0, "b": 1.0}))
    assert m.check(StepStats(3, None, False, {"a": 1.0, "b": 5e-4}))


def test_borderline_value_keeps_fp32_without_counting_a_trip():
    m = make_monitor()
    # trip at 3; cooldown 4-5; 6 healthy (run 1); 7 at 5x median: between readmit (3x) and
    # blow-up (10x) -> run reset, no trip; 8, 9 healthy -> re-admitted at 9, not 7
    events = feed(m, [1, 1, 1, 20, 1, 1, 1, 5, 1, 1])
    assert [(e.step, e.to_route) for e in events] == [(3, "fp32"), (9, "sign")]
    assert m.state()["scopes"]["a"]["trips"] == 1


def test_borderline_collapse_side_and_loss_hysteresis_for_all():
    m = make_monitor()
    # after a collapse trip, 0.2x median (above collapse, 1e-3, but below 1/readmit, 1/3) is
    # not healthy: the norm must come back up
    events = feed(m, [1, 1, 1, 5e-4, 1, 1, 0.2, 1, 1])
    assert [(e.step, e.to_route) for e in events] == [(3, "fp32"), (8, "sign")]
    # after a blow-up it is: a run converging on fp32 (norms far below the pre-trip level)
    # is re-admitted as soon as one that came back to its level
    for low in (0.2, 0.01):
        m = make_monitor()
        events = feed(m, [1, 1, 1, 20, 1, 1, low, low, 1])
        assert [(e.step, e.to_route) for e in events] == [(3, "fp32"), (7, "sign")]

    m = make_monitor()
    losses = [1, 1, 1, 4, 1, 1, 2, 2, 1, 1]  # spike at 3; 2x (> 1.5 readmit) at 6, 7
    for step, loss in enumerate(losses):
        m.check(StepStats(step, loss, False, {"a": 1.0, "b": 1.0}))
    assert as_tuples(m.events) == [
        (3, "all", "int8+sign", "fp32", "loss spike 4.0x median"),
        (9, "all", "fp32", "int8+sign", "re-admitted after 2 healthy checks"),
    ]


def test_trip_signal_during_cooldown_extends_hold_without_counting():
    m = make_monitor()
    # trip at 3, blow-up again at 4 (cooldown): hold restarts to end at 6; 7, 8 healthy
    events = feed(m, [1, 1, 1, 20, 20, 1, 1, 1, 1])
    assert [(e.step, e.to_route) for e in events] == [(3, "fp32"), (8, "sign")]
    assert m.state()["scopes"]["a"]["trips"] == 1


def test_pinned_after_max_trips_and_released_at_next_phase():
    m = make_monitor()
    # trips at 3 (event), 6 (probation re-trip: counted, no route change), 9 (third: pinned)
    events = feed(m, [1, 1, 1, 20, 1, 1, 20, 1, 1, 20] + [1] * 10)
    assert as_tuples(events) == [
        (3, "a", "sign", "fp32", "grad-norm blow-up 20.0x median"),
        (9, "a", "fp32", "fp32", "pinned: 3 trips in phase p0 (grad-norm blow-up 20.0x median)"),
    ]
    assert m.forced_fp32("a") and m.state()["scopes"]["a"]["status"] == "pinned"
    assert m.on_phase_change("p0", 20) == []  # same phase: nothing released
    released = m.on_phase_change("p1", 20)
    assert as_tuples(released) == [(20, "a", "fp32", "sign", "pin released: phase p1")]
    assert m.effective_route("a") == "sign" and m.state()["scopes"]["a"]["trips"] == 0
    assert m.events[-1] == released[0]


def test_phase_change_resets_trip_counts_but_keeps_a_running_hold():
    m = make_monitor()
    feed(m, [1, 1, 1, 20, 1, 1, 20])  # trips at 3 and 6 (probation re-trip)
    assert m.state()["scopes"]["a"]["trips"] == 2
    assert m.on_phase_change("p1", 7) == []
    assert m.state()["scopes"]["a"] == {
        "route": "sign", "effective_route": "fp32", "status": "cooldown",
        "trips": 0, "healthy_run": 0, "hold_until": 8,
    }


def test_nonfinite_step_resets_a_scopes_healthy_run():
    m = make_monitor()
    feed(m, [1, 1, 1, 20, 1, 1, 1])  # trip at 3; cooldown 4-5; step 6 healthy (run 1)
    m.check(StepStats(7, 1.0, True, {"a": 1.0, "b": 1.0}))  # a lone one: "all" does not trip
    feed(m, [1] * 5, start=8)
    # step 7 is not healthy: a's run restarts at 8 and it is re-admitted at 9, not at 8
    assert [(e.step, e.scope, e.to_route) for e in m.events] == [(3, "a", "fp32"), (9, "a", "sign")]


def test_pin_from_ok_is_one_event_with_the_pin_reason():
    m = make_monitor(max_trips=1)
    events = feed(m, [1, 1, 1, 20])
    assert as_tuples(events) == [
        (3, "a", "sign", "fp32", "pinned: 1 trip in phase p0 (grad-norm blow-up 20.0x median)")
    ]


def test_a_lone_nonfinite_step_is_not_a_trip_a_repeat_within_the_window_is():
    m = make_monitor()  # window 5, nonfinite_repeat 2
    assert m.check(StepStats(0, 1.0, True, {"a": 1.0, "b": 1.0})) == []
    assert not m.forced_fp32("a") and m.detections == []
    m.check(StepStats(1, 1.0, False, {"a": 1.0, "b": 1.0}))
    # the count is part of the state: a resumed monitor trips on the repeat as this one would
    again = make_monitor()
    again.load_state_dict(json.loads(json.dumps(m.state_dict())))
    assert again.state_dict() == m.state_dict()
    for mon in (m, again):
        events = mon.check(StepStats(4, math.nan, False, {"a": 1.0}))
        assert as_tuples(events) == [(4, "all", "int8+sign", "fp32", "nonfinite loss (2 in 5 steps)")]
        assert mon.effective_route("a") == mon.effective_route("b") == "fp32"
        assert mon.forced_fp32("all") and mon.state()["scopes"]["a"]["status"] == "ok"

    m = make_monitor()  # 0 and 5 are not within 5 steps of each other
    assert m.check(StepStats(0, 1.0, True, {"a": 1.0})) == []
    assert m.check(StepStats(5, 1.0, False, {"a": math.inf})) == []
    assert as_tuples(m.check(StepStats(6, 1.0, True, {}))) == [
        (6, "all", "int8+sign", "fp32", "nonfinite gradient (2 in 5 steps)")]


def test_nonfinite_repeat_1_trips_all_at_once_and_loss_spike_too():
    m = make_monitor(nonfinite_repeat=1)
    events = m.check(StepStats(0, 1.0, True, {"a": 1.0, "b": 1.0}))
    assert as_tuples(events) == [(0, "all", "int8+sign", "fp32", "nonfinite gradient")]
    assert m.effective_route("a") == m.effective_route("b") == "fp32"
    assert m.forced_fp32("all") and m.state()["scopes"]["a"]["status"] == "ok"

    m = make_monitor(nonfinite_repeat=1)
    assert as_tuples(m.check(StepStats(0, math.nan, False, {"a": 1.0}))) == [
        (0, "all", "int8+sign", "fp32", "nonfinite loss")
    ]
    m = make_monitor(nonfinite_repeat=1)  # an inf norm is non-finite whatever the flag says
    assert m.check(StepStats(0, 1.0, False, {"a": math.inf}))[0].reason == "nonfinite gradient"

    m = make_monitor({"a": "sign", "b": "fp32"})
    for step in range(5):
        m.check(StepStats(step, 1.0, False, {"a": 1.0, "b": 1.0}))
    events = m.check(StepStats(5, 4.2, False, {"a": 1.0, "b": 1.0}))
    assert as_tuples(events) == [(5, "all", "sign", "fp32", "loss spike 4.2x median")]
    assert not m.forced_fp32("b") and m.effective_route("b") == "fp32"


def test_a_late_spike_below_the_floor_of_the_early_loss_does_not_trip():
    """Late in a run a small-batch loss near zero jumps several times its median, far above
    its robust spread, on a hard batch: below loss_spike_floor x the run's early loss it is
    unhealthy (no re-admission on it) but not a trip; above the floor it trips as before."""
    m = make_monitor(loss_spike_z=0.0)  # the ratio and the floor only
    losses = [2.0, 2.2, 2.1, 1.9, 2.0]  # early: median 2.0, the floor 0.25 x 2.0 = 0.5
    losses += [0.05, 0.04, 0.05, 0.06, 0.05]  # late: the window's median is 0.05
    for step, loss in enumerate(losses):
        assert m.check(StepStats(step, loss, False, {"a": 1.0, "b": 1.0})) == []
    assert m.check(StepStats(10, 0.45, False, {"a": 1.0, "b": 1.0})) == []  # 9x, under 0.5
    assert m.detections == []
    events = m.check(StepStats(11, 0.6, False, {"a": 1.0, "b": 1.0}))  # 12x and over 0.5
    assert as_tuples(events) == [(11, "all", "int8+sign", "fp32", "loss spike 12.0x median (37 robust sd)")]
    # the early losses are part of the state: a resumed monitor keeps the same floor
    again = make_monitor(loss_spike_z=0.0)
    again.load_state_dict(json.loads(json.dumps(m.state_dict())))
    assert again.state_dict() == m.state_dict()
    off = make_monitor(loss_spike_z=0.0, loss_spike_floor=0.0)  # 0 turns the floor off
    for step, loss in enumerate(losses):
        off.check(StepStats(step, loss, False, {"a": 1.0, "b": 1.0}))
    assert off.check(StepStats(10, 0.45, False, {"a": 1.0, "b": 1.0}))[0].reason == \
        "loss spike 9.0x median"


def test_a_late_blowup_below_the_scope_s_early_norm_does_not_trip():
    """Late in a converged run one hard batch lifts a scope's norm 10-17x a median that has
    fallen tenfold: below grad_blowup_floor x the scope's early norm that is unhealthy (no
    re-admission on it) but not a trip; above it, it trips as before."""
    m = make_monitor()  # window 5: the early norms are the first 5, median 4.0, the floor 4.0
    events = feed(m, [4.0, 5.0, 3.0, 4.0, 4.0] + [0.2] * 5)  # late: the window's median is 0.2
    assert events == [] and m.detections == []
    assert feed(m, [3.5], start=10) == [] and m.detections == []  # 17.5x, but under 4.0
    events = feed(m, [4.4], start=11)  # 22x and over 4.0
    assert as_tuples(events) == [(11, "a", "sign", "fp32", "grad-norm blow-up 22.0x median")]
    # the early norms are part of the state: a resumed monitor keeps the same floor
    again = make_monitor()
    again.load_state_dict(json.loads(json.dumps(m.state_dict())))
    assert again.state_dict() == m.state_dict()
    off = make_monitor(grad_blowup_floor=0.0)  # 0 turns the floor off
    feed(off, [4.0, 5.0, 3.0, 4.0, 4.0] + [0.2] * 5)
    assert as_tuples(feed(off, [3.5], start=10)) == [
        (10, "a", "sign", "fp32", "grad-norm blow-up 17.5x median")]
    with pytest.raises(InputError, match="grad_blowup_floor must be >= 0"):
        HealthThresholds(grad_blowup_floor=-1.0)


def test_fp32_scopes_are_never_forced():
    m = make_monitor({"a": "fp32", "b": "int8"})
    events = feed(m, [1, 1, 1, 20, 1e-6])
    assert events == [] and not m.forced_fp32("a")
    m = make_monitor({"a": "fp32", "b": "fp32"})
    assert m.check(StepStats(0, 1.0, True, {"a": 1.0, "b": 1.0})) == []
    assert m.effective_route("all") == "fp32"


def test_held_scope_switched_to_fp32_route_drops_its_hold():
    m = make_monitor()
    feed(m, [1, 1, 1, 20])
    assert m.forced_fp32("a")
    m.set_routes({"a": "fp32"})
    m.set_routes({"a": "sign"})
    assert not m.forced_fp32("a") and m.state()["scopes"]["a"]["trips"] == 1


def test_nonfinite_step_values_never_enter_the_windows():
    m = make_monitor()
    for step in range(3):
        m.check(StepStats(step, 1.0, False, {"a": 1.0, "b": 1.0}))
    for step in range(3, 6):  # flagged steps with wild values; if they entered the windows,
        m.check(StepStats(step, 1e-6, True, {"a": 1e6, "b": 1.0}))  # medians would move
    for step in range(6, 12):
        m.check(StepStats(step, 1.0, False, {"a": 1.0, "b": 1.0}))
    # "all": a lone one at 3, tripped by the repeat at 4, re-signalled at 5 (hold to 7),
    # healthy 8 and 9 -> re-admitted 9. With the flagged values in the windows, loss 1.0
    # would be a 1e6x spike and a=1.0 a 1e-6x collapse.
    assert as_tuples(m.events) == [
        (4, "all", "int8+sign", "fp32", "nonfinite gradient (2 in 5 steps)"),
        (9, "all", "fp32", "int8+sign", "re-admitted after 2 healthy checks"),
    ]
    assert m.state()["scopes"]["all"]["trips"] == 1


def random_run(seed: int, reverse_dicts: bool) -> HealthMonitor:
    rng = random.Random(seed)
    m = make_monitor()
    for step in range(200):
        norms = {"a": rng.lognormvariate(0, 0.3), "b": rng.lognormvariate(0, 0.3)}
        if rng.random() < 0.05:
            norms["a"] *= 50
        loss = 1.0 + 0.1 * rng.random() + (5.0 if rng.random() < 0.03 else 0.0)
        nonfinite = rng.random() < 0.06  # lone ones and repeats within the window
        sign = {"a": rng.random() * 0.2}
        if step == 120:
            m.set_routes({"a": "ternary"})
            m.on_phase_change("p1", step)
        if reverse_dicts:
            norms = dict(reversed(norms.items()))
        m.check(StepStats(step, loss, nonfinite, norms, sign))
    return m


def test_deterministic_for_the_same_sequence_on_any_rank():
    one, two = random_run(7, False), random_run(7, True)
    assert one.events == two.events and one.state() == two.state()
    reasons = {e.reason.split(" ")[0] for e in one.events}
    assert {"nonfinite", "loss", "grad-norm", "re-admitted"} <= reasons
    json.dumps(one.state())  # JSON-able


def test_check_rejects_out_of_order_steps_and_unknown_scopes():
    m = make_monitor()
    m.check(StepStats(4, 1.0, False, {}))
    with pytest.raises(ValueError, match="steps must increase"):
        m.check(StepStats(4, 1.0, False, {}))
    with pytest.raises(ValueError, match="unknown scope"):
        m.check(StepStats(5, 1.0, False, {"zz": 1.0}))
    with pytest.raises(InputError, match="unknown health scope"):
        m.set_routes({"zz": "sign"})
    with pytest.raises(InputError, match="unknown route 'int3'"):
        m.set_routes({"a": "int3"})
    with pytest.raises(InputError, match="reserved"):
        HealthMonitor(["all", "a"])


def test_thresholds_round_trip_and_validation():
    assert HealthThresholds.from_dict(None) == HealthThresholds()
    assert HealthThresholds.from_dict(T.to_dict()) == T
    assert HealthThresholds.from_dict({"cooldown": 0}).cooldown == 0
    with pytest.raises(InputError, match=r"unknown health threshold\(s\): bogus, windw"):
        HealthThresholds.from_dict({"windw": 3, "bogus": 1})
    bad = [
        ({"window": 0}, "window must be >= 1"),
        ({"window": 2.5}, "window must be an integer"),
        ({"max_trips": True}, "max_trips must be an integer"),
        ({"min_history": 30}, r"min_history must be in \[1, window=20\]"),
        ({"loss_spike": 0.0}, "loss_spike must be > 1"),
        ({"loss_readmit": 4.0}, "loss_readmit must be in"),
        ({"grad_collapse": -1.0}, r"grad_collapse must be in \(0, 1\)"),
        ({"grad_collapse_loss": 2.0}, r"grad_collapse_loss must be in \[0, 1\]"),
        ({"grad_readmit": 20.0}, "grad_readmit must be in"),
        ({"sign_agreement_min": "x"}, "sign_agreement_min must be a finite number"),
        ({"grad_blowup": math.nan}, "grad_blowup must be a finite number"),
        ({"cooldown": -1}, "cooldown must be >= 0"),
        ({"healthy_to_readmit": 0}, "healthy_to_readmit must be >= 1"),
        ({"nonfinite_repeat": 0}, "nonfinite_repeat must be >= 1"),
        ({"nonfinite_repeat": 2.0}, "nonfinite_repeat must be an integer"),
    ]
    for values, message in bad:
        with pytest.raises(InputError, match=message):
            HealthThresholds.from_dict(values)


def test_event_to_dict_keys():
    e = HealthEvent(3, "a", "sign", "fp32", "why")
    assert e.to_dict() == {"step": 3, "scope": "a", "from": "sign", "to": "fp32", "reason": "why"}


def test_by_default_a_blowup_is_guarded_in_place():
    """grad_blowup_trips 0 (the default): a blow-up is a detection (the controller's guard
    holds that step's update) but no trip: the scope keeps its route, counts no trip and logs
    no switch; its norm joins the window as one value of five, so a lasting new scale becomes
    the median and stops being flagged; a collapse still trips (the route carries nothing)."""
    m = make_monitor(grad_blowup_trips=0)  # window 5, min_history 3
    for step, a in enumerate([1, 1, 1, 20, 1, 30, 1]):
        m.check(StepStats(step, 1.0, False, {"a": a, "b": 1.0}))
        assert not m.forced_fp32("a")
    assert m.events == []
    assert m.detections == [(3, "a", "grad-norm blow-up 20.0x median"),
                            (5, "a", "grad-norm blow-up 30.0x median")]
    assert m.state_dict()["norm_windows"]["a"] == [1.0, 20.0, 1.0, 30.0, 1.0]
    assert m.state_dict()["holds"]["a"]["trips"] == 0
    assert as_tuples(feed(m, [1e-5], start=7)) == [
        (7, "a", "sign", "fp32", "grad-norm collapse 1e-05x median")]
    m = make_monitor(grad_blowup_trips=0)
    feed(m, [1, 1, 1, 1, 1] + [20] * 6)  # a new scale: flagged until it is the median
    assert [s for s, scope, _ in m.detections if scope == "a"] == [5, 6, 7]
    assert m.events == []
    with pytest.raises(InputError, match="grad_blowup_trips must be 0 or 1"):
        HealthThresholds(grad_blowup_trips=2)


def test_a_blowup_whose_loss_rose_with_it_is_a_hard_batch_not_held():
    """`grad_blowup_per_loss` 1 (the default): a blow-up is judged on the norm's rise over the
    loss's. A hard batch lifts both (the runs' own blow-ups at 4x: at most 8.7x over the
    loss's rise); a corrupted gradient, the injected x1e3 spike, the norm alone (128x and
    more). A loss that fell or is unknown leaves the norm's rise as it is. (Late in a run such
    losses sit below the loss-spike floor: here a floor of 10x the early loss.)"""
    late = {"grad_blowup_trips": 0, "loss_spike_floor": 10.0}  # window 5, min_history 3
    cases = [  # (loss, a's norm) at step 3 after a steady 1.0; the detection it gives
        (4.0, 30.0, None),  # 30x the norm on 4x the loss: 7.5x over it, a hard batch
        (2.0, 30.0, "grad-norm blow-up 30.0x median, 15.0x over the loss's rise"),
        (1.0, 20.0, "grad-norm blow-up 20.0x median"),  # the loss did not rise
        (0.5, 20.0, "grad-norm blow-up 20.0x median"),  # nor here: no more held than before
        (None, 20.0, "grad-norm blow-up 20.0x median"),  # no loss observed
        (3.0, 1000.0, "grad-norm blow-up 1000.0x median, 333.3x over the loss's rise"),
    ]
    for loss, norm, why in cases:
        m = make_monitor(**late)
        for step in range(3):
            m.check(StepStats(step, None if loss is None else 1.0, False, {"a": 1.0, "b": 1.0}))
        m.check(StepStats(3, loss, False, {"a": norm, "b": 1.0}))
        assert m.detections == ([] if why is None else [(3, "a", why)]), (loss, norm)
        assert m.events == [] and not m.forced_fp32("a")
        # judged on the norm alone (0), the same step is held as a blow-up
        m = make_monitor(**late, grad_blowup_per_loss=0)
        feed(m, [1, 1, 1])
        m.check(StepStats(3, loss, False, {"a": norm, "b": 1.0}))
        assert m.detections == [(3, "a", f"grad-norm blow-up {norm:.1f}x median")]
    with pytest.raises(InputError, match="grad_blowup_per_loss must be 0 or 1"):
        HealthThresholds(grad_blowup_per_loss=2)


def test_a_profile_keeps_the_blowup_rule_it_was_proven_with():
    """A calibrated profile stores every threshold; one that predates `grad_blowup_per_loss`
    judges blow-ups on the norm alone, as when it was proven. A partial mapping that is no
    calibrated profile's (the spec's raised spike floor a calibration trains its trials with,
    a hand-written profile) takes the defaults, as does no health metadata."""
    stored = HealthThresholds().to_dict()
    del stored["grad_blowup_per_loss"]
    calibrated = {"source": "calibrate"}
    old = {"health": stored, "provenance": calibrated}
    assert HealthThresholds.from_profile(old).grad_blowup_per_loss == 0
    assert HealthThresholds.from_profile(old) == HealthThresholds(grad_blowup_per_loss=0)
    new = {"health": HealthThresholds().to_dict(), "provenance": calibrated}
    assert HealthThresholds.from_profile(new) == HealthThresholds()
    assert HealthThresholds.from_profile({}) == HealthThresholds()
    trial = {"world_size": 4, "health": {"loss_spike_floor": 1.0}}  # a calibration's trial
    assert HealthThresholds.from_profile(trial).grad_blowup_per_loss == 1
    assert HealthThresholds.from_profile({"health": stored}).grad_blowup_per_loss == 1
    assert HealthThresholds.from_dict({"cooldown": 3}).grad_blowup_per_loss == 1


def test_a_profile_keeps_the_cap_its_blowups_were_held_at():
    """`blowup_cap` came after the reference profiles were calibrated: one that lacks it holds
    a blow-up's step at `update_cap` (0), as when it was proven; the default is 1."""
    stored = HealthThresholds().to_dict()
    del stored["blowup_cap"]
    old = {"health": stored, "provenance": {"source": "calibrate"}}
    assert HealthThresholds.from_profile(old) == HealthThresholds(blowup_cap=0)
    assert HealthThresholds().blowup_cap == 1
    assert HealthThresholds.from_profile({"health": stored}).blowup_cap == 1
    with pytest.raises(InputError, match="^health threshold blowup_cap must be >= 0"):
        HealthThresholds(blowup_cap=-1)


def test_with_the_update_guard_off_a_blowup_trips():
    """`update_cap` 0: nothing would hold a blow-up in place, so it trips the scope."""
    m = make_monitor(grad_blowup_trips=0, update_cap=0.0)
    assert as_tuples(feed(m, [1, 1, 1, 20])) == [
        (3, "a", "sign", "fp32", "grad-norm blow-up 20.0x median")]


def test_with_loss_spike_repeat_a_lone_spike_is_guarded_and_a_repeat_trips():
    """`loss_spike_repeat` 2: a lone loss spike is a detection under "all" (the controller's
    guard holds every scope's update) but no trip, and its loss joins the window; a second
    within `window` steps trips every scope, counted in the reason; the count survives a
    checkpoint; spikes further apart are each held; with the guard off every spike trips."""
    def losses(m: HealthMonitor, values: list[float], start: int = 0) -> list[HealthEvent]:
        out = []
        for i, loss in enumerate(values):
            out += m.check(StepStats(start + i, loss, False, {"a": 1.0, "b": 1.0}))
        return out

    m = make_monitor(loss_spike_repeat=2)  # window 5, min_history 3
    assert losses(m, [1.0] * 5 + [4.2]) == []
    assert m.detections == [(5, "all", "loss spike 4.2x median")]
    assert not m.forced_fp32("a") and m.state_dict()["loss_window"][-1] == 4.2
    again = make_monitor(loss_spike_repeat=2)
    again.load_state_dict(json.loads(json.dumps(m.state_dict())))
    for mon in (m, again):
        events = losses(mon, [1.0, 4.4], start=6)
        assert as_tuples(events) == [
            (7, "all", "int8+sign", "fp32", "loss spike 4.4x median (2 in 5 steps)")]
        assert mon.effective_route("a") == mon.effective_route("b") == "fp32"

    m = make_monitor(loss_spike_repeat=2)  # steps 5 and 10: not within 5 steps
    assert losses(m, [1.0] * 5 + [4.2] + [1.0] * 4 + [4.0]) == []
    assert [s for s, _, _ in m.detections] == [5, 10]
    m = make_monitor(loss_spike_repeat=2, update_cap=0.0)  # nothing would hold it
    assert as_tuples(losses(m, [1.0] * 5 + [4.2])) == [
        (5, "all", "int8+sign", "fp32", "loss spike 4.2x median (1 in 5 steps)")]
    with pytest.raises(InputError, match="loss_spike_repeat must be >= 1"):
        HealthThresholds(loss_spike_repeat=0)
