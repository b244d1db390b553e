"""A profile's target: how far a metric may fall from its FP32 reference.

One rule for calibration (which trials are admissible) and validation (which runs pass):
degradation is positive when worse, in metric units, and a drop of exactly the tolerance is
within it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from nfabric_cli.errors import InputError

#: Rounding allowed at the tolerance's edge: metrics on a finite test set sit on a grid, and
#: 0.9 - 0.85 is 0.05000000000000004 in floats.
TOLERANCE_EPS = 1e-12


def degradation(metric: float, reference: float, higher_is_better: bool) -> float:
    """How much worse than the reference (positive = worse), in metric units; NaN: infinite."""
    if math.isnan(metric):
        return math.inf
    return reference - metric if higher_is_better else metric - reference


def require_finite_reference(metric: float, where: str) -> None:
    """Refuse an fp32 reference that diverged: plain DDP lets a non-finite gradient through,
    so a workload that blows up on fp32 ends NaN, and every trial against it would score the
    same worst penalty while the budget is spent. One line, exit 2 (`InputError`)."""
    if not math.isfinite(metric):
        raise InputError(f"the fp32 reference {where} ended with metric {metric}: the workload "
                         "diverges on plain fp32 DDP, so there is nothing to calibrate against "
                         "(lower its learning rate, or check its loss)")


def t_quantile(q: float, df: int) -> float:
    """Student's t quantile (scipy: scikit-learn's dependency, always installed with it)."""
    from scipy.stats import t

    return float(t.ppf(q, df))


def prediction_bound(degradations: list[float], q: float = 0.95) -> float | None:
    """The one-sided `q` prediction bound for one more run's degradation, from these runs:
    ``mean + t(q, n-1) * sd * sqrt(1 + 1/n)``; None with fewer than two runs."""
    n = len(degradations)
    if n < 2 or not all(math.isfinite(d) for d in degradations):
        return None if n < 2 else math.inf
    mean = statistics.fmean(degradations)
    return mean + t_quantile(q, n - 1) * statistics.stdev(degradations) * math.sqrt(1 + 1 / n)


def setting_bound(cells: Sequence[Mapping[str, Any]], q: float = 0.95) -> float | None:
    """The largest one-sided `q` prediction bound for one more seed in any setting (run length,
    world size) the cells cover: that setting's mean degradation plus ``t(q, n-k) * s *
    sqrt(1 + 1/n_s)``, `s` the within-setting sd pooled over all `k` settings of the `n`
    cells. Settings may differ in mean (lm.v11: four ranks +0.023 nats, two +0.011), which a
    bound over the pooled cells averages away; a sd per setting from ten cells is itself so
    noisy that the largest of several bounds asks far more than 95 % (tried, session 66).
    None with no cell to spare (n - k < 1); inf when a cell is not finite."""
    groups: dict[tuple[Any, Any], list[float]] = {}
    for c in cells:
        groups.setdefault((c["steps"], c["world_size"]), []).append(c["degradation"])
    n, k = len(cells), len(groups)
    if n - k < 1:
        return None
    if not all(math.isfinite(c["degradation"]) for c in cells):
        return math.inf
    means = {key: statistics.fmean(v) for key, v in groups.items()}
    within = sum((d - means[key]) ** 2 for key, v in groups.items() for d in v)
    s = math.sqrt(within / (n - k))
    t = t_quantile(q, n - k)
    return max(means[key] + t * s * math.sqrt(1 + 1 / len(v)) for key, v in groups.items())


def within_tolerance(degr: float, tolerance: float, slack: float = 0.0) -> bool:
    """Whether a degradation is admissible: at most `tolerance + slack`, up to rounding."""
    return degr <= tolerance + slack + TOLERANCE_EPS
