"""A profile's target: how far a metric may fall from its FP32 reference.

One rule for calibration (which trials are admissible) and validation (which runs pass):
degradation is positive when worse, in metric units, and a drop of exactly the tolerance is
within it.
"""

from __future__ import annotations

import math
import statistics

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


def validation_quantile(seeds: int, confidence: float = 0.95) -> float:
    """The one-seed level whose bound covers the worst of `seeds` more: ``confidence ** (1 /
    seeds)`` (98.98 % for five at 95 %; `validation_bound`)."""
    return confidence ** (1 / seeds)


def validation_bound(degradations: list[float], seeds: int,
                     confidence: float = 0.95) -> float | None:
    """The bound the worst of `seeds` more seeds (one `validate --seeds` run of that many)
    stays under with probability `confidence`: the one-sided prediction bound for one more
    seed at ``confidence ** (1 / seeds)``. Conservative: the new seeds share the mean and sd
    estimated here, which correlates them positively, so (Slepian) all of them stay under it
    with at least `confidence`. The 95 % bound for one seed is exceeded by one seed in twenty,
    so a five-seed validation of a profile at that bound fails one time in five (lm.v11: 20
    cells, 95 % bound +0.0478 nats against 0.05; an unseen seed failed at +0.0535; for five
    seeds its bound is +0.0621)."""
    return prediction_bound(degradations, validation_quantile(seeds, confidence))


def within_tolerance(degr: float, tolerance: float, slack: float = 0.0) -> bool:
    """Whether a degradation is admissible: at most `tolerance + slack`, up to rounding."""
    return degr <= tolerance + slack + TOLERANCE_EPS
