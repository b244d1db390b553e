"""The tolerance rule calibration and validation share (`profile.target`)."""

from __future__ import annotations

import math

import pytest

from nfabric_cli.calibration.objective import objective_value
from nfabric_cli.errors import InputError
from nfabric_cli.profile.target import degradation, require_finite_reference, within_tolerance
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

