"""The calibration objective and what a trial reports at its checkpoints.

One value, so pruners work: the trial's traffic fraction when its metric is within
tolerance of the FP32 reference, else ``1 + traffic + excess / tolerance`` (every
out-of-tolerance trial ranks behind every admissible one; all-fp32 scores 1.0). Checkpoints
before the last report a formula from `INTERMEDIATE` (the default widens the tolerance by what
the reference still gains after the step); the last reports the objective itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from nfabric_cli.calibration.codeprint import KEY, code_fingerprint
from nfabric_cli.profile.target import degradation, within_tolerance

#: Most tolerances of excess an out-of-tolerance trial is charged (keeps values finite).
PENALTY_CAP = 1e3


def objective_value(traffic: float, degr: float, tolerance: float, slack: float = 0.0) -> float:
    """`traffic` within `tolerance + slack`, else 1 + traffic + the excess in tolerances."""
    if within_tolerance(degr, tolerance, slack):
        return traffic
    return 1.0 + traffic + min(PENALTY_CAP, (degr - tolerance - slack) / tolerance)


def gap_value(traffic: float, degr: float, tolerance: float, slack: float) -> float:
    """`objective_value`, but within the widened tolerance the gap costs too (still < 1):
    ``traffic + (1 - traffic) * max(0, degr) / (tolerance + slack)``."""
    if within_tolerance(degr, tolerance, slack):
        return traffic + (1.0 - traffic) * max(0.0, degr) / (tolerance + slack)
    return objective_value(traffic, degr, tolerance, slack)


def loss_scale(curve: list[list[float]], loss_curve: list[list[float]],
               higher_is_better: bool) -> float | None:
    """Metric units per unit of training loss, from the reference run: how much its metric
    improved between its first and last checkpoints over how much its training loss (mean over
    each checkpoint's window) fell. Converts a trial's paired training-loss gap into a
    predicted degradation. None when the reference's loss did not fall or its metric did not
    improve (no usable scale)."""
    if len(curve) < 2 or len(loss_curve) != len(curve):
        return None
    gain = -degradation(curve[-1][1], curve[0][1], higher_is_better)
    fall = loss_curve[0][1] - loss_curve[-1][1]
    if not (math.isfinite(gain) and math.isfinite(fall)) or gain <= 0 or fall <= 0:
        return None
    return gain / fall


def loss_value(traffic: float, degr: float, tolerance: float, slack: float,
               loss_degr: float | None) -> float:
    """`objective_value` on the degradation the paired training-loss gap predicts (no
    widening: the gap of a failing trial grows, it does not close); the widened metric
    formula where there is no prediction (no loss recorded, or no `loss_scale`)."""
    if loss_degr is None:
        return objective_value(traffic, degr, tolerance, slack)
    return objective_value(traffic, loss_degr, tolerance)


#: Checkpoint formulas before the last: (traffic, degradation at the step, tolerance, slack,
#: loss-predicted degradation or None) -> value. calibrate uses "slack";
#: `bench.calibrate_pruning --intermediate` compares them.
INTERMEDIATE: dict[str, Callable[[float, float, float, float, float | None], float]] = {
    # tolerance widened by what the reference still gains
    "slack": lambda t, d, tol, s, ld: objective_value(t, d, tol, s),
    "half-slack": lambda t, d, tol, s, ld: objective_value(t, d, tol, s / 2),
    "strict": lambda t, d, tol, s, ld: objective_value(t, d, tol),  # no widening
    "gap": lambda t, d, tol, s, ld: gap_value(t, d, tol, s),  # widened, and the gap within costs
    "traffic": lambda t, d, tol, s, ld: t,  # projected traffic alone: accuracy counts at the end
    "loss": loss_value,  # the training loss's prediction instead of the metric's gap
}
DEFAULT_INTERMEDIATE = "slack"


def intermediate_value(traffic: float, degr: float, tolerance: float, slack: float,
                       last: bool, formula: str = DEFAULT_INTERMEDIATE,
                       loss_degr: float | None = None) -> float:
    """The value a trial reports at a checkpoint: `traffic` is the projected traffic (measured
    so far plus the planned routes for the steps left: known long before accuracy is), `degr`
    the gap to the reference curve at that step, `slack` what the reference still gains after
    it. The last checkpoint reports exactly the objective (the study's best and the profile
    keep their meaning); earlier ones `INTERMEDIATE[formula]`. The default widens the tolerance
    by the slack: in `vision` and `lm` replays no widening, or a cost for the gap within it,
    pruned the eventual winner more often; a gap before the last checkpoints is mostly
    evaluation noise (docs/calibration.md, "Objective and pruning")."""
    if last:
        return objective_value(traffic, degr, tolerance)
    return INTERMEDIATE[formula](traffic, degr, tolerance, slack, loss_degr)


def store_result(trial: Any, record: dict[str, Any], result: Any) -> None:
    """Keep a trained trial's result in its user attributes (what `--status`, the dashboard,
    reuse of an identical configuration and the profile's evidence read back)."""
    from nfabric_cli.runtime.controller import fallbacks

    for key, value in record.items():
        if key != "number":
            trial.set_user_attr(key, value)
    trial.set_user_attr("curve", [list(c) for c in result.curve])
    trial.set_user_attr("row_traffic", {f"{r}@{p}": v for (r, p), v in result.row_traffic.items()})
    trial.set_user_attr("fallbacks", fallbacks(result.events))
    trial.set_user_attr("skipped_steps", len(result.skipped_steps))
    trial.set_user_attr(KEY, code_fingerprint())
