"""Calibration specs: parsing, overrides, and every bad input as one clear InputError."""

from __future__ import annotations

from pathlib import Path

import pytest

from nfabric_cli.calibration.hyperband import HyperbandShape
from nfabric_cli.calibration.spec import Cell, Range, load_spec, parse_spec, resolve_spec
from nfabric_cli.errors import InputError
from tests.calibration.helpers import tiny_spec, tiny_spec_dict, toml_text

REPO = Path(__file__).resolve().parents[2]


def test_tiny_spec_parses_to_exact_values() -> None:
    spec = tiny_spec()
    assert spec.world_size == 2 and spec.steps == 6 and spec.eval_every == 2
    assert spec.checkpoints() == (2, 4, 6)
    assert spec.phases == ("warmup", "main")
    assert spec.boundaries == (Range(0.2, 0.5),)
    assert spec.tau == Range(0.3, 0.7)
    assert spec.error_feedback == (False, True)
    assert [r.cheapest for r in spec.regions] == ["sign", "sign"]
    assert [r.gentlest_lowbit for r in spec.regions] == ["int8", "ternary"]


def test_checkpoints_always_end_at_the_last_step() -> None:
    assert tiny_spec(steps=7, eval_every=3).checkpoints() == (3, 6, 7)
    assert tiny_spec(steps=5, eval_every=5).checkpoints() == (5,)


def test_overrides_apply_and_are_range_checked() -> None:
    spec = tiny_spec().with_overrides(world_size=4, trials=9, tolerance=0.1, seed=None)
    assert (spec.world_size, spec.trials, spec.tolerance, spec.seed) == (4, 9, 0.1, 0)
    with pytest.raises(InputError, match=r"tolerance must be in \(0, 1\], got 0.0"):
        tiny_spec().with_overrides(tolerance=0.0)
    with pytest.raises(InputError, match=r"trials must be in \[1, 10000\], got 0"):
        tiny_spec().with_overrides(trials=0)


def test_search_key_ignores_budget_but_not_the_space() -> None:
    base = tiny_spec()
    assert base.with_overrides(trials=50, sampler="random").search_key() == base.search_key()
    assert base.with_overrides(steps=8).search_key() != base.search_key()
    assert base.with_overrides(tolerance=0.2).search_key() != base.search_key()
    # options added later keep the keys of studies made before them while at their defaults
    assert base.with_overrides(rounding=("nearest",), sign_mode=("majority",)).search_key() == \
        base.search_key()
    assert base.with_overrides(rounding=("nearest", "stochastic")).search_key() != base.search_key()


@pytest.mark.parametrize(
    ("steps", "every", "shape"),
    [(60, 5, (6, 2, 2, 12)), (150, 15, (5, 2, 2, 10)), (6, 2, (1, 2, 2, 3)),
     (10, 2, (2, 2, 2, 5)), (5, 5, (1, 2, 1, 1))],
)
def test_default_hyperband_shape_cuts_first_halfway(steps: int, every: int, shape: tuple) -> None:
    """min_resource = half the checkpoints, reduction factor 2, every bracket that fits."""
    assert tiny_spec(steps=steps, eval_every=every).hyperband_shape() == HyperbandShape(*shape)


