"""Models as plugins write them, as `validate` runs them on real ranks and as the calibration
simulator replays them: one that leaves parameters out of some steps' graphs
(`find_unused_parameters`), one whose `evaluate` sets no mode."""

from __future__ import annotations

import time

import pandas as pd
import pytest

from nfabric_cli.binding import compile_profile, on_route, static_profile
from nfabric_cli.calibration.simulate import SimulatedDDP, simulate_run
from nfabric_cli.errors import InputError
from nfabric_cli.profile import write_profile
from tests.validation.common import nfabric, summary
from tests.validation.tiny import BareEvalWorkload, BranchWorkload, through_a

pytestmark = pytest.mark.slow  # real multi-process runs
BRANCH = "tests.validation.tiny:build_branch"
STEPS, SEED = 12, 0


def test_validate_trains_a_branching_model_as_the_simulator_replays_it(tmp_path) -> None:
    """`validate` builds DDP with the workload's find_unused_parameters (without it DDP
    refused the second step), and the simulator leaves a parameter that no rank used without
    a gradient, as DDP does, so the optimizer skips it (it stepped it from zeros: momentum
    moved it). Every step's mean loss and the final metric agree exactly. Each expert is a
    region of its own: a step no rank routes through it is no gradient-norm collapse (the
    monitor tripped each to fp32, then pinned one)."""
    wl = BranchWorkload()
    model = wl.build_model(SEED)
    experts = [through_a(wl.train_batch(s, r, 2, SEED)[0]) for s in range(STEPS) for r in range(2)]
    pairs = list(zip(experts[::2], experts[1::2], strict=True))
    assert (True, True) in pairs and (False, False) in pairs  # each expert unused by both
    assert (True, False) in pairs or (False, True) in pairs  # and by one rank only
    profile = static_profile(model, "sign", [("a.*", "sign"), ("b.*", "sign"), ("head.*", "fp32")],
                             workload=wl.name)
    path = write_profile(profile, tmp_path / "branch.v1.parquet")
    report = tmp_path / "report"
    r = nfabric("validate", path, "--workload", BRANCH, "--steps", STEPS, "--arms",
                "fp32,profile", "--seed", SEED, "--tolerance", 1, "--report", report)
    assert r.returncode == 0, r.stderr
    frame = pd.read_parquet(report / "steps.parquet")
    real = frame[frame.arm == "profile"].sort_values(["step", "rank"])
    real_losses = [sum(real[real.step == s]["loss"].tolist()) / 2 for s in range(STEPS)]
    bindings = compile_profile(profile, model, world_size=2, total_steps=STEPS,
                               find_unused_parameters=True)
    sim = simulate_run(wl, bindings, 2, STEPS, SEED, checkpoints=tuple(range(1, STEPS + 1)))
    assert [loss for _, loss in sim.loss_curve] == real_losses
    assert sim.metric == summary(report)["arms"]["profile"]["metric"]
    assert summary(report)["arms"]["profile"]["fallbacks"] == 0
    assert sim.events == [] and sim.detections == []


def test_a_branching_model_that_does_not_say_so_is_refused_by_the_simulator() -> None:
    """Real DDP fails at the next step when a rank's graph leaves a parameter out and DDP
    does not look for unused ones: the simulator says so in one line, naming the parameter."""
    wl = BranchWorkload()
    wl.find_unused_parameters = False
    model = wl.build_model(SEED)
    bindings = compile_profile(static_profile(model, "sign"), model, world_size=2, total_steps=4)
    with pytest.raises(InputError, match=r"^parameter b\.weight got no gradient on rank 0 at "
                                         r"step 0: DDP refuses that unless"):
        simulate_run(wl, bindings, 2, 4, SEED)


def test_the_check_reads_its_own_steps_graph_while_children_compute_the_next(monkeypatch) -> None:
    """With a process per rank, each child computes the next step's gradients as soon as a
    step is done, and marks which parameters that step's graph used: the check must read the
    step's own marks. Step 0 runs both ranks through expert `a`, step 1 rank 0 through `b`; the
    check is slowed down here so the children are surely into step 1 by then (reading the
    shared marks, it named `a.weight`; under pytest-xdist it sometimes did unslowed)."""
    wl = BranchWorkload()
    wl.find_unused_parameters = False
    experts = [through_a(wl.train_batch(s, r, 2, SEED)[0]) for s in (0, 1) for r in (0, 1)]
    assert experts == [True, True, False, True]  # expert a, a; then b on rank 0
    model = wl.build_model(SEED)
    bindings = compile_profile(static_profile(model, "sign"), model, world_size=2, total_steps=4)
    check = SimulatedDDP._check_used

    def slow(self, step, used):  # noqa: ANN001, ANN202
        time.sleep(1.0)
        return check(self, step, used)

    monkeypatch.setattr(SimulatedDDP, "_check_used", slow)
    with pytest.raises(InputError, match=r"^parameter b\.weight got no gradient on rank 0 at "
                                         r"step 0: "):
        simulate_run(wl, bindings, 2, 4, SEED, processes=2)


def test_an_evaluate_that_sets_no_mode_is_called_in_eval_mode_by_validate_and_the_simulator(
        tmp_path) -> None:
    """Dropout left on in `evaluate` measured random masks, drawn differently by the real run
    and the simulator (an MLP on digits: 0.9723 against 0.9597); both take the metric in eval
    mode now, and agree."""
    wl = BareEvalWorkload()
    model = wl.build_model(SEED)
    steps = 6
    profile = static_profile(model, "sign", [("head.*", "fp32")], workload=wl.name)
    path = write_profile(profile, tmp_path / "bare.v1.parquet")
    r = nfabric("validate", path, "--workload", "tests.validation.tiny:build_bare_eval", "--steps",
                steps, "--arms", "fp32,profile", "--seed", SEED, "--tolerance", 1, "--report",
                tmp_path / "report")
    assert r.returncode == 0, r.stderr
    arms = summary(tmp_path / "report")["arms"]
    for name, prof in (("fp32", on_route(profile, "fp32")), ("profile", profile)):
        bindings = compile_profile(prof, model, world_size=2, total_steps=steps)
        sim = simulate_run(wl, bindings, 2, steps, SEED, checkpoints=(steps,))
        assert sim.metric == arms[name]["metric"], name
        sim.model.eval()
        assert sim.metric == wl.evaluate(sim.model)
    sim.model.train()  # the premise: in training mode the metric is a draw of masks
    assert len({wl.evaluate(sim.model) for _ in range(5)}) > 1
