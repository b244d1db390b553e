"""Overhead of the fabric hook: an all-fp32 profile vs plain DDP, interleaved in one run, and
the health monitor's fallback path (a `sign` profile with every scope held on fp32: what a run
pays for each step the monitor holds) beside them.

Every arm trains the same MLP on the same batches over gloo on loopback; rounds interleave
the arms so drift in machine load hits them alike, every other round in reverse order and an
even number of rounds, so each arm runs first as often as last (in one fixed order, fabric
always last, fabric read 1.056-1.123x plain DDP where PyTorch's own hook read 0.97-1.04x;
alternating, over six runs, fabric 0.96-1.13x and the hook 0.99-1.08x, fabric / hook
0.97-1.05 in the same run). The ratio of median step times is the hook's cost (the 1/W scan
any comm hook pays, bookkeeping); the hook's ratio beside it is that of PyTorch's own.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from nfabric_cli.ranks.functions import run_function_ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


#: A timed run's first steps, left out (allocation, DDP's bucket rebuild); a run needs one more.
WARMUP = 2
MIN_STEPS = WARMUP + 1


def step_time(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], steps: int,
              state=None, loss: str = "ce") -> float:  # noqa: ANN001 - a FabricState or None
    """Median seconds of one training step (forward, `observe`, backward, SGD) over `steps`
    steps on `batch`, the first two left out (warm-up); `loss` is "ce" or "mse"."""
    if steps < MIN_STEPS:
        raise ValueError(f"steps must be >= {MIN_STEPS} ({WARMUP} are warm-up), got {steps}")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    fn = nn.functional.cross_entropy if loss == "ce" else nn.functional.mse_loss
    x, y = batch
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        value = fn(model(x), y)
        if state is not None:
            state.observe(value)
        opt.zero_grad()
        value.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[WARMUP:])


def _time_steps(ddp: DDP, steps: int, rank: int, state=None) -> float:  # noqa: ANN001
    gen = torch.Generator().manual_seed(rank)
    batch = torch.randn(64, 256, generator=gen), torch.randint(0, 10, (64,), generator=gen)
    return step_time(ddp, batch, steps, state)


def _worker(rank: int, world: int, steps: int, rounds: int) -> tuple[list, list, list, list]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from nfabric_cli import attach
    from nfabric_cli.binding import compile_profile, static_profile

    plain = DDP(_model())
    hooked = DDP(_model())  # PyTorch's own Python allreduce_hook: the floor for any Python hook
    hooked.register_comm_hook(None, default_hooks.allreduce_hook)
    fabric_model = _model()
    fabric = DDP(fabric_model)
    bindings = compile_profile(static_profile(fabric_model, "fp32"), fabric_model, world_size=world)
    state = attach(fabric, bindings, total_steps=steps * rounds)
    held_model = _model()
    held = DDP(held_model)
    held_state = attach(held, compile_profile(static_profile(held_model, "sign"), held_model,
                                              world_size=world), total_steps=steps * rounds)
    hold_everything(held_state)
    arms = [(plain, None, []), (hooked, None, []), (fabric, state, []), (held, held_state, [])]
    for r in range(rounds):
        # every other round in reverse, so that no arm always runs first or right after another
        for model, st, times in (arms if r % 2 == 0 else arms[::-1]):
            times.append(_time_steps(model, steps, rank, st))
    state.close()
    held_state.close()
    return tuple(times for _, _, times in arms)


def hold_everything(state) -> None:  # noqa: ANN001 - a FabricState
    """Pin the whole model on fp32 for the phase, as the monitor does after `max_trips`: every
    step then takes the monitor's fallback path (routes on fp32, statistics still agreed)."""
    sd = state.monitor.state_dict()
    sd["holds"]["all"]["status"] = "pinned"
    state.monitor.load_state_dict(sd)


def bench_runtime(world_size: int = 2, steps: int = 60, rounds: int = 6) -> dict:
    rounds += rounds % 2  # as many reversed rounds as forward ones
    times = run_function_ranks(_worker, world_size, steps, rounds)[0]
    plain, hook, fabric, held = (statistics.median(t) for t in times)
    return {"world_size": world_size, "steps": steps, "rounds": rounds,
            "plain_step_s": plain, "allreduce_hook_step_s": hook, "fabric_step_s": fabric,
            "held_step_s": held, "ratio": fabric / plain, "allreduce_hook_ratio": hook / plain,
            "held_ratio": held / plain}