def test_hyperband_shape_keys_parse_and_stay_out_of_the_search_key(tmp_path: Path) -> None:
    spec = tiny_spec(hyperband_min_resource=2, hyperband_reduction_factor=2)
    assert (spec.hyperband_min_resource, spec.hyperband_reduction_factor) == (2, 2)
    assert spec.hyperband_shape() == HyperbandShape(2, 2, 1, 3)
    assert tiny_spec(hyperband_brackets=1).hyperband_shape() == HyperbandShape(1, 2, 1, 3)
    long = tiny_spec(steps=60, eval_every=5, hyperband_min_resource=1)  # 12 checkpoints
    assert long.hyperband_shape().max_brackets == 4  # first cuts at 1, 2, 4, 8
    # the shape decides which trials train to the end, never what a trial measures
    assert spec.search_key() == tiny_spec().search_key()
    assert tiny_spec().with_overrides(hyperband_reduction_factor=4, hyperband_brackets=1) \
        .search_key() == tiny_spec().search_key()
    path = tmp_path / "tiny.toml"
    path.write_text(toml_text(tiny_spec_dict(hyperband_min_resource=3)))
    assert load_spec(path, "tiny").hyperband_min_resource == 3
    # checked again after overrides: fewer checkpoints than the spec's min_resource
    with pytest.raises(InputError, match=r"hyperband_min_resource must be in \[1, 1\]"):
        tiny_spec(hyperband_min_resource=2).with_overrides(eval_every=6)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"regions": [{"name": "a", "selector": "*", "routes": ["fp32", "sign2"]}]},
         "unknown route 'sign2'"),
        ({"regions": []}, "needs at least one"),
        ({"regions": [{"name": "a", "selector": "*"}]}, r"regions\[0\] is missing routes"),
        ({"bogus": 1}, "unknown key"),
        ({"routes": {"tau": 0.5, "gamma": 1}}, r"unknown key\(s\) in \[routes\]: gamma"),
        ({"tolerance": 1.5}, r"tolerance must be in \(0, 1\]"),
        ({"tolerance": -0.1}, r"tolerance must be in \(0, 1\]"),
        ({"steps": 0}, r"steps must be in \[1"),
        ({"trials": 0}, r"trials must be in \[1"),
        ({"world_size": 1}, r"world size must be in \[2, 64\]"),
        ({"eval_every": 7}, r"eval_every must be in \[1, steps=6\]"),
        ({"steps": "10"}, "steps must be int"),
        ({"sampler": "cmaes"}, "unknown sampler 'cmaes'"),
        ({"pruner": "sha"}, "unknown pruner 'sha'"),
        ({"phases": {"boundaries": [[0.5, 0.2]]}}, "must not exceed"),
        ({"phases": {"boundaries": [0.5, 0.4]}}, r"boundaries\[1\]"),
        ({"phases": {"boundaries": [1.0]}}, r"boundaries\[0\]"),
        ({"phases": {"boundaries": 0.5}}, r"phases.boundaries must be a list of fractions or "
                                          r"\[lo, hi\] ranges, like \[\[0.05, 0.3\]\], got 0.5"),
        ({"phases": {"boundaries": "0.5"}}, r"phases.boundaries must be a list .*, got '0.5'"),
        ({"seed": -1}, r"seed must be in \[0, 2\*\*63 - 1\], got -1"),
        ({"routes": {"tau": [0.2, 1.0]}}, r"routes.tau must lie in \[0, 1\)"),
        ({"routes": {"error_feedback": "yes"}}, "error_feedback must be"),
        ({"routes": {"rounding": "floor"}}, r"routes.rounding: unknown 'floor' \(choose from"),
        ({"routes": {"sign_mode": ["majority", 3]}}, "routes.sign_mode must be a name or a list"),
        ({"substrate": {"link_gbps": 0}}, "link_gbps must be > 0"),
        ({"health": {"loss_spike": 0.5}}, "health threshold loss_spike"),
        ({"health": {"nope": 1}}, "unknown health threshold"),
        ({"workload": "lm"}, "spec is for workload 'lm', not 'tiny'"),
        ({"hyperband_min_resource": 0},
         r"hyperband_min_resource must be in \[1, 3\] \(checkpoints per trial\), got 0"),
        ({"hyperband_min_resource": 4}, r"hyperband_min_resource must be in \[1, 3\]"),
        ({"hyperband_min_resource": 1.5}, "hyperband_min_resource must be int, got 1.5"),
        ({"hyperband_reduction_factor": 1}, "hyperband_reduction_factor must be an int >= 2, got 1"),
        ({"hyperband_reduction_factor": True}, "hyperband_reduction_factor must be int, got True"),
        ({"hyperband_brackets": 0}, r"hyperband_brackets must be in \[1, 2\] for min_resource 1, "
                                    r"reduction factor 2 and 3 checkpoints, got 0"),
        ({"hyperband_brackets": 2, "hyperband_min_resource": 2}, r"hyperband_brackets must be in \[1, 1\]"),
    ],
)
def test_bad_specs_raise_one_line(change: dict, message: str) -> None:
    with pytest.raises(InputError, match=message) as info:
        parse_spec(tiny_spec_dict(**change), "tiny")
    assert "\n" not in str(info.value)


def test_duplicate_regions_are_refused() -> None:
    regions = [{"name": "a", "selector": "*", "routes": ["fp32"]},
               {"name": "a", "selector": "head.*", "routes": ["fp32"]}]
    with pytest.raises(InputError, match="regions share a name: a"):
        parse_spec(tiny_spec_dict(regions=regions), "tiny")


def test_load_spec_file_and_malformed_toml(tmp_path: Path) -> None:
    good = tmp_path / "tiny.toml"
    good.write_text(toml_text(tiny_spec_dict()))
    assert load_spec(good, "tiny") == tiny_spec()
    bad = tmp_path / "bad.toml"
    bad.write_text("steps = [1,\n")
    with pytest.raises(InputError, match=r"bad.toml: malformed TOML"):
        load_spec(bad, "tiny")
    with pytest.raises(InputError, match="no such file"):
        load_spec(tmp_path / "missing.toml", "tiny")


@pytest.mark.parametrize("name", ["vision", "transformer", "lm"])
def test_committed_specs_parse(name: str) -> None:
    spec = load_spec(REPO / "calibrate" / f"{name}.toml", name)
    assert spec.workload == name
    assert spec.regions[-1].selector == "*"  # a default rule: every parameter is routed


def test_resolve_spec_falls_back_to_head_vs_rest(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    spec = resolve_spec("plugin_wl", "out.*", 50)
    assert [(r.name, r.selector) for r in spec.regions] == [("head", "out.*"), ("rest", "*")]
    assert (spec.steps, spec.eval_every) == (50, 10)
    # confirmed by default: seeds 1, 2 at the search's 4 ranks (seed 0 is the search's own
    # cell) and seeds 0-2 at validate's default 2
    assert spec.world_size == 4
    assert spec.confirm_cells() == [Cell(1, 50), Cell(2, 50),
                                    Cell(0, 50, 2), Cell(1, 50, 2), Cell(2, 50, 2)]


def _toml_blocks(path: Path) -> list[str]:
    text = path.read_text()
    return [b.split("```", 1)[0] for b in text.split("```toml\n")[1:]]


def test_readme_spec_is_the_shipped_vision_spec(tmp_path: Path) -> None:
    """The README's spec example parses, and says exactly what calibrate/vision.toml does."""
    [block] = [b for b in _toml_blocks(REPO / "README.md") if "[[regions]]" in b]
    (tmp_path / "readme.toml").write_text(block)
    assert load_spec(tmp_path / "readme.toml", "vision") == \
        load_spec(REPO / "calibrate" / "vision.toml", "vision")


def test_docs_spec_example_parses(tmp_path: Path) -> None:
    [block] = [b for b in _toml_blocks(REPO / "docs" / "calibration.md") if "[[regions]]" in b]
    (tmp_path / "docs.toml").write_text(block)
    spec = load_spec(tmp_path / "docs.toml", "vision")
    assert [r.name for r in spec.regions] == ["head", "backbone"]
    assert spec.substrate["link_gbps"] == 10.0
