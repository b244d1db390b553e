"""The step controller's rule per trigger: what leaves the hook after a trip, and re-admission."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch
from torch import nn

from nfabric_cli.binding import compile_profile, static_profile
from nfabric_cli.errors import InputError
from nfabric_cli.profile.phases import Phase
from nfabric_cli.profile.thresholds import HealthThresholds
from nfabric_cli.runtime.controller import ABS_CHUNK, StepController, StepDecision, mean_abs
from nfabric_cli.runtime.guard import UpdateGuard
from nfabric_cli.runtime.health import HealthMonitor, StepStats

# Blow-ups trip to fp32 here (grad_blowup_trips=1): the simplest trip, to test what a hold and a
# re-admission deliver; the default, a blow-up guarded in place, is the first test.
HEALTH = {"window": 8, "min_history": 4, "cooldown": 2, "healthy_to_readmit": 2, "update_cap": 1.0,
          "grad_blowup_trips": 1}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)


def controller(route: str = "sign", passive: bool = False,
               **health) -> tuple[StepController, list[dict]]:
    model = Net()
    profile = static_profile(model, route, world_size=2)
    bindings = compile_profile(profile, model, world_size=2, total_steps=100)
    bindings.meta["health"] = {**HEALTH, **health}
    log: list[dict] = []
    return StepController(bindings, 100, 2, log.append, passive=passive), log


def step(c: StepController, loss: float, grad: float, update: float, nonfinite: bool = False):
    """One step: every parameter's update norm is `update` / 2 (4 parameters: scope norm =
    `update`), the scope's gradient norm `grad`."""
    s = c.step
    each = update / 2
    names = list(c.bindings.params)
    d = c.decide(s, loss, nonfinite, {"*": grad}, {}, {n: each for n in names})
    c.advance(s)
    return d


@pytest.mark.parametrize("trips", [0, 1])
def test_a_gradient_blowup_is_held_to_the_healthy_median_on_its_own_step(trips: int):
    """By default (trips 0) a blow-up is guarded in place: its own update held, the route
    kept, the next step's update untouched, the held update out of the guard's window; with
    `grad_blowup_trips` 1 the scope also falls back to fp32, held while it is."""
    c, log = controller(grad_blowup_trips=trips)
    healthy = [1.0, 1.2, 0.8, 1.1, 0.9, 1.0]
    for u in healthy:
        assert step(c, 1.0, 1.0, u).scales == {}
    d = step(c, 1.0, 50.0, 30.0)  # the raw spike, reduced on the low-bit route
    median = statistics.median(healthy)
    assert d.scales == {"*": pytest.approx(median / 30.0, rel=1e-12)}
    assert 30.0 * d.scales["*"] == pytest.approx(median, rel=1e-12)  # norm that leaves = median
    held = [e for e in log if e["to"] == "held"]
    assert len(held) == 1 and held[0]["step"] == 6 and "held to 1" in held[0]["reason"]
    assert "grad-norm blow-up 50.0x median" in held[0]["reason"]  # what it was held for
    assert c.monitor.detections == [(6, "*", "grad-norm blow-up 50.0x median")]
    assert [e["to"] for e in log if e["to"] in ("fp32", "sign")] == ["fp32"] * trips
    assert (c.effective("body.weight").name == "fp32") == bool(trips)
    after = step(c, 1.0, 1.0, 1.0)
    assert after.scales == {}
    if not trips:
        assert c.guard.state_dict()["windows"]["*"] == healthy + [1.0]


def test_a_blowup_on_a_hard_batch_is_not_held_unless_the_profile_predates_the_rule():
    """The step's loss rose 8x with the norm's 50x (6.25x over it): a hard batch, its update
    goes through as without the monitor. A profile whose stored thresholds predate
    `grad_blowup_per_loss` (a calibrated profile stores every threshold) holds it, as the
    profile did when it was proven."""
    stored = {**HealthThresholds().to_dict(), **HEALTH, "grad_blowup_trips": 0,
              "loss_spike_floor": 10.0}  # late in a run: the loss under the spike floor
    for predated, held in ((False, False), (True, True)):
        health = {k: v for k, v in stored.items() if not (predated and k == "grad_blowup_per_loss")}
        c, log = controller()
        c.bindings.meta["health"] = health
        c.bindings.meta["provenance"] = {"source": "calibrate"}  # stores every threshold
        c = StepController(c.bindings, 100, 2, log.append)
        assert c.monitor.thresholds.grad_blowup_per_loss == (0 if predated else 1)
        for u in [1.0, 1.2, 0.8, 1.1, 0.9, 1.0]:
            step(c, 1.0, 1.0, u)
        d = step(c, 8.0, 50.0, 30.0)
        assert (d.scales != {}) == held, predated
        assert [e["to"] for e in log] == (["held"] if held else [])


