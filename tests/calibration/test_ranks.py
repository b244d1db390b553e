"""Simulated ranks in forked processes: bit-identical to one process, per-rank RNG, clean exits."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nfabric_cli.binding import compile_profile
from nfabric_cli.calibration.aggregate import StepRoutes
from nfabric_cli.calibration.ranks import SimulatedRanks, default_processes
from nfabric_cli.calibration.simulate import simulate_run
from nfabric_cli.calibration.space import Config, config_profile
from nfabric_cli.errors import PluginError
from nfabric_cli.routes import FP32
from nfabric_cli.runtime.inject import Injection
from tests.calibration.helpers import tiny_spec
from tests.calibration.tiny import TinyBNWorkload, TinyNet, TinyWorkload

STEPS = 6


class DropoutNet(TinyNet):
    """TinyNet with dropout: each rank's masks come from its own RNG stream."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.dropout(F.relu(self.norm(self.body(x))), 0.5, self.training))


class DropoutWorkload(TinyWorkload):
    def _make_model(self) -> nn.Module:
        return DropoutNet()


class FailingWorkload(TinyWorkload):
    fail = False

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if self.fail:
            raise ValueError("rank loss exploded")
        return super().loss(model, batch)


def _ranks(wl: TinyWorkload, model: nn.Module, world: int, seed: int, processes: int):  # noqa: ANN202
    names = [n for n, _ in model.named_parameters()]
    return SimulatedRanks(wl, model, list(model.parameters()), names, world, seed, processes)


def _fp32_plan(model: nn.Module) -> StepRoutes:
    n = len(list(model.parameters()))
    return StepRoutes(("all",) * n, (FP32,) * n)


def _bindings(model: nn.Module, world: int):  # noqa: ANN202
    spec = tiny_spec(world_size=world, steps=STEPS)
    config = Config((("fp32", "sign"), ("int8", "ternary")), (0.4,), 0.5, True)
    profile = config_profile(spec, config, {"world_size": world})
    return compile_profile(profile, model, world_size=world, bucket_cap_mb=None, total_steps=STEPS)


def _run(workload: TinyWorkload, world: int, processes: int):  # noqa: ANN202
    bindings = _bindings(workload.build_model(0), world)
    return simulate_run(workload, bindings, world, STEPS, 0, checkpoints=(3, STEPS),
                        processes=processes)


@pytest.mark.parametrize("world", [3, 4])
def test_forked_ranks_equal_one_process_bit_for_bit(world: int) -> None:
    wl = DropoutWorkload()
    one, two = _run(wl, world, 1), _run(wl, world, 2)
    for (name, p), q in zip(one.model.named_parameters(), two.model.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert one.curve == two.curve and one.events == two.events
    assert one.traffic_fraction == two.traffic_fraction
    assert not mp.active_children()  # the children were joined


def test_each_rank_draws_its_own_stream_from_the_seed() -> None:
    """Every rank starts from manual_seed(seed), as W real ranks seeded alike do: with the same
    batch, two ranks draw the same dropout masks; the stream advances per rank."""
    wl = DropoutWorkload()
    model = wl.build_model(0)
    ranks = _ranks(wl, model, 2, seed=5, processes=1)
    wl_batch = wl.train_batch
    try:
        wl.train_batch = lambda step, rank, w, seed: wl_batch(step, 0, w, seed)  # same batch
        first = ranks.step(0, _fp32_plan(model))
        grads, losses = [[g.clone() for g in r] for r in ranks.views], first.losses
        assert losses[0] == losses[1]
        assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1], strict=True))
        assert first.norms[0] == [float(g.norm()) for g in grads[0]]
        torch.manual_seed(5)
        expected = wl.loss(model, wl_batch(0, 0, 2, 5))
        assert losses[0] == float(expected.detach())
        again = ranks.step(0, _fp32_plan(model)).losses  # the streams moved on: new masks
        assert again[0] != losses[0]
    finally:
        wl.train_batch = wl_batch
        ranks.close()


