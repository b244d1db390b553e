"""`HealthThresholds`: when the health monitor trips a scope and when it re-admits it.

Stored in a profile's ``health`` metadata; every field is validated, so a bad profile fails
with one line naming the threshold.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from nfabric_cli.errors import InputError
from nfabric_cli.profile.provenance import calibrated

_INT_FIELDS = ("window", "min_history", "cooldown", "healthy_to_readmit", "max_trips",
               "grad_blowup_trips", "grad_blowup_per_loss", "nonfinite_repeat",
               "loss_spike_repeat")


@dataclass(frozen=True)
class HealthThresholds:
    """Trip and re-admission thresholds (stored in a profile's ``health`` metadata)."""

    window: int = 20  # steps in the rolling windows (loss median, grad-norm median)
    min_history: int = 5  # no spike/blow-up judgement before this many observations
    loss_spike: float = 3.0  # trip when loss > loss_spike * windowed median
    # ... and loss - median > loss_spike_z robust standard deviations (1.4826 * MAD of the
    # window): small-batch losses near zero triple on noise alone (0 turns this test off)
    loss_spike_z: float = 10.0
    # ... and loss > loss_spike_floor * the run's early loss (the median of its first `window`
    # healthy losses): late in a run small-batch losses near zero jump 3-6x, 10-19 robust sd,
    # on a hard batch (vision.v4 at 600 steps: 8 such trips, pinned fp32 for the last half,
    # 58 % traffic, no accuracy at stake); a spike still below a quarter of where training
    # started is not one to fall back for (0 turns this test off)
    loss_spike_floor: float = 0.25
    loss_readmit: float = 1.5  # healthy only when loss <= loss_readmit * median (stricter)
    grad_blowup: float = 10.0  # a blow-up: a scope's grad norm > grad_blowup * its median
    # ... and > grad_blowup_floor * the scope's early norm (the median of its first `window`
    # healthy norms): late in a converged run a hard batch lifts the norm 10-17x a median that
    # has fallen tenfold (transformer at 600 steps: 11 such trips per seed on seeds 0, 1 and 4,
    # pinned fp32 for the last half, 33-55 % traffic), still below where training started
    # (0 turns this test off)
    grad_blowup_floor: float = 1.0
    # What a blow-up does. 0: guarded in place, the scope keeps its route and the update guard
    # holds this step's update (its norm <= update_cap x the healthy median); with the guard
    # off (update_cap 0) it trips after all. 1: every blow-up trips the scope to fp32 for
    # `cooldown` steps, guarded while held. A held update is all a blow-up needs: at four times the calibrated length on
    # two ranks, trips on late blow-ups (5-8 per clean transformer run, pinned for the phase at
    # 53-60 % traffic) moved runs by up to 0.83 points against no monitor (docs/health.md)
    grad_blowup_trips: int = 0
    # How a blow-up is judged. 1: on the norm's rise over the loss's (the norm ratio divided by
    # the step's loss ratio where the loss rose): a batch the model fits badly lifts its loss
    # and its gradient together and is no fault, a corrupted gradient lifts the norm alone.
    # At four times the calibrated length (vision, transformer, seeds 0-2, W = 2 and 4), the
    # runs' own 207 blow-ups rose at most 8.7x over their loss (median 1.6x), every injected
    # x1e3 spike 128x or more (docs/health.md). 0: on the norm ratio alone, the rule of
    # profiles calibrated before it (`from_profile`)
    grad_blowup_per_loss: int = 1
    grad_collapse: float = 1e-3  # trip when a scope's grad norm < grad_collapse * its median
    # ... and the step's loss >= grad_collapse_loss * the windowed median loss: a batch the
    # model already fits has a near-zero loss and so a near-zero gradient, with nothing wrong
    # (transformer.v8 at 4x its length: both collapse trips of a clean run came on losses
    # 140-250x below the median, each holding fp32 and the update ~30 steps); a real collapse
    # keeps its loss (0 turns this test off)
    grad_collapse_loss: float = 0.1
    grad_readmit: float = 3.0  # healthy when median/3 <= norm <= 3*median (stricter)
    sign_agreement_min: float = 0.02  # trip when sign agreement < this
    cooldown: int = 10  # steps a tripped scope is held on FP32 before re-admission checks
    healthy_to_readmit: int = 5  # consecutive healthy checks after cooldown to re-admit
    max_trips: int = 3  # trips of a scope within a phase; then pinned FP32 for the phase
    update_cap: float = 2.0  # a held scope's update norm <= update_cap * its healthy median (0: off)
    # ... and on the step a blow-up is detected in a scope, its update norm <= blowup_cap * the
    # median. That one step's size is what the fault made it: a clean update is about the
    # median's size, so 1 delivers about one healthy step where update_cap's 2 lets twice one
    # through (vision.v12, seed 5, 300 steps, two ranks, an injected x1e3 spike: 0.9611 held at
    # 2x, 0.9750 at 1x, 0.9722 with no fault; over 46 cells of vision, transformer and lm the
    # faulted runs land nearer their clean twins on average; docs/health.md). update_cap stays
    # 2 for the steps a scope is held after: under AdamW a long hold at 1x barely learns. 0:
    # the blow-up's step is held at update_cap like any held step, the rule of profiles
    # calibrated before it
    blowup_cap: float = 1.0
    # A ramp to a full-precision wire (a phase's route change from low-bit to fp32/bf16/fp16,
    # the capacity gate's fp32 steps) also clips each element of the update to ramp_clip x
    # its parameter's mean |update|, doubling every half window, for `window` steps at least:
    # the gate's probe blocks (4 fp32 steps among `sign` ones) within the norm cap still broke
    # vision.v13 (the monitor tripped on the step after a block in 7 of 10 seeds), clipped at 3 they did
    # not (docs/health.md, "The gate's switches ramp"). 0: no clip
    ramp_clip: float = 3.0
    # Non-finite steps within `window` steps that trip "all" to fp32; fewer are only skipped
    # (zeroed on every rank, as AMP's GradScaler skips an overflowing step). A lone NaN says
    # nothing about the routes (they never encode one), and falling back for it cost up to
    # 0.8 points against the same run without the monitor (bench/robustness.py); a repeat
    # may be a route's doing, so it falls back. 1: every non-finite step trips.
    nonfinite_repeat: int = 2
    # Loss spikes within `window` steps that trip every scope to fp32; fewer are held in place
    # (the guard holds every scope's update that step, the routes stay), as a gradient-norm
    # blow-up is. 1: every loss spike trips.
    loss_spike_repeat: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _INT_FIELDS:
                ok, kind = isinstance(value, int) and not isinstance(value, bool), "an integer"
            else:
                ok, kind = _is_finite_number(value), "a finite number"
            if not ok:
                raise InputError(f"health threshold {f.name} must be {kind}, got {value!r}")
        readmit_max = min(self.grad_blowup, 1 / self.grad_collapse) if self.grad_collapse else 0
        rules = [
            ("window", self.window >= 1, ">= 1"),
            ("min_history", 1 <= self.min_history <= self.window, f"in [1, window={self.window}]"),
            ("loss_spike", self.loss_spike > 1, "> 1"),
            ("loss_spike_z", self.loss_spike_z >= 0, ">= 0"),
            ("loss_spike_floor", self.loss_spike_floor >= 0, ">= 0"),
            ("loss_readmit", 1 <= self.loss_readmit <= self.loss_spike,
             f"in [1, loss_spike={self.loss_spike:g}]"),
            ("grad_blowup", self.grad_blowup > 1, "> 1"),
            ("grad_blowup_floor", self.grad_blowup_floor >= 0, ">= 0"),
            ("grad_blowup_trips", self.grad_blowup_trips in (0, 1), "0 or 1"),
            ("grad_blowup_per_loss", self.grad_blowup_per_loss in (0, 1), "0 or 1"),
            ("grad_collapse", 0 < self.grad_collapse < 1, "in (0, 1)"),
            ("grad_collapse_loss", 0 <= self.grad_collapse_loss <= 1, "in [0, 1]"),
            ("grad_readmit", 1 <= self.grad_readmit <= readmit_max,
             "in [1, min(grad_blowup, 1/grad_collapse)]"),
            ("sign_agreement_min", 0 <= self.sign_agreement_min <= 1, "in [0, 1]"),
            ("cooldown", self.cooldown >= 0, ">= 0"),
            ("healthy_to_readmit", self.healthy_to_readmit >= 1, ">= 1"),
            ("max_trips", self.max_trips >= 1, ">= 1"),
            ("update_cap", self.update_cap >= 0, ">= 0 (0 turns the update guard off)"),
            ("blowup_cap", self.blowup_cap >= 0, ">= 0 (0: held at update_cap)"),
            ("ramp_clip", self.ramp_clip == 0 or self.ramp_clip >= 1, "0 (off) or >= 1"),
            ("nonfinite_repeat", self.nonfinite_repeat >= 1, ">= 1"),
            ("loss_spike_repeat", self.loss_spike_repeat >= 1, ">= 1"),
        ]
        for name, ok, requirement in rules:
            if not ok:
                value = getattr(self, name)
                raise InputError(f"health threshold {name} must be {requirement}, got {value}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> HealthThresholds:
        """Build from a (possibly partial) mapping; unknown keys raise `InputError` naming them."""
        d = dict(d or {})
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise InputError(f"unknown health threshold(s): {', '.join(unknown)}")
        return cls(**d)

    @classmethod
    def from_profile(cls, meta: Mapping[str, Any]) -> HealthThresholds:
        """The thresholds of a profile's (or its bindings') metadata. A calibrated profile
        (provenance source "calibrate") stores every threshold, so one it lacks it predates:
        that one counts at the value that keeps the rule the profile was proven with
        (`PREDATED`), not at today's default. Any other health mapping (hand-written, or the
        spec's few thresholds a calibration trains its trials with) is partial: a threshold it
        does not name takes its default."""
        d = dict(meta.get("health") or {})
        if calibrated(meta):
            d = {**{k: v for k, v in PREDATED.items() if k not in d}, **d}
        return cls.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: Thresholds added after profiles were calibrated, at the value that keeps the older rule.
#: (Not `ramp_clip`: ramps came a session before it, with no switch to turn them off, so no
#: calibrated profile was proven under a norm ramp without the clip but by accident; and that
#: mix is the one the probe blocks broke: docs/health.md, "The gate's switches ramp".)
PREDATED: dict[str, Any] = {"grad_blowup_per_loss": 0, "blowup_cap": 0}


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