@pytest.mark.parametrize("blowup_cap, first", [(1.0, 1.0), (0.0, 2.0), (1.5, 1.5)])
def test_a_blowups_own_step_is_held_to_blowup_cap_and_the_steps_held_after_to_update_cap(
        blowup_cap: float, first: float):
    """The step a blow-up is detected on leaves the hook at `blowup_cap` x the healthy median
    (1: about one healthy update); the steps its scope is held after (tripped here,
    `grad_blowup_trips` 1) at `update_cap` (2). `blowup_cap` 0, the rule of profiles calibrated
    before it, holds the blow-up's step at `update_cap` too."""
    c, log = controller(update_cap=2.0, blowup_cap=blowup_cap)
    for u in [1.0, 1.2, 0.8, 1.1, 0.9, 1.0]:  # median 1.0
        step(c, 1.0, 1.0, u)
    d = step(c, 1.0, 50.0, 30.0)
    assert 30.0 * d.scales["*"] == pytest.approx(first, rel=1e-12)
    (held,) = [e for e in log if e["to"] == "held"]
    assert held["reason"].startswith(f"update norm 30 held to {first:g} ({first:g} x median")
    assert c.effective("body.weight").name == "fp32"  # held after, on fp32
    d = step(c, 1.0, 1.0, 5.0)
    assert 5.0 * d.scales["*"] == pytest.approx(2.0, rel=1e-12)


def test_a_loss_spikes_hold_is_capped_at_update_cap_not_blowup_cap():
    """A loss spike holds every scope's update at `update_cap`: `blowup_cap` is the blow-up's."""
    c, log = controller(update_cap=2.0, blowup_cap=1.0, loss_spike_z=0.0, loss_spike_floor=0.0)
    for u, loss in zip([1.0, 1.2, 0.8, 1.1, 0.9, 1.0], [1.0, 1.1, 0.9, 1.0, 1.05, 0.95], strict=True):
        step(c, loss, 1.0, u)
    d = step(c, 10.0, 1.0, 30.0)  # the loss 10x its median, the gradient norm as before
    ((_, scope, why),) = c.monitor.detections
    assert scope == "all" and why.startswith("loss spike 10.0x median")
    assert 30.0 * d.scales["*"] == pytest.approx(2.0, rel=1e-12)


def test_a_scope_no_rank_used_is_neither_held_nor_in_the_guards_window():
    """DDP leaves the parameters of a scope no rank used untouched, so there is no update to
    hold, and its norm (a low-bit route's output for zeros) is not a healthy update."""
    c, log = controller()
    for u in [1.0, 1.2, 0.8, 1.1, 0.9]:
        step(c, 1.0, 1.0, u)
    window = c.guard.state_dict()["windows"]["*"]
    d = step(c, 1.0, 0.0, 30.0)  # no gradient anywhere; the route still sends something
    assert d.scales == {} and log == [] and c.monitor.detections == []
    assert c.guard.state_dict()["windows"]["*"] == window


def test_every_held_step_is_capped_and_a_smaller_update_is_never_scaled_up():
    c, _ = controller(update_cap=1.5)
    for u in [2.0] * 6:
        step(c, 1.0, 1.0, u)
    step(c, 1.0, 50.0, 10.0)  # trip
    d_big = step(c, 1.0, 1.0, 9.0)  # cooldown, fp32 raw update is large
    d_small = step(c, 1.0, 1.0, 1.0)  # cooldown, small update
    assert d_big.scales == {"*": pytest.approx(3.0 / 9.0)}  # 1.5 x median 2.0
    assert d_small.scales == {}
    assert [s for s, _, _ in c.held] == [6, 7]


def test_held_updates_never_enter_the_window_and_readmission_restores_the_route():
    c, log = controller()
    for u in [1.0] * 6:
        step(c, 1.0, 1.0, u)
    step(c, 1.0, 50.0, 30.0)  # trip at 6: cooldown 7-8, probation from 9
    for _ in range(6):
        step(c, 1.0, 1.0, 5.0)  # fp32 updates 5x larger: held to 1.0 until re-admitted
    readmit = [e for e in log if e["to"] == "sign"]
    assert [e["step"] for e in readmit] == [10]
    assert [s for s, _, _ in c.held] == [6, 7, 8, 9, 10]
    # After re-admission the updates count again, and the window still says 1.0 then 5.0s.
    assert c.guard.state_dict()["windows"]["*"] == [1.0] * 6 + [5.0] * 2


