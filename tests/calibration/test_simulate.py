"""The simulated workers equal real DDP with the fabric hook, and mirror its health logic."""

from __future__ import annotations

import math
import os
import signal

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from nfabric_cli.binding import compile_profile, on_route, static_profile
from nfabric_cli.calibration.cpus import one_thread
from nfabric_cli.calibration.reduces import ddp_layouts
from nfabric_cli.calibration.simulate import SimulatedDDP, simulate_run
from nfabric_cli.calibration.space import Config, config_profile
from nfabric_cli.calibration.traffic import step_bytes
from nfabric_cli.ranks.loop import train_workload
from nfabric_cli.routes import FP32, make_route
from nfabric_cli.runtime.attach import attach_with
from nfabric_cli.runtime.inject import Injection
from nfabric_cli.workloads.registry import get_workload
from tests.calibration.helpers import TINY, tiny_spec
from tests.calibration.tiny import TinyBNWorkload, TinyQuirksWorkload
from tests.distutil import agreed, run_ranks

STEPS, SEED = 4, 3


def _bindings(model, world: int, health: dict | None = None, norms: str = "type:GroupNorm",
              fp32: bool = False, substrate: dict | None = None, ramp: bool | str = False):
    """warmup (first step): int8+EF head, fp32 rest; then head int8+EF, norms ternary+EF, rest
    sign+EF; int8 with stochastic rounding (the hook and the simulator draw the same noise).
    `fp32`: the same profile with every route fp32 (plain DDP's path in the hook). `ramp`:
    every route sign for two steps, then fp32 (a plain phase, entered with a ramp open);
    "gate": then int8, which `SIGN_ONLY` refuses (sent as plain DDP's, ramped)."""
    spec = tiny_spec(world_size=world, steps=STEPS, eval_every=2, health=health or {},
                     regions=[
                         {"name": "head", "selector": "head.*", "routes": ["fp32", "int8"]},
                         {"name": "norms", "selector": norms,
                          "routes": ["fp32", "ternary"]},
                         {"name": "rest", "selector": "*", "routes": ["fp32", "sign"]},
                     ])
    config = Config((("int8", "fp32", "fp32"), ("int8", "ternary", "sign")), (0.25,), 0.4, True,
                    rounding="stochastic")
    if ramp:
        then = "int8" if ramp == "gate" else "fp32"
        config = Config((("sign",) * 3, (then,) * 3), (0.5,), 0.4, False)
    profile = config_profile(spec, config, {"world_size": world, "health": spec.health})
    if fp32:
        profile = on_route(profile, "fp32")
    return compile_profile(profile, model, world_size=world, bucket_cap_mb=None, total_steps=STEPS,
                           substrate=substrate)


#: A gradient blow-up on rank 1 at step 2 (after two healthy steps): the update guard scales the
#: step down on every rank, in the hook as in the simulator; by default the route stays, with
#: `grad_blowup_trips` the scope also falls back to fp32.
GUARDED = {"window": 4, "min_history": 2}
SPIKE = (Injection("spike", 2, 1),)
#: the ramp tests' health: a short window, and updates held to their median (so they cap)
RAMPED = {"window": 4, "min_history": 2, "update_cap": 1.0}
NAN = (Injection("nan", 2, 1),)


def _real_worker(rank: int, world: int, health: dict | None = None,
                 injections: tuple = (), fp32: bool = False, direct: bool = True,
                 substrate: dict | None = None, ramp: bool | str = False) -> dict:
    wl = get_workload("vision")
    model = wl.build_model(SEED)
    ddp = DDP(model)
    bindings = _bindings(model, world, health, fp32=fp32, substrate=substrate, ramp=ramp)
    state = attach_with(ddp, bindings, total_steps=STEPS,
                        seed=SEED, injections=injections, direct_fp32=direct)
    opt, sched = wl.make_optimizer(ddp.parameters(), STEPS)
    train_workload(ddp, state, wl, opt, sched, STEPS, rank, world, SEED)
    state.close()
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "fraction": state.meter.fraction(include_control=False),
        "events": agreed(state.events),
        "metric": wl.evaluate(model),
        "held": state.controller.held,
    }


