"""The tolerance rule calibration and validation share (`profile.target`)."""

from __future__ import annotations

import math
import statistics

import pytest

from nfabric_cli.calibration.objective import objective_value
from nfabric_cli.errors import InputError
from nfabric_cli.profile.target import (
    degradation,
    prediction_bound,
    require_finite_reference,
    validation_bound,
    within_tolerance,
)
from nfabric_cli.validation.report import judge


def test_a_drop_of_exactly_the_tolerance_is_within_it_despite_float_rounding() -> None:
    d = degradation(0.85, 0.9, higher_is_better=True)
    assert d > 0.05  # 0.05000000000000004: the rounding the rule must absorb
    assert within_tolerance(d, 0.05)
    assert objective_value(0.1, d, 0.05) == 0.1  # admissible in calibration ...
    arms = {"fp32": {"metric_delta": 0.0}, "profile": {"metric_delta": 0.85 - 0.9}}
    assert judge(arms, True, 0.05)  # ... and it passes validation: one rule
    assert not within_tolerance(0.0501, 0.05)
    assert objective_value(0.1, 0.0501, 0.05) > 1.0


def test_degradation_is_signed_by_direction_and_nan_is_infinitely_bad() -> None:
    assert degradation(1.7, 1.6, higher_is_better=False) == 1.7 - 1.6
    assert degradation(0.9, 0.8, higher_is_better=True) < 0
    assert degradation(math.nan, 0.9, higher_is_better=True) == math.inf


def test_a_diverged_fp32_reference_is_refused_in_one_line() -> None:
    require_finite_reference(0.9, "(seed 0, 300 steps)")  # finite: nothing to say
    for bad in (math.nan, math.inf):
        with pytest.raises(InputError, match=r"the fp32 reference \(seed 1, 600 steps\) ended "
                                             r"with metric .*diverges on plain fp32 DDP"):
            require_finite_reference(bad, "(seed 1, 600 steps)")


def test_the_validation_bound_covers_the_worst_of_several_new_seeds() -> None:
    # lm.v11's recorded cells (nats; seeds 0-9, 600 steps, four ranks then two)
    cells = [0.03603, 0.03035, 0.03568, -0.00335, 0.00931, 0.01049, 0.04825, 0.02298, 0.00641,
             0.03117, 0.00277, 0.00736, 0.00413, 0.01448, -0.00967, 0.03540, -0.01902, 0.02058,
             0.02424, 0.02983]
    mean, sd = statistics.fmean(cells), statistics.stdev(cells)
    # five seeds: one more seed's bound at 0.95 ** (1 / 5) = 98.98 %, t(0.98979, 19) = 2.5298
    five = mean + 2.529842 * sd * math.sqrt(1 + 1 / 20)
    assert validation_bound(cells, 5) == pytest.approx(five, rel=1e-5)
    # the 95 % bound for one seed is inside lm's tolerance (0.05); five seeds' is not: an
    # unseen five-seed validation of it failed (+0.0535 on seed 10)
    assert prediction_bound(cells) == pytest.approx(0.0478, abs=1e-4)
    assert validation_bound(cells, 5) == pytest.approx(0.0621, abs=1e-4)
    assert validation_bound(cells, 1) == prediction_bound(cells)
    assert validation_bound(cells, 10) > validation_bound(cells, 5)
    assert validation_bound([0.01], 5) is None
    assert validation_bound([0.01, math.inf], 5) == math.inf