def test_readmission_keeps_the_update_magnitude_continuous():
    """Across the trip and the re-admission, the norm that leaves the hook never jumps by
    more than the healthy window's own spread, although fp32 delivers 4x sign's norm."""
    c, log = controller()
    sign_norms = [1.0, 1.1, 0.9, 1.05, 0.95, 1.0]
    delivered = []
    for u in sign_norms:
        step(c, 1.0, 1.0, u)
        delivered.append(u)
    raw = [40.0] + [4.0] * 4 + [1.0, 1.02]  # trip at 6; fp32 for 7-10; re-admitted at 10: sign
    for u in raw:
        d = step(c, 1.0, 50.0 if u == 40.0 else 1.0, u)
        delivered.append(u * d.scales.get("*", 1.0))
    assert [e["to"] for e in log if e["to"] in ("fp32", "sign")] == ["fp32", "sign"]
    lo, hi = min(sign_norms), max(sign_norms)
    jumps = [b / a for a, b in zip(delivered, delivered[1:], strict=False)]
    assert max(jumps) <= hi / lo + 1e-12 and min(jumps) >= lo / hi - 1e-12


def test_a_nonfinite_step_is_skipped_and_its_update_is_not_recorded():
    c, log = controller()
    for u in [1.0] * 5:
        step(c, 1.0, 1.0, u)
    d = step(c, math.nan, math.nan, math.nan, nonfinite=True)
    assert d.skip and d.scales == {} and c.skipped_steps == [5]
    assert [e["to"] for e in log] == ["skipped"]  # a lone one: no fallback
    d = step(c, 1.0, 1.0, math.nan, nonfinite=True)  # the repeat falls back, and is skipped
    assert d.skip and c.skipped_steps == [5, 6]
    assert [e["to"] for e in log] == ["skipped", "fp32", "skipped"]
    assert c.guard.state_dict()["windows"]["*"] == [1.0] * 5


@pytest.mark.parametrize("mode", ["zero", "pass"])
def test_a_nonfinite_update_from_finite_gradients_is_a_nonfinite_step(mode: str):
    """An fp16 wire overflows past 65504 with every input finite: the reduced update's norm
    is what shows it, and the step is neutralised (or left to the loss scaler) as one whose
    gradients were not finite, never passed to the optimizer."""
    c, log = controller()
    c.nonfinite = mode
    for u in [1.0] * 5:
        assert not step(c, 1.0, 1.0, u).skip
    d = step(c, 1.0, 1.0, math.inf, nonfinite=False)
    assert d.skip and d.scales == {} and c.skipped_steps == [5]
    assert [e["to"] for e in log] == ["skipped"]
    assert not step(c, 1.0, 1.0, 1.0).skip  # the next, finite, step goes through


def test_a_resume_with_another_total_steps_enters_the_phase_it_lands_in():
    """Step 10 of 100 is in the warm-up; resumed with total_steps 15 it is in the main phase.
    The monitor takes that phase (its routes; trip counts reset), as a run crossing the
    boundary would, instead of judging on under the saved phase."""
    model = Net()
    phases = [Phase("warmup", 0.0, 0.5), Phase("main", 0.5, 1.0)]
    profile = static_profile(model, "sign", phases=phases, world_size=2)
    bindings = compile_profile(profile, model, world_size=2, total_steps=100)
    bindings.meta["health"] = dict(HEALTH)
    log: list[dict] = []
    c = StepController(bindings, 100, 2, log.append)
    for u in [1.0] * 5:
        step(c, 1.0, 1.0, u)
    step(c, 1.0, 1.0, math.nan, nonfinite=True)
    step(c, 1.0, 1.0, math.nan, nonfinite=True)  # the repeat trips the scope to fp32
    for _ in range(3):
        step(c, 1.0, 1.0, 1.0)
    trips = {s: v["trips"] for s, v in c.monitor.state()["scopes"].items() if v["trips"]}
    assert c.step == 10 and c.phase.name == "warmup" and trips
    saved = json.loads(json.dumps(c.state_dict()))
    same = StepController(bindings, 100, 2, log.append)
    same.load_state_dict(saved)
    assert same.monitor.phase == "warmup"
    assert {s: v["trips"] for s, v in same.monitor.state()["scopes"].items() if v["trips"]} == trips
    shorter = StepController(bindings, 15, 2, log.append)
    shorter.load_state_dict(saved)
    assert shorter.phase.name == shorter.monitor.phase == "main"
    assert all(v["trips"] == 0 for v in shorter.monitor.state()["scopes"].values())