@pytest.mark.parametrize("guarded", [None, 0, 1, "nan", "fp32", "fp32-nan", "fp32-worker",
                                     "fp32-nan-worker", "ramp"],
                         ids=["healthy", "spike-held", "spike-tripped", "nan-skipped",
                              "all-fp32-spike", "all-fp32-nan", "all-fp32-spike-worker",
                              "all-fp32-nan-worker", "sign-then-fp32-ramped"])
def test_simulated_workers_equal_real_ddp_with_the_hook(guarded: int | str | None) -> None:
    # "-worker": the all-fp32 steps on the hook's worker path, as a recorded trace sends
    # them; they must train as the direct path does (plain DDP: nothing held, NaN summed).
    # "ramp": the plain phase after sign is judged while its ramp is open, in both
    world = 2
    health, injections, fp32 = (None, (), str(guarded).startswith("fp32"))
    direct = not str(guarded).endswith("worker")
    ramp = guarded == "ramp"
    if ramp:
        health = RAMPED
    elif str(guarded).startswith("fp32-nan"):  # plain DDP sums the NaN into every update: so must we
        injections = NAN
    elif guarded == "nan":  # skipped on every rank, error feedback forgotten, in both
        injections = NAN
    elif guarded is not None:
        health, injections = {**GUARDED, "grad_blowup_trips": int(fp32 or guarded)}, SPIKE
    real = run_ranks(_real_worker, world, health, injections, fp32, direct, None, ramp)
    wl = get_workload("vision")
    model = wl.build_model(SEED)
    bindings = _bindings(model, world, health, fp32=fp32, ramp=ramp)
    sim = simulate_run(wl, bindings, world, STEPS, SEED, checkpoints=(STEPS,),
                       injections=injections)
    if ramp:  # the fp32 phase's first step capped (and so judged, not plain DDP's)
        assert [(e["step"], e["to"]) for e in sim.events][:1] == [(2, "ramped")]
    elif fp32:  # every route fp32: plain DDP's step in the hook, so nothing is held in either
        assert sim.events == [] and sim.detections == []
    elif guarded == "nan":
        assert sim.skipped_steps == [2]
    elif guarded is not None:  # the same scale-down (and trip), on both sides
        held = [e for e in sim.events if e["to"] == "held"]
        assert held and {e["step"] for e in held} == {2}
        assert bool([e for e in sim.events if e["to"] == "fp32"]) == bool(guarded)
    if injections == NAN and fp32:
        assert all(bool(p.isnan().any()) for p in sim.model.parameters())  # not neutralised
    for rank in range(world):
        for name, p in sim.model.named_parameters():
            diff = float((p.detach() - real[rank]["params"][name]).abs().nan_to_num().max())
            assert diff <= 1e-6, (rank, name, diff)
    for n, p in sim.model.named_parameters():  # same batches, codecs, optimizer: bit for bit
        torch.testing.assert_close(p.detach(), real[0]["params"][n], rtol=0, atol=0,
                                   equal_nan=True)
    assert sim.metric == real[0]["metric"]
    assert sim.traffic_fraction == real[0]["fraction"]  # same buckets, same groups, same bytes
    assert sim.events == real[0]["events"]
    assert sim.steps_run == STEPS and sim.curve == [(STEPS, real[0]["metric"])]


#: A slow link where the model gate admits `sign` and refuses `int8` (its codec calls: 1 s).
SIGN_ONLY = {"link_gbps": 0.1, "latency_us": 10.0, "codec_call_us": {"int8": 1e6}}
#: A link so fast, and codec calls so slow, that the model gate refuses every low-bit bucket.
LOWBIT_LOSES = {"link_gbps": 100.0, "latency_us": 1.0,
                "codec_call_us": {"sign": 6000.0, "int8": 6000.0, "ternary": 6000.0}}


