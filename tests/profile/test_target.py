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
    setting_bound,
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



def _cells(**settings: list[float]) -> list[dict[str, float]]:
    """Cells per setting named `s<steps>w<world size>`."""
    out = []
    for name, degrs in settings.items():
        steps, world = name[1:].split("w")
        out += [{"steps": int(steps), "world_size": int(world), "degradation": d} for d in degrs]
    return out


def test_the_setting_bound_takes_each_settings_mean_with_the_pooled_spread() -> None:
    # lm.v11's recorded cells (nats, seeds 0-9, 600 steps): four ranks sit higher than two
    four = [0.03603, 0.03035, 0.03568, -0.00335, 0.00931, 0.01049, 0.04825, 0.02298, 0.00641,
            0.03117]
    two = [0.00277, 0.00736, 0.00413, 0.01448, -0.00967, 0.03540, -0.01902, 0.02058, 0.02424,
           0.02983]
    cells = _cells(s600w4=four, s600w2=two)
    ss = sum((d - statistics.fmean(g)) ** 2 for g in (four, two) for d in g)
    s = math.sqrt(ss / 18)
    expected = statistics.fmean(four) + 1.734064 * s * math.sqrt(1.1)  # t(0.95, 18)
    assert setting_bound(cells) == pytest.approx(expected, rel=1e-5)
    assert setting_bound(cells) == pytest.approx(0.0533, abs=1e-4)
    # pooled, the four-rank mean is averaged away: inside 0.05 where the setting one is not
    assert prediction_bound(four + two) == pytest.approx(0.0478, abs=1e-4)
    # one setting: the pooled bound
    assert setting_bound(_cells(s600w2=two)) == pytest.approx(prediction_bound(two))
    # a lone cell of another setting adds its own mean, with no spread of its own to use
    lone = setting_bound(_cells(s600w2=two, s300w2=[0.04]))
    assert lone == pytest.approx(0.04 + 1.833113 * statistics.stdev(two) * math.sqrt(2),
                                 rel=1e-5)  # t(0.95, 9)
    # no cell to spare for a spread: none; a diverged cell: infinitely bad
    assert setting_bound(_cells(s600w2=[0.01], s600w4=[0.02])) is None
    assert setting_bound(_cells(s600w2=[0.01, math.inf])) == math.inf