def test_scopes_on_fp32_and_the_monitor_switched_off_are_never_scaled():
    c, _ = controller()
    c.monitor_enabled = False
    for u in [1.0] * 6:
        step(c, 1.0, 1.0, u)
    assert step(c, 1.0, 50.0, 30.0).scales == {}


def test_an_all_fp32_phase_is_plain_ddp_and_passive_detectors_act_on_nothing():
    """A phase with every parameter on fp32 goes out as plain DDP in the hook: nothing is
    judged, held or skipped there, in the simulator either. Passive (benchmarks): the
    detectors judge and nothing acts."""
    c, log = controller(route="fp32")
    assert c.plain_phases == {"all"} and c.plain  # static_profile: one phase
    for u in [1.0] * 6:
        step(c, 1.0, 1.0, u)
    assert step(c, 1.0, 50.0, 30.0).scales == {}  # a blow-up passes, as in plain DDP
    assert step(c, math.nan, math.nan, math.nan, nonfinite=True).skip is False
    assert log == [] and c.monitor.detections == [] and c.skipped_steps == []
    p, plog = controller(passive=True)  # sign routes: the monitor would hold and trip
    for u in [1.0] * 6:
        step(p, 1.0, 1.0, u)
    d = step(p, 1.0, 50.0, 30.0)
    assert d.scales == {} and not d.skip
    assert [why for _, _, why in p.monitor.detections] == ["grad-norm blow-up 50.0x median"]
    assert [e["to"] for e in plog] == ["fp32"]  # the trip it would make, logged ...
    assert p.forced() == frozenset()  # ... and acted on nowhere
    assert all(p.effective(n).name == "sign" for n in p.bindings.params)
    assert step(p, math.nan, math.nan, math.nan, nonfinite=True).skip is False


def test_guard_window_and_cap_rules():
    g = UpdateGuard(["a", "b"], window=3, min_history=2, cap=1.0)
    assert g.judge({"a": 1.0}, held={"a"}, skipped=False) == []  # no history yet
    for v in (2.0, 4.0, 8.0, 16.0):
        g.judge({"a": v, "b": 1.0}, held=(), skipped=False)
    assert g.state_dict()["windows"] == {"a": [4.0, 8.0, 16.0], "b": [1.0, 1.0, 1.0]}
    (held,) = g.judge({"a": 80.0, "b": 1.0}, held={"a"}, skipped=False)
    assert (held.scope, held.cap, held.factor) == ("a", 8.0, 0.1)
    assert UpdateGuard(["a"], 3, 1, cap=0.0).judge({"a": 9.0}, {"a"}, False) == []


def test_loss_spike_needs_many_robust_deviations_as_well_as_a_ratio():
    """Small-batch losses near zero triple on noise: not a spike. A jump far outside the
    window's spread is one."""
    t = HealthThresholds(window=10, min_history=5)
    noisy = [0.01, 0.03, 0.02, 0.05, 0.01, 0.04, 0.02, 0.03]
    m = HealthMonitor(["a"], t)
    m.set_routes({"a": "sign"})
    for i, v in enumerate(noisy):
        m.check(StepStats(i, v, False, {"a": 1.0}))
    assert m.check(StepStats(8, 0.09, False, {"a": 1.0})) == []  # 3.6x median, ~4 sd
    (ev,) = m.check(StepStats(9, 0.9, False, {"a": 1.0}))
    assert ev.to_route == "fp32" and ev.reason.startswith("loss spike 30.0x median (")
    off = HealthMonitor(["a"], HealthThresholds(window=10, min_history=5, loss_spike_z=0))
    off.set_routes({"a": "sign"})
    for i, v in enumerate(noisy):
        off.check(StepStats(i, v, False, {"a": 1.0}))
    assert [e.to_route for e in off.check(StepStats(8, 0.09, False, {"a": 1.0}))] == ["fp32"]


def test_readmission_is_judged_against_the_run_before_the_trip():
    """The spike's own losses never fill the window: a run stuck at 4x its pre-trip loss
    stays on fp32 (before, the window filled with high losses and re-admitted it)."""
    t = HealthThresholds(window=6, min_history=3, cooldown=1, healthy_to_readmit=2,
                         loss_spike_z=0)
    m = HealthMonitor(["a"], t)
    m.set_routes({"a": "sign"})
    losses = [1.0, 1.0, 1.0, 5.0] + [4.0] * 12
    for i, v in enumerate(losses):
        m.check(StepStats(i, v, False, {"a": 1.0}))
    assert [e.to_route for e in m.events] == ["fp32"]
    assert m.forced_fp32("a")


