"""The search space: configs round-trip through Optuna params, keys, seeds, profiles."""

from __future__ import annotations

import optuna

from nfabric_cli.calibration.space import (
    Config,
    config_profile,
    derived_configs,
    fp32_config,
    suggest,
    sweep_configs,
    uniform_config,
)
from tests.calibration.helpers import tiny_spec


def test_params_round_trip_through_a_fixed_trial() -> None:
    spec = tiny_spec()
    config = Config((("fp32", "sign"), ("int8", "ternary")), (0.3,), 0.45, True)
    assert suggest(optuna.trial.FixedTrial(config.params(spec)), spec) == config
    assert config.params(spec) == {
        "route.head.warmup": "fp32", "route.rest.warmup": "sign",
        "route.head.main": "int8", "route.rest.main": "ternary",
        "boundary.0": 0.3, "tau": 0.45, "error_feedback": True,
    }


def test_key_drops_options_that_cannot_matter() -> None:
    a = Config((("fp32", "sign"),) * 2, (0.3,), 0.3, False)
    b = Config((("fp32", "sign"),) * 2, (0.3,), 0.7, False)  # tau unused without ternary
    c = Config((("fp32", "ternary"),) * 2, (0.3,), 0.3, False)
    d = Config((("fp32", "ternary"),) * 2, (0.3,), 0.7, False)
    e = Config((("fp32", "bf16"),) * 2, (0.3,), 0.3, True)  # no low-bit route: ef unused
    f = Config((("fp32", "bf16"),) * 2, (0.3,), 0.3, False)
    assert a.key() == b.key() and c.key() != d.key() and e.key() == f.key()


def test_sweep_and_derived_configs() -> None:
    spec = tiny_spec()
    sweep = sweep_configs(spec)
    assert sweep["head"].routes == (("sign", "fp32"), ("sign", "fp32"))
    assert sweep["rest"].routes == (("fp32", "sign"), ("fp32", "sign"))
    assert sweep["head"].boundaries == (0.2,) and sweep["head"].tau == 0.5
    # head out of tolerance (0.05) alone, rest fine -> rest cheap; head fp32, then head int8
    seeds = derived_configs(spec, {"head": 0.2, "rest": 0.01})
    assert [s.routes[0] for s in seeds] == [("fp32", "sign"), ("int8", "sign")]
    assert derived_configs(spec, {"head": 0.2, "rest": 0.3})[0].routes[0] == ("int8", "ternary")
    assert fp32_config(spec).all_fp32()


def test_config_profile_rows_and_options() -> None:
    spec = tiny_spec()
    config = uniform_config(spec, {"head": "int8", "rest": "ternary"})
    config = Config(config.routes, (0.25,), 0.4, True)
    ev = {("rest", "main"): {"traffic_fraction": 0.05, "metric_delta": -0.01, "trials": 3}}
    profile = config_profile(spec, config, {"workload": "vision"}, ev)
    rows = {(r.region, r.phase): r for r in profile.rows}
    assert [(p.name, p.start, p.end) for p in profile.phases()] == [
        ("warmup", 0.0, 0.25), ("main", 0.25, 1.0)]
    assert rows[("*", "main")].tau == 0.4 and rows[("*", "main")].error_feedback is True
    assert rows[("head.*", "main")].tau is None and rows[("head.*", "main")].priority == 0
    assert rows[("*", "main")].traffic_fraction == 0.05 and rows[("*", "main")].trials == 3
    assert rows[("*", "warmup")].traffic_fraction is None


def test_rounding_and_sign_mode_are_searched_where_the_spec_frees_them() -> None:
    spec = tiny_spec(routes={"tau": 0.5, "error_feedback": True,
                             "rounding": ["nearest", "stochastic"], "sign_mode": ["majority", "count"]})
    config = Config((("int8", "sign"),) * 2, (0.3,), 0.5, True, "stochastic", "count")
    params = config.params(spec)
    assert params["rounding"] == "stochastic" and params["sign_mode"] == "count"
    assert suggest(optuna.trial.FixedTrial(params), spec) == config
    rows = {(r.region, r.phase): r for r in config_profile(spec, config).rows}
    assert rows[("head.*", "main")].spec().rounding == "stochastic"
    assert rows[("*", "main")].spec().mode == "count"
    assert rows[("*", "main")].rounding is None and rows[("head.*", "main")].mode is None
    # keys: defaults leave old keys alone; an option only counts where a route uses it
    plain = Config((("int8", "sign"),) * 2, (0.3,), 0.5, True)
    assert "rounding" not in plain.key() and "sign_mode" not in plain.key()
    assert Config((("fp32", "sign"),) * 2, (0.3,), 0.5, True, "stochastic").key() == \
        Config((("fp32", "sign"),) * 2, (0.3,), 0.5, True).key()
    assert Config((("int8", "fp32"),) * 2, (0.3,), 0.5, True, sign_mode="count").key() == \
        Config((("int8", "fp32"),) * 2, (0.3,), 0.5, True).key()
    assert config.key() != Config(config.routes, (0.3,), 0.5, True).key()

