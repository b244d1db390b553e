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

#: Most tolerances of excess an out-of-tolerance trial is charged (keeps values finite).
PENALTY_CAP = 1e3


def degradation(metric: float, reference: float, higher_is_better: bool) -> float:
    """How much worse than the reference (positive = worse), in metric units."""
    if math.isnan(metric):
        return math.inf
    return reference - metric if higher_is_better else metric - reference


def objective_value(traffic: float, degr: float, tolerance: float, slack: float = 0.0) -> float:
    """`traffic` within `tolerance + slack`, else 1 + traffic + the excess in tolerances."""
    if degr <= tolerance + slack:
        return traffic
    return 1.0 + traffic + min(PENALTY_CAP, (degr - tolerance - slack) / tolerance)


def gap_value(traffic: float, degr: float, tolerance: float, slack: float) -> float:
    """`objective_value`, but within the widened tolerance the gap costs too (still < 1):
    ``traffic + (1 - traffic) * max(0, degr) / (tolerance + slack)``."""
    if degr <= tolerance + slack:
        return traffic + (1.0 - traffic) * max(0.0, degr) / (tolerance + slack)
    return objective_value(traffic, degr, tolerance, slack)


#: Checkpoint formulas before the last: (traffic, degradation at the step, tolerance, slack)
#: -> value. calibrate uses "slack"; `bench.calibrate_pruning --intermediate` compares them.
INTERMEDIATE: dict[str, Callable[[float, float, float, float], float]] = {
    "slack": objective_value,  # tolerance widened by what the reference still gains
    "half-slack": lambda t, d, tol, s: objective_value(t, d, tol, s / 2),
    "strict": lambda t, d, tol, s: objective_value(t, d, tol),  # no widening
    "gap": gap_value,  # widened, and the gap within it costs
    "traffic": lambda t, d, tol, s: t,  # projected traffic alone: accuracy counts at the end
}
DEFAULT_INTERMEDIATE = "slack"


def intermediate_value(traffic: float, degr: float, tolerance: float, slack: float,
                       last: bool, formula: str = DEFAULT_INTERMEDIATE) -> float:
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
    return INTERMEDIATE[formula](traffic, degr, tolerance, slack)