@pytest.mark.parametrize(("field", "value"), [("update_cap", -1.0), ("loss_spike_z", -0.5)])
def test_new_thresholds_are_validated(field: str, value: float):
    with pytest.raises(InputError, match=f"health threshold {field} must be >= 0"):
        HealthThresholds.from_dict({field: value})


def test_a_lone_loss_spike_under_loss_spike_repeat_holds_every_scope_and_keeps_the_route():
    """`loss_spike_repeat` 2: the spike's own update is held to the healthy median, with an
    event that says why and that the route is kept; the next update passes untouched."""
    c, log = controller(loss_spike_repeat=2)
    for u in [1.0, 1.2, 0.8, 1.1, 0.9, 1.0]:
        step(c, 1.0, 1.0, u)
    d = step(c, 5.0, 1.0, 4.0)
    assert d.scales == {"*": pytest.approx(1.0 / 4.0, rel=1e-12)}
    assert c.effective("body.weight").name == "sign"
    (held,) = [e for e in log if e["to"] == "held"]
    assert "for loss spike 5.0x median" in held["reason"] and "route kept" in held["reason"]
    assert not [e for e in log if e["to"] == "fp32"]
    assert step(c, 1.0, 1.0, 1.0).scales == {}


def test_steps_the_model_gate_refuses_are_plain_and_the_rule_survives_a_checkpoint():
    """Once every low-bit bucket a step priced is refused, the phase's next steps go out as
    plain DDP's (`gated_off`): only a non-finite step is zeroed, nothing is judged. The
    priced keys are saved, so a resumed run sends its first step as the uninterrupted one."""
    from nfabric_cli.calibration.traffic import gated

    c, log = controller()
    c.bindings.meta["substrate"] = {"link_gbps": 100.0, "latency_us": 1.0,
                                    "codec_call_us": {"sign": 6000.0}}
    c, log = StepController(c.bindings, 100, 2, log.append), log
    assert not c.gated_off()  # nothing priced yet
    keys = [(tuple(b.params), "all") for b in c.bindings.buckets]
    routes = gated(c.bindings, "all", c.effective, c.gate)  # prices (and refuses) each bucket
    assert all(routes(n).name == "fp32" for n in c.bindings.params)
    c.priced(keys)
    assert c.gated_off()
    assert c.direct(7, finite=True).skip is False and log == []
    assert c.direct(8, finite=False).skip is True
    assert c.skipped_steps == [8] and [e["to"] for e in log] == ["skipped"]
    resumed = StepController(c.bindings, 100, 2, log.append)
    resumed.load_state_dict(json.loads(json.dumps(c.state_dict())))  # as a checkpoint keeps it
    assert resumed.gated_off()
    # a planned low-bit bucket the gate has not refused (never priced, or admitted: one the
    # monitor holds on fp32, say) keeps the steps on the worker, where re-admission happens
    resumed.priced([*keys, (("body.weight",), "all")])
    assert not resumed.gated_off()
    old = {k: v for k, v in c.state_dict().items() if k != "priced"}  # saved before the rule
    again = StepController(c.bindings, 100, 2, log.append)
    again.load_state_dict(old)
    assert not again.gated_off()


def _phased(first: str, then: str, monitor: bool = True,
            **health) -> tuple[StepController, list[dict]]:
    """Steps 0-9 on route `first`, 10-19 on `then` (20 steps, every parameter alike)."""
    import dataclasses

    from nfabric_cli.profile.operating import OperatingProfile

    model = Net()
    phases = [Phase("early", 0.0, 0.5), Phase("late", 0.5, 1.0)]
    profile = static_profile(model, first, phases=phases, world_size=2)
    rows = [dataclasses.replace(r, route=then) if r.phase == "late" else r for r in profile.rows]
    bindings = compile_profile(OperatingProfile(rows, profile.meta), model, world_size=2,
                               total_steps=20)
    bindings.meta["health"] = {**HEALTH, "update_cap": 2.0, **health}
    log: list[dict] = []
    return StepController(bindings, 20, 2, log.append, monitor=monitor), log