@pytest.mark.parametrize("fault", ["spike", "nan"])
def test_steps_the_model_gate_sends_as_plain_ddp_train_alike(fault: str) -> None:
    """Every low-bit bucket refused by the substrate: after the step that priced them the
    hook sends each step as plain DDP (`_gated_off`), and so must the simulator: a blow-up
    there passes unheld, a non-finite step is zeroed, the monitor sees none of them."""
    world, injections = 2, SPIKE if fault == "spike" else NAN
    real = run_ranks(_real_worker, world, GUARDED, injections, False, True, LOWBIT_LOSES)
    wl = get_workload("vision")
    model = wl.build_model(SEED)
    bindings = _bindings(model, world, GUARDED, substrate=LOWBIT_LOSES)
    sim = simulate_run(wl, bindings, world, STEPS, SEED, checkpoints=(STEPS,),
                       injections=injections)
    for n, p in sim.model.named_parameters():
        torch.testing.assert_close(p.detach(), real[0]["params"][n], rtol=0, atol=0)
    assert sim.events == real[0]["events"]
    assert sim.metric == real[0]["metric"]
    assert sim.traffic_fraction == real[0]["fraction"] == 1.0  # every bucket refused
    # what both do: nothing judged after the step that priced the buckets (no detection,
    # no hold of the spike), the NaN step zeroed
    assert sim.detections == []
    assert sim.skipped_steps == ([2] if fault == "nan" else [])
    assert [e["to"] for e in sim.events] == (["skipped"] if fault == "nan" else [])


def test_a_guarded_step_takes_its_error_feedback_residual_with_it() -> None:
    """Every route here keeps error feedback. The spiked rank's residual after the held step
    holds ~1000x its gradient; nothing detects it (norms are taken before compensation), so
    kept, it would leak into the next steps' updates. The guard clears the residuals of what
    it scales, in the hook (the bit-identity test above) and here: the steps after the hold
    stay at the healthy scale."""
    wl = get_workload("vision")
    bindings = _bindings(wl.build_model(SEED), 2, GUARDED)
    torch.manual_seed(SEED)
    sim = SimulatedDDP(wl, bindings, 2, 5, SEED, processes=1, injections=SPIKE)
    try:
        for _ in range(5):
            sim.train_step()
    finally:
        sim.close()
    assert {(e["step"], e["to"]) for e in sim.events} == {(2, "held")}
    for scope, norms in sim.controller.guard.state_dict()["windows"].items():
        before, after = norms[:2], norms[2:]  # steps 0, 1 | 3, 4 (2 was held)
        assert len(after) == 2 and max(after) < 3 * max(before), (scope, norms)


def test_health_fallback_counts_in_measured_traffic() -> None:
    # sign_agreement_min = 1 trips the sign region at the first step that is not unanimous;
    # it then stays on fp32 through the cooldown: the measured traffic must say so.
    wl = get_workload(TINY)
    model = wl.build_model(SEED)
    world = 2
    health = {"sign_agreement_min": 1.0, "cooldown": 10}
    bindings = _bindings(model, world, health, "type:LayerNorm")
    sim = simulate_run(wl, bindings, world, STEPS, SEED)
    trips = [e for e in sim.events if e["to"] == "fp32"]
    assert [(e["step"], e["scope"]) for e in trips] == [(1, "*")]
    assert trips[0]["reason"].startswith("sign agreement")

    def eff(step: int, forced: bool):
        phase = bindings.phase_at(step, STEPS).name
        def f(n: str):
            spec = bindings.params[n].routes[phase]
            return FP32 if forced and bindings.params[n].regions[phase] == "*" else spec
        return step_bytes(bindings, world, phase, f)

    parts = [eff(0, False), eff(1, False), eff(2, True), eff(3, True)]
    expected = sum(p.sent for p in parts) / sum(p.fp32 for p in parts)
    assert math.isclose(sim.traffic_fraction, expected, rel_tol=0, abs_tol=0)
    assert sim.row_traffic[("*", "main")] > 0.5  # mostly fp32 after the trip


def test_step_bytes_match_route_wire_bytes() -> None:
    wl = get_workload(TINY)
    model = wl.build_model(0)
    bindings = _bindings(model, 4, norms="type:LayerNorm")
    total = sum(b.numel for b in bindings.params.values())
    sb = step_bytes(bindings, 4, "warmup", lambda n: FP32)
    assert sb.sent == sb.fp32 == make_route(FP32).wire_bytes(total, 4).total
    assert all(math.isclose(b, ref) for b, ref in sb.rows.values())


