"""A loss scaler (AMP's GradScaler) on top of the fabric hook: it must see an overflowing step.

The scaler skips a step whose gradients are not finite and halves its scale; DDP passes the
overflow on (a sum carries it to every rank). The hook zeroes a non-finite step by default
(a NaN update would wreck a run without a scaler), which a scaler reads as finite: it never
lowers its scale and every later step overflows again. `nonfinite="pass"` hands the step on
not finite, on every rank; the default says, after a few zeroed steps in a row, to use it.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from nfabric_cli.binding import compile_profile, static_profile
from nfabric_cli.runtime.controller import SCALER_REASON
from tests.calibration.tiny import TinyWorkload
from tests.distutil import run_ranks
from tests.runtime.models import tiny_ddp

STEPS, START, FITS = 10, 2.0**24, 2.0**20


def _worker(rank: int, world: int, mode: str | None) -> dict:
    wl, model, ddp, state = tiny_ddp(world, STEPS, None if mode is None else "sign",
                                     nonfinite=mode)
    start = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=START, growth_interval=10**6)
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            loss = wl.loss(ddp, wl.train_batch(step, rank, world, 0))
            if state is not None:
                state.observe(loss)
            opt.zero_grad()
            scaled = scaler.scale(loss)
            if scaler.get_scale() > FITS:  # what fp16 does above its range: the step overflows
                scaled = scaled * float("inf")
            scaled.backward()
            scaler.step(opt)
            scaler.update()
            losses.append(float(loss.detach()))
    moved = any(not torch.equal(p, q) for p, q in zip(model.parameters(), start, strict=True))
    out = {"scale": scaler.get_scale(), "losses": losses, "moved": moved,
           "warned": [str(w.message) for w in caught if "nfabric: steps" in str(w.message)]}
    if state is not None:
        out["skipped"] = list(state.skipped_steps)
        out["events"] = [(e["step"], e["to"], e["reason"]) for e in state.events]
        state.close()
    return out


@pytest.mark.parametrize("mode", ["pass", "zero"])
def test_a_loss_scaler_sees_the_overflow_only_when_passed(mode: str) -> None:
    plain, fabric = (run_ranks(_worker, 2, m)[0] for m in (None, mode))
    assert plain["scale"] == FITS  # four overflows, four halvings, then it trains
    if mode == "pass":
        assert fabric["scale"] == FITS and fabric["skipped"] == [0, 1, 2, 3]
        # the scaler's to skip: logged, not judged (no fallback, no hold)
        assert fabric["events"] == [(s, "skipped", SCALER_REASON) for s in range(4)]
        assert fabric["losses"][-1] < fabric["losses"][4]  # it trains once the scale fits
        assert fabric["warned"] == []
    else:  # zeroed: the scaler never backs off, every step overflows, nothing trains
        assert fabric["scale"] == START and fabric["skipped"] == list(range(STEPS))
        assert not fabric["moved"] and plain["moved"]
        assert len(fabric["warned"]) == 1 and "nonfinite='pass'" in fabric["warned"][0]
        assert "steps 0-2 were not finite" in fabric["warned"][0]


def test_an_unknown_nonfinite_mode_is_one_line() -> None:
    from nfabric_cli.errors import InputError
    from nfabric_cli.runtime.controller import StepController

    model = TinyWorkload().build_model(0)
    bindings = compile_profile(static_profile(model, "sign"), model, world_size=2, total_steps=4)
    with pytest.raises(InputError, match="nonfinite: one of 'zero', 'pass', got 'skip'"):
        StepController(bindings, 4, 2, lambda e: None, nonfinite="skip")