def test_a_route_change_at_a_phase_boundary_ramps_the_update_until_a_window_of_it_fits():
    """sign for 10 steps (updates of norm 1), then fp32, whose raw updates are 10x: each
    leaves the hook at no more than 2 x the median of what the scope delivered before it
    (the ramp's own deliveries included, so the cap rises), and the ramp closes once a
    window (8) of updates in a row fit. The plain fp32 phase is judged until then, plain
    DDP's after. With the monitor off nothing ramps."""
    c, log = _phased("sign", "fp32")
    assert c.plain_phases == {"late"}
    for _ in range(10):
        assert step(c, 1.0, 1.0, 1.0).scales == {}
    assert c.phase.name == "late" and not c.plain  # a ramp is open: judged, not plain DDP's
    delivered, window, clips = [], [1.0] * 8, []
    while not c.plain:
        d = step(c, 1.0, 10.0, 10.0)
        out = 10.0 * d.scales.get("*", 1.0)
        assert out <= 2.0 * statistics.median(window) * (1 + 1e-12)  # never a step change
        delivered.append(out)
        clips.append(d.clips.get("*"))
        window = (window + [out])[-8:]
        assert len(delivered) < 40
    # to a full-precision wire: every element clipped too, at 3 x its mean |update| doubling
    # every half window (4 steps), while the ramp is open
    assert clips == [pytest.approx(3.0 * 2 ** (i / 4)) for i in range(len(delivered))]
    capped = [x for x in delivered if x < 10.0]
    assert delivered[0] == pytest.approx(2.0) and capped == sorted(capped)  # rising
    assert delivered[len(capped):] == [10.0] * 8  # closed after 8 that fit
    ramped = [e for e in log if "ramped" in (e["to"], e["from"])]
    assert [(e["from"], e["to"], e["step"]) for e in ramped] == [
        ("update", "ramped", 10), ("ramped", "update", 9 + len(delivered))]
    assert ramped[0]["reason"].startswith(
        "phase 'late': sign/sharded -> fp32 from step 10: each element clipped to 3 x its "
        "parameter's mean |update|, doubling every 4 steps; update norm 10 held to 2 (2 x "
        "median of its recent")
    assert not [e for e in log if e["to"] == "held"]  # a ramp is no monitor hold
    assert step(c, 1.0, 10.0, 50.0).scales == {}  # plain DDP's again: nothing judged
    off, off_log = _phased("sign", "fp32", monitor=False)
    for _ in range(10):
        step(off, 1.0, 1.0, 1.0)
    assert off.plain and step(off, 1.0, 10.0, 10.0).scales == {} and off_log == []


def test_a_route_change_that_keeps_the_magnitude_closes_its_ramp_at_once_and_resumes():
    """sign -> int8 with the update's norm within 2 x its median: the first update fits, the
    ramp closes with no event (1.5x passes, 3x would have been capped). A ramp open at a
    checkpoint resumes where it was, to the same decisions; a resume with another
    total_steps that lands past the boundary opens the ramp a run crossing it would."""
    for update, capped in ((1.5, False), (3.0, True)):
        c, log = _phased("sign", "int8")
        for _ in range(10):
            step(c, 1.0, 1.0, 1.0)
        assert c._ramps  # opened at the boundary
        assert (step(c, 1.0, 1.0, update).scales != {}) == capped
        assert bool(c._ramps) == capped and bool(log) == capped
    a, _ = _phased("sign", "fp32")
    for _ in range(10):
        step(a, 1.0, 1.0, 1.0)
    step(a, 1.0, 10.0, 10.0)  # one capped step: the ramp is open
    saved = json.loads(json.dumps(a.state_dict()))
    b, _ = _phased("sign", "fp32")
    b.load_state_dict(saved)
    assert not b.plain
    for _ in range(12):
        assert step(a, 1.0, 10.0, 10.0).scales == step(b, 1.0, 10.0, 10.0).scales
    early, _ = _phased("sign", "fp32")
    for _ in range(8):  # step 8 of 20: still on sign
        step(early, 1.0, 1.0, 1.0)
    shorter = StepController(early.bindings, 12, 2, [].append)  # step 8 of 12: fp32's phase
    shorter.load_state_dict(json.loads(json.dumps(early.state_dict())))
    assert shorter.phase.name == "late" and not shorter.plain
    assert step(shorter, 1.0, 10.0, 10.0).scales == {"*": pytest.approx(0.2)}


def test_a_restored_ramp_follows_the_resumed_runs_clip_and_monitor():
    """A ramp saved while it clips, resumed with `ramp_clip` 0 or the guard off, clips nothing
    (it once clipped to 0 x the mean |update|: every element zeroed; the guard off, it clipped
    on); resumed with the monitor off it is dropped: the fp32 phase is plain DDP's at once
    (a ramp only the monitor closes kept it off that path for good)."""
    a, _ = _phased("sign", "fp32")
    for _ in range(10):
        step(a, 1.0, 1.0, 1.0)
    assert step(a, 1.0, 10.0, 10.0).clips == {"*": pytest.approx(3.0)}
    saved = json.loads(json.dumps(a.state_dict()))
    for health, held in (({"ramp_clip": 0.0}, True), ({"update_cap": 0.0}, False)):
        b, _ = _phased("sign", "fp32", **health)
        b.load_state_dict(saved)
        assert b._ramps["*"][4] is False  # a norm ramp now: no window of clips to sit out
        d = step(b, 1.0, 10.0, 10.0)
        assert d.clips == {} and (d.scales != {}) == held
    off, off_log = _phased("sign", "fp32", monitor=False)
    off.load_state_dict(saved)
    assert off.plain and not off._ramps and not off.guarding
    d = step(off, 1.0, 10.0, 10.0)
    assert (d.scales, d.clips, off_log) == ({}, {}, [])