def test_a_failing_rank_raises_in_the_parent_and_the_children_exit() -> None:
    wl = FailingWorkload()
    wl.fail = True
    model = wl.build_model(0)
    ranks = _ranks(wl, model, 4, seed=0, processes=2)
    assert len(ranks.children) == 2
    # the workload's own code raised (a plugin's bug): its line, naming its frame (exit 2)
    with pytest.raises(PluginError, match=r"^the plugin's code raised ValueError: rank loss "
                                          r"exploded \(test_ranks\.py:\d+ in loss; in a "
                                          r"simulated rank at step 0\)$"):
        ranks.step(0, _fp32_plan(model))
    ranks.close()
    assert not mp.active_children()


class OneRankFails(TinyWorkload):
    """Rank 1 (in the second child) fails; `hard`: its process dies without a word."""

    hard = False

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if torch.equal(batch[0], self.train_batch(0, 1, 4, 0)[0]):
            if self.hard:
                os._exit(3)
            raise ValueError("rank 1 exploded")
        return super().loss(model, batch)


@pytest.mark.parametrize("hard", [False, True])
def test_one_failing_child_does_not_leave_its_sibling_at_the_barrier(hard: bool) -> None:
    """The healthy child waits at the barrier for the failed one's gradients; the failure
    breaks the barrier, the parent names the real cause, and every child exits."""
    wl = OneRankFails()
    wl.hard = hard
    model = wl.build_model(0)
    ranks = _ranks(wl, model, 4, seed=0, processes=2)
    cause = "process 1 exited \\(exit code 3\\)" if hard else "ValueError: rank 1 exploded"
    with pytest.raises(RuntimeError if hard else PluginError, match=cause):
        ranks.step(0, _fp32_plan(model))
    ranks.close()
    assert not mp.active_children()


def test_models_with_buffers_stay_in_one_process() -> None:
    wl = TinyBNWorkload()
    model = wl.build_model(0)
    ranks = _ranks(wl, model, 4, seed=0, processes=2)
    assert ranks.processes == 1 and not ranks.children
    ranks.close()


def test_default_is_one_process_per_cpu_at_most_world_size() -> None:
    assert default_processes(1) == 1
    assert 1 <= default_processes(64) <= 64
    with pytest.raises(ValueError, match="processes must be >= 1"):
        SimulatedRanks(TinyWorkload(), TinyNet(), [], [], 2, 0, processes=0)


class NaNWorkload(TinyWorkload):
    """Rank 1's batch at step 2 holds a NaN: its loss and gradient are not finite."""

    def train_batch(self, step: int, rank: int, world_size: int, seed: int):  # noqa: ANN201
        x, y = super().train_batch(step, rank, world_size, seed)
        if (step, rank) == (2, 1):
            x = x.clone()
            x[0, 0] = float("nan")
        return x, y


def test_a_nonfinite_rank_in_a_child_skips_the_step_everywhere() -> None:
    runs = [_run(NaNWorkload(), 4, p) for p in (1, 2)]
    for run in runs:
        assert run.skipped_steps == [2]
        assert any(e["to"] == "skipped" and e["step"] == 2 for e in run.events)
        assert all(torch.isfinite(p).all() for p in run.model.parameters())
    for p, q in zip(runs[0].model.parameters(), runs[1].model.parameters(), strict=True):
        assert torch.equal(p, q)


_KILLED_PARENT = """
import os, signal, sys
from tests.calibration.tiny import TinyWorkload
from nfabric_cli.calibration.ranks import SimulatedRanks
wl = TinyWorkload()
model = wl.build_model(0)
names = [n for n, _ in model.named_parameters()]
ranks = SimulatedRanks(wl, model, list(model.parameters()), names, 4, 0, processes=2)
with open(sys.argv[1], "w") as f:
    f.write(" ".join(str(c.pid) for c in ranks.children))
os.kill(os.getpid(), signal.SIGKILL)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited (its new parent reaps it)


def test_children_exit_when_the_parent_is_killed_outright(tmp_path: Path) -> None:
    """SIGKILL runs no cleanup: each child must see its pipe close (no other process may
    hold the parent's end) and exit by itself."""
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "pids"
    proc = subprocess.run([sys.executable, "-c", _KILLED_PARENT, str(out)], cwd=root, timeout=120)
    assert proc.returncode == -9
    pids = [int(p) for p in out.read_text().split()]
    assert len(pids) == 2

    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if _alive(p)]


class AdamWorkload(DropoutWorkload):
    def make_optimizer(self, params, total_steps: int):  # noqa: ANN001
        opt = torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
        return opt, None