def test_checkpoint_callback_stops_a_run_early() -> None:
    wl = get_workload(TINY)
    model = wl.build_model(0)
    bindings = _bindings(model, 2, norms="type:LayerNorm")
    seen = []

    def stop(step: int, metric: float, traffic: float, loss: float) -> bool:
        seen.append((step, traffic))
        return False

    res = simulate_run(wl, bindings, 2, STEPS, 0, checkpoints=(2, STEPS), on_checkpoint=stop)
    assert res.stopped and res.steps_run == 2 and [s for s, _ in seen] == [2]
    assert 0 < seen[0][1] < 1


def test_ctrl_c_stops_a_run_between_steps() -> None:
    """SIGINT during a step is raised before the next one (not inside whatever Python was
    running, where a finaliser could swallow it), and the handler is restored."""
    wl = get_workload(TINY)
    bindings = _bindings(wl.build_model(0), 2, norms="type:LayerNorm")
    seen = []

    def on_step(step: int) -> None:
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)
        seen.append(step)  # the default handler would raise before this

    # Python's default handling, as under a terminal (a runner started with `&` or nohup
    # passes SIGINT on ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            simulate_run(wl, bindings, 2, STEPS, 0, on_step=on_step, processes=1)
        assert seen == [1, 2]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_loss_curve_is_the_mean_training_loss_since_the_last_checkpoint() -> None:
    """Each checkpoint's loss is the ranks' mean loss averaged over the steps since the one
    before: a run evaluated every step gives the per-step losses, and evaluating does not
    change training, so the windows of a run evaluated every other step are their means."""
    wl = get_workload(TINY)
    bindings = _bindings(wl.build_model(0), 2, norms="type:LayerNorm")
    every = simulate_run(wl, bindings, 2, STEPS, 0, checkpoints=(1, 2, 3, 4)).loss_curve
    pairs = simulate_run(wl, bindings, 2, STEPS, 0, checkpoints=(2, 4)).loss_curve
    per_step = [loss for _, loss in every]
    assert [s for s, _ in every] == [1, 2, 3, 4] and all(math.isfinite(v) for v in per_step)
    assert len(set(per_step)) > 1
    assert pairs == [(2, (per_step[0] + per_step[1]) / 2), (4, (per_step[2] + per_step[3]) / 2)]


def test_traffic_lower_bound_is_the_cheapest_fallback_mix() -> None:
    from nfabric_cli.calibration.traffic import held_on_fp32, traffic_lower_bound

    wl = get_workload(TINY)
    bindings = _bindings(wl.build_model(0), 2, norms="type:LayerNorm")
    # warmup = step 0 (int8 head, rest fp32), main = steps 1..3 (ternary norms, sign rest)
    warm = [step_bytes(bindings, 2, "warmup", held_on_fp32(bindings, "warmup", h))
            for h in ((), ("head.*",))]
    main = [step_bytes(bindings, 2, "main", held_on_fp32(bindings, "main", h))
            for h in ((), ("type:LayerNorm",), ("*",), ("type:LayerNorm", "*"))]
    expected = (min(w.sent for w in warm) + 3 * min(m.sent for m in main)) / (
        warm[0].fp32 + 3 * main[0].fp32)
    assert traffic_lower_bound(bindings, 2, STEPS) == expected
    # on the buckets the simulator counts (DDP's first and rebuilt ones), as the study prices it
    model = wl.build_model(0)
    names = [n for n, _ in model.named_parameters()]
    layouts = ddp_layouts(wl, model, names, 2, 0, None).named(names)
    bound = traffic_lower_bound(bindings, 2, STEPS, layouts=layouts)
    assert bound == expected  # one bucket here: the plan's bytes
    sim = simulate_run(wl, bindings, 2, STEPS, 0)
    assert sim.traffic_fraction >= bound