def test_a_boundary_to_fp32_clips_only_a_scope_the_last_step_sent_low_bit():
    """At a sign -> fp32 boundary, a scope the capacity gate already sends on fp32 (the whole
    step as plain DDP's) changes no wire: the clipping ramp its switch to fp32 opened goes on as it was (its multiple
    doubling from that switch), not replaced by one that starts the clip again; with no ramp
    open, the boundary's ramp holds the norm and clips nothing. Sent low-bit up to the
    boundary, the scope clips from it (the first test)."""
    c, log = _phased("sign", "fp32")
    for lowbit in [True] * 8 + [False] * 2:  # the gate sends steps 8 and 9 on fp32
        _gate_step(c, lowbit, 1.0 if lowbit else 10.0)
    assert c.phase.name == "late" and c._ramps["*"][0] == 8
    d = step(c, 1.0, 10.0, 10.0)  # step 10: the switch's third clipped step
    assert d.clips == {"*": pytest.approx(3.0 * 2 ** (2 / 4))}
    assert [(e["step"], e["from"], e["to"]) for e in log] == [(8, "update", "ramped")]
    quiet, quiet_log = _phased("sign", "fp32", window=2, min_history=2)
    for lowbit in [True] * 8 + [False] * 2:  # a window of 2: the switch's ramp closed at 9
        _gate_step(quiet, lowbit, 1.0)
    assert [(e["step"], e["from"], e["to"]) for e in quiet_log] == [
        (8, "update", "ramped"), (9, "ramped", "update")]
    assert quiet._ramps["*"][0] == 10 and quiet._ramps["*"][4] is False  # (no clip)
    d = step(quiet, 1.0, 1.0, 1.0)
    assert (d.scales, d.clips, quiet._ramps) == ({}, {}, {})  # fits: closed at once
    # some of the scope's buckets refused by a model gate (its regions named, not the whole
    # step): part of it may have gone low-bit, so the boundary clips, from 3x again
    part, _ = _phased("sign", "fp32")
    for s in range(10):
        part.refused(s, {"*"} if s >= 8 else ())
        part.decide(s, 1.0, False, {"*": 1.0}, {}, {n: 0.5 for n in part.bindings.params})
        part.advance(s)
    assert part._ramps["*"][0] == 10 and step(part, 1.0, 10.0, 10.0).clips == {
        "*": pytest.approx(3.0)}


def _gate_step(c: StepController, lowbit: bool, update: float):
    """One step the capacity gate sends low-bit (judged on the worker) or on fp32 as plain
    DDP's (`direct`, its update norms passed while a ramp is open, as the hook reads them)."""
    s, names = c.step, list(c.bindings.params)
    c.refused(s, () if lowbit else None)
    norms = {n: update / 2 for n in names}
    if lowbit:
        d = c.decide(s, 1.0, False, {"*": 1.0}, {}, norms)
    else:
        d = c.direct(s, True, norms if c.guarding else None)
    c.advance(s)
    return d