def test_forked_children_step_adamw_shards_bit_for_bit() -> None:
    """Each child steps its copy of the optimizer on its shard alone: AdamW's per-parameter
    state (moments, step count) must give the whole step's result."""
    wl = AdamWorkload()
    one, two = _run(wl, 4, 1), _run(wl, 4, 2)
    for (name, p), q in zip(one.model.named_parameters(), two.model.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert one.curve == two.curve


def _stepping(wl: TinyWorkload, processes: int, steps: list[int]) -> tuple[list, nn.Module]:
    model = wl.build_model(0)
    opt, sched = wl.make_optimizer(model.parameters(), 10)
    names = [n for n, _ in model.named_parameters()]
    ranks = SimulatedRanks(wl, model, list(model.parameters()), names, 4, 0, processes,
                           optimizer=opt, scheduler=sched)
    try:
        losses = [ranks.step(s, _fp32_plan(model)).losses for s in steps]
    finally:
        ranks.close()
    return losses, model


def test_a_step_other_than_the_next_recomputes_what_was_computed_ahead() -> None:
    """After step s the children compute step s+1's gradients ahead of its plan; asked for
    another step, they rewind the ranks' RNG streams and compute that one, as one process
    does."""
    order = [0, 1, 1, 5, 2, 3]
    (one, m1), (two, m2) = (_stepping(DropoutWorkload(), p, order) for p in (1, 2))
    assert one == two
    assert one[1] != one[2]  # the streams moved on between the two step-1 calls
    for p, q in zip(m1.parameters(), m2.parameters(), strict=True):
        assert torch.equal(p, q)


def _nan_run(processes: int, plain: bool) -> nn.Module:
    wl = TinyWorkload()
    model = wl.build_model(0)
    opt, sched = wl.make_optimizer(model.parameters(), 10)
    names = [n for n, _ in model.named_parameters()]
    ranks = SimulatedRanks(wl, model, list(model.parameters()), names, 4, 0, processes,
                           optimizer=opt, scheduler=sched, injections=(Injection("nan", 2, 1),))
    n = len(names)
    try:
        for step in range(4):
            ranks.step(step, StepRoutes(("all",) * n, (FP32,) * n, plain=plain))
    finally:
        ranks.close()
    return model


@pytest.mark.parametrize("plain", [True, False])
def test_a_nan_gradient_passes_a_plain_step_and_is_neutralised_otherwise(plain: bool) -> None:
    """Plain DDP (an all-fp32 phase) sums a rank's NaN into every update; any other step is
    neutralised. Forked children, each zeroing only the parameters it owns, agree with one
    process bit for bit, NaN for NaN."""
    one, two = _nan_run(1, plain), _nan_run(2, plain)
    for p, q in zip(one.parameters(), two.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, equal_nan=True)
        assert bool(p.isnan().any()) == plain


class FailsAtStep(TinyWorkload):
    """Every rank's loss raises from step `at` on."""

    at = 3

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if torch.equal(batch[0], self.train_batch(self.at, 0, 4, 0)[0]):
            raise ValueError(f"loss exploded at step {self.at}")
        return super().loss(model, batch)


def test_a_failure_computed_ahead_is_reported_for_its_step_only() -> None:
    """Step 3's gradients fail while the children compute them ahead, after step 2: a run that
    stops at step 2 never hears of it; asking for step 3 raises it."""
    wl = FailsAtStep()
    model = wl.build_model(0)
    ranks = _ranks(wl, model, 4, seed=0, processes=2)
    for s in range(3):
        ranks.step(s, _fp32_plan(model))
    with pytest.raises(PluginError, match="raised ValueError: loss exploded at step 3 .*in a "
                                          "simulated rank at step 3"):
        ranks.step(3, _fp32_plan(model))
    ranks.close()
    assert not mp.active_children()
    ranks = _ranks(wl, model, 4, seed=0, processes=2)
    for s in range(3):
        ranks.step(s, _fp32_plan(model))
    ranks.close()  # no error: nobody asked for step 3
    assert not mp.active_children()


class Logged(DropoutWorkload):
    """Appends each (step, rank) whose batch a rank draws to `log` (a file: children write it)."""

    log: Path

    def train_batch(self, step: int, rank: int, world_size: int, seed: int):  # noqa: ANN201
        with open(self.log, "a") as f:
            f.write(f"{step} {rank}\n")
        return super().train_batch(step, rank, world_size, seed)


def _after_last(log: Path, processes: int) -> tuple[list, nn.Module]:
    """Steps 0-2, step 2 said to be the run's last, then step 5 asked for anyway (the last
    again: nothing is drawn after it either); each step's losses, and the model."""
    wl = Logged()
    wl.log = log
    model = wl.build_model(0)
    ranks = _ranks(wl, model, 4, seed=0, processes=processes)
    try:
        losses = [ranks.step(s, _fp32_plan(model), last=s in (2, 5)).losses for s in (0, 1, 2, 5)]
    finally:
        ranks.close()
    return losses, model


def test_no_gradients_are_computed_ahead_of_a_runs_last_step(tmp_path: Path) -> None:
    """After the step a run says is its last, the children do not draw the next step's
    batches (a child computes ahead before it reads its next request, so step 3 would be in
    the log before step 5); a step asked for after it is still computed, as one process
    computes it, bit for bit."""
    (l1, m1), (l2, m2) = (_after_last(tmp_path / f"p{p}", p) for p in (1, 2))
    drawn = sorted((tmp_path / "p2").read_text().split("\n")[:-1])
    assert drawn == sorted(f"{s} {r}" for s in (0, 1, 2, 5) for r in range(4))
    assert l1 == l2
    for p, q in zip(m1.parameters(), m2.parameters(), strict=True):
        assert torch.equal(p, q)


class CoupledSGD(torch.optim.SGD):
    """A subclass may couple parameters (say, clip by the global norm): not sharded."""


def test_an_optimizer_not_known_per_parameter_keeps_one_process() -> None:
    wl = TinyWorkload()
    model = wl.build_model(0)
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    coupled = SimulatedRanks(wl, model, params, names, 4, 0, 2,
                             optimizer=CoupledSGD(params, lr=0.1))
    assert coupled.processes == 1 and not coupled.children
    coupled.close()
    plain = SimulatedRanks(wl, model, params, names, 4, 0, 2,
                           optimizer=torch.optim.SGD(params, lr=0.1))
    assert plain.processes == 2
    plain.close()


_INTERRUPTED = """
import signal, sys, time
# Ctrl-C raises, as under a terminal (a test runner started with `&` or nohup passes SIGINT
# on ignored, and this process would never stop)
signal.signal(signal.SIGINT, signal.default_int_handler)
import torch
from tests.calibration.tiny import TinyWorkload
from nfabric_cli.calibration.aggregate import StepRoutes
from nfabric_cli.calibration.ranks import SimulatedRanks
from nfabric_cli.interrupt import deferred_sigint
from nfabric_cli.routes import FP32
from nfabric_cli.runtime.inject import Injection

class Slow(TinyWorkload):
    def loss(self, model, batch):
        time.sleep(0.01)  # the children are mid-step whenever the signal comes
        return super().loss(model, batch)

wl = Slow()
model = wl.build_model(0)
names = [n for n, _ in model.named_parameters()]
ranks = SimulatedRanks(wl, model, list(model.parameters()), names, 4, 0, processes=2)
plan = StepRoutes(("all",) * len(names), (FP32,) * len(names))
with open(sys.argv[1], "w") as f:
    f.write(" ".join(str(c.pid) for c in ranks.children))
try:
    with deferred_sigint() as interrupt:  # as simulate_run loops
        step = 0
        while True:
            interrupt.check()
            ranks.step(step, plan)
            step += 1
except KeyboardInterrupt:
    ranks.close()
    print("interrupted", file=sys.stderr)
    sys.exit(130)
"""


def test_ctrl_c_to_the_process_group_stops_the_parent_alone_and_it_stops_the_children(
    tmp_path: Path,
) -> None:
    """A terminal's Ctrl-C signals every process in the foreground group: the children
    ignore it (no KeyboardInterrupt traceback of theirs), the parent's handler closes them."""
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "pids"
    proc = subprocess.Popen([sys.executable, "-c", _INTERRUPTED, str(out)], cwd=root,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (out.exists() and out.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # a few steps in
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:  # a failed run must not leave its loop spinning
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, err
    assert err.strip() == "interrupted", err
    deadline = time.monotonic() + 10
    pids = [int(p) for p in out.read_text().split()]
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if _alive(p)]