#: A 3 Gbit/s link: the model gate admits `sign` for glyphs' one first-step bucket (all 1.03M
#: parameters: DDP reduces its first step in one bucket per dtype) and refuses both buckets
#: DDP rebuilds after it (0.65M and 0.38M parameters), whose fixed costs weigh more.
SPLIT_BY_SIZE = {"link_gbps": 3.0, "latency_us": 10.0}
#: 2 Gbit/s with the norms on fp32: the gate refuses the first-step bucket (its fp32 groups
#: cost more than they save) and would admit the first rebuilt one; the hook never asks, since
#: a refused phase goes out as plain DDP's from then on (`gated_off`).
REFUSED_FIRST = {"link_gbps": 2.0, "latency_us": 10.0}
GATE_CASES = {"split": (SPLIT_BY_SIZE, []), "refused-first": (REFUSED_FIRST, [("*norm*", "fp32")])}


def _glyphs_bindings(model, world: int, steps: int, case: str):  # noqa: ANN001, ANN202
    substrate, rules = GATE_CASES[case]
    return compile_profile(static_profile(model, "sign", rules), model, world_size=world,
                           total_steps=steps, substrate=substrate)


def _glyphs_worker(rank: int, world: int, steps: int, case: str) -> dict:
    wl = get_workload("glyphs")
    model = wl.build_model(SEED)
    ddp = DDP(model)
    state = attach_with(ddp, _glyphs_bindings(model, world, steps, case), total_steps=steps,
                        seed=SEED)
    opt, sched = wl.make_optimizer(ddp.parameters(), steps)
    train_workload(ddp, state, wl, opt, sched, steps, rank, world, SEED)
    state.close()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "fraction": state.meter.fraction(include_control=False),
            "verdicts": {len(names): v.admit for (names, _), v in state.gate.decided().items()},
            "events": agreed(state.events)}


def _gate_ramp_worker(rank: int, world: int) -> dict:
    return _real_worker(rank, world, RAMPED, (), False, True, SIGN_ONLY, "gate")


def test_a_route_the_gate_sends_on_fp32_ramps_on_plain_ddps_path_too() -> None:
    """sign for two steps, then int8, which the model gate refuses: the boundary step goes
    out on fp32 from the worker (its ramp opened by the phase change, capped and clipped),
    and the step after it as plain DDP's (`_fp32_direct`, gated off): still ramped there, its
    update norms measured, held and clipped on every rank (`StepController.direct`), as the
    simulator does."""
    world = 2
    real = run_ranks(_gate_ramp_worker, world)
    wl = get_workload("vision")
    model = wl.build_model(SEED)
    bindings = _bindings(model, world, RAMPED, substrate=SIGN_ONLY, ramp="gate")
    sim = SimulatedDDP(wl, bindings, world, STEPS, SEED)
    gated_off = []
    with torch.random.fork_rng(devices=[]), one_thread():  # as simulate_run trains
        torch.manual_seed(SEED)
        for _ in range(STEPS):
            gated_off.append(sim.controller.gated_off())
            sim.train_step()
    sim.close()
    assert gated_off == [False, False, False, True]  # step 3 goes out as plain DDP's
    held = {(step, scope) for step, scope, _ in sim.controller.held}
    assert {s for s, _ in held} == {2, 3} and (3, "*") in held  # the direct step held too
    assert [(e["step"], e["to"]) for e in sim.events] == [(2, "ramped")] * 3
    # int8 is low-bit, but the gate sends it on fp32: a full-precision wire, so it clips too
    assert "sent on fp32 by the capacity gate from step 2: each element clipped to 3 x" in (
        sim.events[0]["reason"])
    assert sim.controller.held == real[0]["held"]
    for n, p in sim.model.named_parameters():
        torch.testing.assert_close(p.detach(), real[0]["params"][n], rtol=0, atol=0)
    assert sim.events == real[0]["events"]


