"""Beyond two ranks the simulator replays real DDP bit for bit: gloo's ring adds each element
in an order set by its place in the all-reduced buffer, and the simulator follows it through
DDP's first-step bucket and the rebuilt ones (`calibration/reduces.py`); at three ranks 1/W is
inexact, and the simulator scales as DDP does (`routes/fp32.py`, `ddp_mean_`)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from nfabric_cli.binding import compile_profile, static_profile
from nfabric_cli.binding.fingerprint import trainable_parameters
from nfabric_cli.calibration.reduces import ddp_layouts
from nfabric_cli.calibration.simulate import simulate_run
from nfabric_cli.ranks.loop import train_workload
from nfabric_cli.runtime.attach import attach_with
from tests.calibration.tiny import TinyWorkload
from tests.distutil import agreed, run_ranks

#: DDP's bucket cap (MB): the first step reduces one bucket of 4276 elements, later steps the
#: rebuilt ones of 3316 and 960.
CAP = 0.002
STEPS, SEED, WORLD = 4, 1, 4
#: The hook's arm: `mid` on sign with error feedback, `norm` on bf16, the rest on fp32: mixed
#: buckets whose float groups are all-reduced on their own, and an all-fp32 bucket.
MIXED = [("mid.*", "sign"), ("norm.*", "bf16")]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 64)
        self.norm = nn.LayerNorm(64)
        self.mid = nn.Linear(64, 48)
        self.head = nn.Linear(48, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.mid(F.relu(self.norm(self.inp(x))))))


class NetWorkload(TinyWorkload):
    def _make_model(self) -> nn.Module:
        return Net()


def _bindings(model: nn.Module, world: int, mixed: bool):
    profile = static_profile(model, "fp32", MIXED if mixed else None, error_feedback=True,
                             world_size=world)
    return compile_profile(profile, model, world, CAP, total_steps=STEPS)


#: (arm, world size) of each real run: the hook arm only at W ranks (`attach` creates its own
#: process group, which every rank of the default group would have to join).
ARMS = (("plain", WORLD), ("hook", WORLD), ("plain", 3))


def _arms(rank: int, size: int) -> dict[tuple[str, int], dict]:
    """Each arm from the same initial model; W = 3 on ranks 0-2."""
    groups = {WORLD: None, 3: dist.new_group([0, 1, 2])}  # every rank takes part in creating it
    out = {}
    for arm, world in ARMS:
        if rank >= world:
            continue
        wl = NetWorkload()
        model = wl.build_model(SEED)
        ddp = DDP(model, bucket_cap_mb=CAP, process_group=groups[world])
        state = None
        if arm == "hook":
            state = attach_with(ddp, _bindings(model, world, True), STEPS, seed=SEED)
        opt, sched = wl.make_optimizer(ddp.parameters(), STEPS)
        losses = train_workload(ddp, state, wl, opt, sched, STEPS, rank, world, SEED)
        out[arm, world] = {
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "losses": losses,
            "events": [] if state is None else agreed(state.events),
        }
        if state is not None:
            state.close()
    return out


def test_layouts_are_ddps_first_bucket_then_the_rebuilt_ones() -> None:
    wl = NetWorkload()
    model = wl.build_model(SEED)
    names = [tp.name for tp in trainable_parameters(model)]
    layouts = ddp_layouts(wl, model, names, 4, SEED, CAP)
    numel = [p.numel() for p in model.parameters()]
    assert [[numel[i] for i in b] for b in layouts.at(0)] == [[768, 64, 64, 64, 3072, 48, 192, 4]]
    # in gradient-ready order, traced: LayerNorm's weight is ready before its bias
    assert [[names[i] for i in b] for b in layouts.at(1)] == [
        ["head.bias", "head.weight", "mid.bias", "mid.weight"],
        ["norm.weight", "norm.bias", "inp.bias", "inp.weight"],
    ]
    assert layouts.at(5) == layouts.rebuilt


def test_simulated_runs_replay_real_ddp_across_the_bucket_rebuild() -> None:
    real = run_ranks(_arms, WORLD)
    wl = NetWorkload()
    for arm, world in ARMS:
        model = wl.build_model(SEED)
        sim = simulate_run(wl, _bindings(model, world, arm == "hook"), world, STEPS, SEED,
                           checkpoints=(STEPS,), processes=2)
        ranks = [real[r][arm, world] for r in range(world)]
        for name, p in sim.model.named_parameters():
            assert torch.equal(p.detach(), ranks[0]["params"][name]), (arm, world, name)
        losses = [sum(r["losses"][s] for r in ranks) / world for s in range(STEPS)]
        assert sim.loss_curve == [(STEPS, sum(losses) / STEPS)]
        assert sim.events == ranks[0]["events"]
