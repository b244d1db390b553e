"""Regression (issue 15): on vision, a gradient spike under the committed all-sign profile.

The seed-0 vision run tripped the monitor mid-training and ended 19 points below the same
routes without it: the fp32 fallback fed the raw spike to SGD with momentum. Shortened here to
a deterministic spike (rank 1's gradients x1e3 at step 30 of 60, W = 4) in the simulator, which
`tests/calibration/test_simulate.py` holds bit-identical to DDP with the hook, guard included.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nfabric_cli.binding import compile_profile, on_route
from nfabric_cli.calibration.simulate import SimResult, simulate_run
from nfabric_cli.profile.operating import OperatingProfile
from nfabric_cli.profile.store import read_profile
from nfabric_cli.runtime.inject import Injection
from nfabric_cli.workloads.registry import get_workload

PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "vision" / "vision.v2.parquet"
STEPS, WORLD, SEED = 60, 4, 0
SPIKE = (Injection("spike", 30, 1),)


@pytest.fixture(scope="module")
def metrics() -> dict[str, float]:
    wl = get_workload("vision")
    profile = read_profile(PROFILE)
    model = wl.build_model(SEED)
    routed = compile_profile(profile, model, world_size=WORLD, total_steps=STEPS)
    reference = compile_profile(on_route(profile), model, world_size=WORLD, total_steps=STEPS)

    def run(bindings, monitor: bool = True, injections=SPIKE, **health) -> float:
        bindings.meta["health"] = {**(profile.meta.get("health") or {}), **health}
        return simulate_run(wl, bindings, WORLD, STEPS, SEED, checkpoints=(STEPS,),
                            monitor=monitor, injections=injections).metric

    return {"fp32": run(reference, injections=()), "static": run(routed, monitor=False),
            "profile": run(routed), "no_guard": run(routed, update_cap=0)}


def test_the_monitor_rescues_a_spike_that_collapses_static(metrics):
    tolerance = 0.05
    assert metrics["static"] < metrics["fp32"] - 0.3  # the spike wrecks the run without it
    assert metrics["profile"] >= metrics["static"]  # never worse than no monitor
    assert metrics["profile"] >= metrics["fp32"] - tolerance


def test_it_is_the_update_guard_that_rescues(metrics):
    # The same trip without the guard: the spike step's update goes through as reduced.
    assert metrics["no_guard"] < metrics["fp32"] - 0.3
    assert metrics["profile"] > metrics["no_guard"] + 0.3


V12 = PROFILE.parent / "vision.v12.parquet"
V12_SEED, V12_STEPS, V12_WORLD = 5, 300, 2  # a proven cell at the tolerance's edge


@pytest.fixture(scope="module")
def held_at() -> tuple[OperatingProfile, dict[float, SimResult]]:
    """vision.v12 and its cell (seed 5, 300 steps, two ranks), rank 1's gradients x1e3 at 40 %
    of the run, with a blow-up's own step held at 2x (`blowup_cap` 0: the profile's own rule,
    `update_cap`) and at 1x the healthy median (`blowup_cap` 1); under None, the cell without
    the spike."""
    wl = get_workload("vision")
    profile = read_profile(V12)
    model = wl.build_model(V12_SEED)
    out = {}
    for cap in (0.0, 1.0, None):
        bindings = compile_profile(profile, model, world_size=V12_WORLD, total_steps=V12_STEPS)
        if cap is not None:
            bindings.meta["health"] = {**profile.meta["health"], "blowup_cap": cap}
        spike = () if cap is None else (Injection("spike", 2 * V12_STEPS // 5, 1),)
        out[cap] = simulate_run(wl, bindings, V12_WORLD, V12_STEPS, V12_SEED,
                                checkpoints=(V12_STEPS,), injections=spike)
    return profile, out


def test_a_blowups_own_step_held_to_one_healthy_update_keeps_the_run_in_tolerance(held_at):
    """Held at 2x, the spike's step moved the run 3.1 points under fp32 (tolerance 2) on the
    AVX2 machine it was measured on: the one fault `bench.robustness` found not rescued on
    vision. On an AVX-512 one (torch's kernels round differently, so the trajectory is
    another) the same cell ends where its clean run does at 2x and at 1x alike: which cells
    the 2x hold loses is the trajectory's (there a loss spike of its own, at step 112, trips
    the monitor first, and the injected one arrives while it holds). What holds on both: held
    to 1x the run ends no more than one test image under the same cell without the spike,
    within the profile's tolerance, and never under the 2x hold; the spike's step is held."""
    profile, runs = held_at
    (cell,) = [c for c in profile.meta["proven"]["cells"]
               if (c["seed"], c["steps"], c["world_size"]) == (V12_SEED, V12_STEPS, V12_WORLD)]
    tolerance = profile.meta["target"]["tolerance"]
    one_image = 1 / 360  # the digits test split
    assert runs[1.0].metric >= runs[None].metric - one_image
    assert runs[1.0].metric >= cell["reference"] - tolerance
    assert runs[1.0].metric >= runs[0.0].metric
    update_cap = profile.meta["health"]["update_cap"]  # 2
    spike = 2 * V12_STEPS // 5
    for cap, run in ((c, r) for c, r in runs.items() if c is not None):
        own = [e for e in run.events if e["to"] == "held" and e["step"] == spike]
        if own:  # detected on its own step: held by the blow-up's rule
            assert all(f"({cap or update_cap:g} x median" in e["reason"] for e in own), own
        else:  # arrived while an earlier trip held the scope: every held step is capped
            assert _in_a_hold(run.events, spike), run.events


def _in_a_hold(events: list[dict], step: int) -> bool:
    """Whether `step` falls between a fallback of the whole model and its re-admission."""
    since = None
    for e in events:
        if e["scope"] == "all" and e["step"] <= step:
            since = e["step"] if e["to"] == "fp32" else None
    return since is not None and any(e["scope"] == "all" and e["from"] == "fp32"
                                     and e["step"] > step for e in events)
