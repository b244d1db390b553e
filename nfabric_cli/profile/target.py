"""A profile's target: how far a metric may fall from its FP32 reference.

One rule for calibration (which trials are admissible) and validation (which runs pass):
degradation is positive when worse, in metric units, and a drop of exactly the tolerance is
within it.
"""

from __future__ import annotations

import math

#: Rounding allowed at the tolerance's edge: metrics on a finite test set sit on a grid, and
#: 0.9 - 0.85 is 0.05000000000000004 in floats.
TOLERANCE_EPS = 1e-12


def degradation(metric: float, reference: float, higher_is_better: bool) -> float:
    """How much worse than the reference (positive = worse), in metric units; NaN: infinite."""
    if math.isnan(metric):
        return math.inf
    return reference - metric if higher_is_better else metric - reference


def within_tolerance(degr: float, tolerance: float, slack: float = 0.0) -> bool:
    """Whether a degradation is admissible: at most `tolerance + slack`, up to rounding."""
    return degr <= tolerance + slack + TOLERANCE_EPS