@pytest.mark.parametrize("case", list(GATE_CASES))
def test_the_gate_prices_the_buckets_ddp_reduces_at_each_step_in_both(case: str) -> None:
    """DDP's first step reduces one bucket, the later ones the buckets it rebuilt: the hook's
    gate prices whichever it is handed, so the simulator must price the same. "split": it
    priced the bindings' plan at every step (here `sign` at step 0 in the run, fp32 in the
    simulation). "refused-first": a phase refused at step 0 goes out as plain DDP's after it,
    which the simulator must not re-price on the rebuilt buckets."""
    world, steps = 2, 3
    real = run_ranks(_glyphs_worker, world, steps, case)
    wl = get_workload("glyphs")
    model = wl.build_model(SEED)
    bindings = _glyphs_bindings(model, world, steps, case)
    premise = {"split": {38: True, 8: False, 30: False}, "refused-first": {38: False}}[case]
    assert real[0]["verdicts"] == premise
    sim = simulate_run(wl, bindings, world, steps, SEED, checkpoints=(steps,))
    for n, p in sim.model.named_parameters():
        torch.testing.assert_close(p.detach(), real[0]["params"][n], rtol=0, atol=0)
    assert sim.events == real[0]["events"]
    assert sim.traffic_fraction == real[0]["fraction"]
    assert sim.traffic_fraction < 0.7 if case == "split" else sim.traffic_fraction == 1.0


def _tiny(kind: str):  # noqa: ANN202 - a tiny workload
    return TinyBNWorkload() if kind == "batchnorm" else TinyQuirksWorkload(kind)


def _sign_bindings(model, world: int, steps: int):  # noqa: ANN001, ANN202
    return compile_profile(static_profile(model, "sign"), model, world_size=world,
                           total_steps=steps)


def _tiny_worker(rank: int, world: int, kind: str, steps: int) -> dict:
    wl = _tiny(kind)
    model = wl.build_model(SEED)
    torch.manual_seed(1000 + rank)  # whatever the process drew before: training must not care
    ddp = DDP(model)  # broadcast_buffers: rank 0's statistics before every forward
    state = attach_with(ddp, _sign_bindings(model, world, steps), total_steps=steps, seed=SEED)
    opt, sched = wl.make_optimizer(ddp.parameters(), steps)
    train_workload(ddp, state, wl, opt, sched, steps, rank, world, SEED)
    state.close()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "buffers": {n: b.clone() for n, b in model.named_buffers()},
            "metric": wl.evaluate(model)}


def test_batchnorm_statistics_are_rank_zeros_as_ddp_broadcasts_them() -> None:
    """Every rank's forward starts from rank 0's running statistics and only rank 0's own
    forward carries on: the simulator ran its ranks in turn on one model, so each rank's batch
    moved the statistics (and counted W batches a step), and a BatchNorm model evaluated to
    another metric than the run it simulated."""
    world, steps = 3, 6
    real = run_ranks(_tiny_worker, world, "batchnorm", steps)
    wl = _tiny("batchnorm")
    model = wl.build_model(SEED)
    sim = simulate_run(wl, _sign_bindings(model, world, steps), world, steps, SEED,
                       checkpoints=(steps,))
    buffers = dict(sim.model.named_buffers())
    assert int(buffers["norm.num_batches_tracked"]) == steps
    for n, b in buffers.items():
        assert torch.equal(b, real[0]["buffers"][n]), n
    for n, p in sim.model.named_parameters():
        torch.testing.assert_close(p.detach(), real[0]["params"][n], rtol=0, atol=0)
    assert sim.metric == real[0]["metric"]


@pytest.mark.parametrize("quirk", ["dropout", "channels_last"])
def test_models_as_users_have_them_train_alike(quirk: str) -> None:
    """dropout: every rank draws its masks from its own stream, from `manual_seed(seed)`, in
    the run as in the simulator (the run drew from whatever its process had drawn before).
    channels_last: DDP's bucket holds a dense parameter's gradient in that parameter's memory
    layout, so the hook's per-chunk scales see its elements in that order; so must the
    simulator's (it flattened them in logical order)."""
    world, steps = 2, 6
    real = run_ranks(_tiny_worker, world, quirk, steps)
    wl = _tiny(quirk)
    model = wl.build_model(SEED)
    if quirk == "channels_last":  # the premise: another order than the logical one
        assert not model.conv2.weight.is_contiguous()
    sim = simulate_run(wl, _sign_bindings(model, world, steps), world, steps, SEED,
                       checkpoints=(steps,))
    for n, p in sim.model.named_parameters():
        torch.testing.assert_close(p.detach(), real[0]["params"][n], rtol=0, atol=0)