def test_the_gates_switch_to_fp32_and_back_ramps_the_update_on_plain_ddps_path():
    """sign (updates of norm 1), then the gate sends steps on fp32 as plain DDP's (a measured
    gate's probe block; raw updates 10x): held to 2 x the median of what the scope delivered,
    rising, and each element clipped, as a phase's route change to fp32 is; back on sign a
    ramp opens the other way, clips nothing and closes at its first update that fits. A
    clipping ramp lasts a window however small the updates. Only an open ramp asks for
    update norms on a direct step; the last step's wire survives a checkpoint; with the
    monitor off nothing ramps."""
    c, log = controller(update_cap=2.0)
    for _ in range(10):
        assert _gate_step(c, True, 1.0).scales == {}
    saved = json.loads(json.dumps(c.state_dict()))
    assert not c.guarding
    decisions = [_gate_step(c, False, 10.0) for _ in range(4)]
    outs = [10.0 * d.scales["*"] for d in decisions]
    assert outs[0] == pytest.approx(2.0) and outs == sorted(outs) and outs[-1] < 10.0
    # to fp32: each element clipped too, 3 x its mean |update| doubling every half window
    assert [d.clips["*"] for d in decisions] == [pytest.approx(3 * 2 ** (i / 4)) for i in range(4)]
    assert [(e["step"], e["from"], e["to"]) for e in log] == [(10, "update", "ramped")]
    assert log[0]["reason"].startswith(
        "low-bit -> fp32 (the capacity gate) from step 10: each element clipped to 3 x its "
        "parameter's mean |update|, doubling every 4 steps; update norm 10 held to 2 (2 x median")
    back = _gate_step(c, True, 1.0)  # sign again: fits, its ramp (no clip) closes at once
    assert back.scales == {} and back.clips == {}
    assert not c.guarding and [(e["step"], e["from"], e["to"]) for e in log[1:]] == [
        (14, "ramped", "update")]
    assert "the route changes again (fp32 -> low-bit" in log[1]["reason"]
    resumed, resumed_log = controller(update_cap=2.0)
    resumed.load_state_dict(saved)
    assert _gate_step(resumed, False, 10.0).scales["*"] == pytest.approx(0.2)
    assert resumed_log[0]["step"] == 10 and resumed_log[0]["to"] == "ramped"
    # a run that goes on as plain DDP's: once the ramp closes no norms are asked for
    steady, _ = controller(update_cap=2.0, window=4)
    for _ in range(10):
        _gate_step(steady, True, 1.0)
    for _ in range(3):
        _gate_step(steady, False, 1.5)  # fits, but a ramp to fp32 clips for a window (4)
    assert steady.guarding
    _gate_step(steady, False, 1.5)
    assert not steady.guarding
    off, off_log = controller(update_cap=2.0)
    off.monitor_enabled = False
    for lowbit in [True] * 10 + [False] * 3:
        assert _gate_step(off, lowbit, 10.0 if not lowbit else 1.0).scales == {}
    assert off_log == [] and not off.guarding


def test_ramp_clip_is_validated_and_zero_or_the_guard_off_clips_nothing():
    """`ramp_clip` 0 (or `update_cap` 0, the guard off) keeps the norm ramp and clips nothing;
    a value between 0 and 1 fails in one line. A checkpoint saved before clips (ramps of four
    fields) resumes with a ramp that does not clip."""
    with pytest.raises(InputError, match="ramp_clip must be 0 \\(off\\) or >= 1, got 0.5"):
        HealthThresholds(ramp_clip=0.5)
    for health in ({"ramp_clip": 0.0}, {"update_cap": 0.0}):
        c, _ = controller(**health)
        for _ in range(10):
            _gate_step(c, True, 1.0)
        d = _gate_step(c, False, 10.0)
        assert d.clips == {} and (d.scales != {}) == (health.get("update_cap") != 0.0)
    c, _ = controller(update_cap=2.0)
    for _ in range(10):
        _gate_step(c, True, 1.0)
    saved = json.loads(json.dumps(c.state_dict()))
    saved["ramps"] = {"*": [10, "low-bit -> fp32 (the capacity gate)", 1, 0]}  # before clips
    old, _ = controller(update_cap=2.0)
    old.load_state_dict(saved)
    assert old._ramps["*"][4:] == [False, True]  # no clip; its cap logged already
    d = old.direct(10, True, {n: 5.0 for n in old.bindings.params})
    assert d.clips == {} and d.scales["*"] == pytest.approx(0.2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_clip_bounds_each_element_by_k_times_the_mean_absolute_update(dtype: torch.dtype):
    # past one chunk, so the CPU path sums through its small buffer
    g = torch.Generator().manual_seed(0)
    update = (torch.randn(ABS_CHUNK * 3 + 17, generator=g) ** 3).to(dtype)
    for x in (update, update[:5], update[: 2 * ABS_CHUNK], update[::3]):  # odd, whole, strided
        assert mean_abs(x).dtype == torch.float32
        assert math.isclose(float(mean_abs(x)), float(x.double().abs().mean()), rel_tol=1e-6)
    assert float(mean_abs(torch.empty(0, dtype=dtype))) == 0.0
    bound = float(mean_abs(update)) * 3
    reference = update.clone().clamp_(-bound, bound)
    clipped, kept = update.clone(), update.clone()
    d = StepDecision(False, {"body": 0.5}, {"body": 3.0})
    assert d.apply_("body", clipped, True) and d.apply_("body", kept, False)
    assert clipped.dtype == dtype
    assert torch.equal(clipped, (reference * 0.5).to(dtype))  # clipped, then scaled
    assert torch.equal(kept, update * 0.5)  # sent low-bit: scaled, not clipped
    assert (update.abs() > bound).sum() > 100  # there was something to clip
    assert not StepDecision(False).apply_("body", update.clone(), True)
