"""Confirmation: the leading candidates retrained on other seeds and lengths (`choice.py`,
`confirm.py`), the winner the cheapest that holds on every cell, and the profile's record of
where it was proven."""

from __future__ import annotations

import json
import math
import statistics

import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.trial import create_trial
from typer.testing import CliRunner

from nfabric_cli.app import app
from nfabric_cli.binding.compile import compile_profile
from nfabric_cli.calibration import calibrate
from nfabric_cli.calibration.choice import (
    candidates,
    cell_job,
    config_of,
    pending,
    reference_job,
    robust_winner,
    verdicts,
)
from nfabric_cli.calibration.confirm import failed_first
from nfabric_cli.calibration.outcome import rule_text
from nfabric_cli.calibration.plot import failed_confirmation
from nfabric_cli.calibration.publish import profile_key
from nfabric_cli.calibration.repair import enqueue_repairs, raised
from nfabric_cli.calibration.simulate import simulate_run
from nfabric_cli.calibration.space import Config, config_profile
from nfabric_cli.calibration.status import study_status
from nfabric_cli.calibration.workers import budgeted
from nfabric_cli.errors import InputError
from nfabric_cli.profile import read_profile
from nfabric_cli.profile.proven import outside_proven, proven_range
from nfabric_cli.profile.target import validation_bound
from nfabric_cli.workloads.registry import get_workload
from tests.calibration.helpers import TINY, Notes, tiny_spec, tiny_spec_dict, toml_text

optuna.logging.set_verbosity(optuna.logging.WARNING)


def test_the_grid_is_seeds_times_lengths_less_the_searchs_own_cell() -> None:
    spec = tiny_spec(steps=40, eval_every=10, confirm={"seeds": [1, 2], "steps": [80, 40]})
    assert spec.confirm_cells() == [(0, 80, None), (1, 40, None), (1, 80, None), (2, 40, None),
                                    (2, 80, None)]
    assert tiny_spec().confirm_cells() == []  # no [confirm]: the search's winner, as before
    # other world sizes: the whole grid again at each, the search's own cell included (the
    # search's world size, 2, listed again adds nothing)
    spec = tiny_spec(steps=40, eval_every=10, confirm={"seeds": [1], "world_sizes": [4, 2, 3]})
    assert spec.confirm_cells() == [(1, 40, None), (0, 40, 4), (1, 40, 4), (0, 40, 3),
                                    (1, 40, 3)]
    assert tiny_spec(confirm={"world_sizes": [4]}).confirm_cells() == [(0, 6, 4)]
    # a cell at the search's world size keeps the job name studies stored before world sizes
    assert reference_job((1, 40, None)) == reference_job((1, 40)) == "reference/s1/n40"
    assert cell_job("k", (1, 40, 4)) == cell_job("k", (1, 40)) + "/w4"
    assert tiny_spec(confirm={"world_sizes": [4]}).search_key() == tiny_spec().search_key()
    with pytest.raises(InputError, match=r"confirm.world_sizes must each be in \[2, 64\], got \[1\]"):
        tiny_spec(confirm={"world_sizes": [1]})
    with pytest.raises(InputError, match=r"confirm.seeds must be in \[0, 2\*\*63 - 1\], got -1"):
        tiny_spec(confirm={"seeds": [-1]})
    with pytest.raises(InputError, match=r"unknown key\(s\) in \[confirm\]: seed"):
        tiny_spec(confirm={"seed": [1]})
    with pytest.raises(InputError, match="confirm: 89 cells"):
        tiny_spec(confirm={"seeds": list(range(1, 10)), "steps": list(range(10, 90, 10))})
    # confirmation is not part of the search key: a study is confirmed later without retraining
    assert tiny_spec(confirm={"seeds": [1]}).search_key() == tiny_spec().search_key()


def test_a_multi_objective_study_has_no_confirmation_cells_and_one_profile_key() -> None:
    """nsga2 is not confirmed, decided once in the spec: its grid, as written, is kept (and
    still refused when too large) but trains nothing, and does not name its profile."""
    grid = {"seeds": [1, 2]}
    tpe, nsga2 = tiny_spec(confirm=grid), tiny_spec(sampler="nsga2", confirm=grid)
    assert nsga2.grid_cells() == tpe.grid_cells() == tpe.confirm_cells() == [(1, 6, None),
                                                                              (2, 6, None)]
    assert nsga2.confirm_cells() == []
    assert (nsga2.confirm_ignored(), tpe.confirm_ignored()) == (True, False)
    assert not tiny_spec(sampler="nsga2").confirm_ignored()  # no grid written: nothing to say
    assert profile_key(5, nsga2) == profile_key(5, tiny_spec(sampler="nsga2")) == "profile@5"
    assert profile_key(5, tpe).startswith("profile@5+confirm-")
    # a study with a warm start's trial is keyed apart: since that trial is always a candidate,
    # a study published before may name another winner, and must not report the old profile
    assert profile_key(5, tpe, warm=True) != profile_key(5, tpe)
    # the validate rule's seeds name the profile (another count may hold another winner); the
    # other rules ignore them, and keep the names they had before the key existed
    keys = {profile_key(5, tiny_spec(confirm={**grid, "rule": rule, "validate_seeds": m}))
            for rule in ("worst", "validate") for m in (5, 10)}
    assert len(keys) == 3 and profile_key(5, tiny_spec(confirm={
        **grid, "validate_seeds": 10})) == profile_key(5, tpe)
    with pytest.raises(InputError, match="confirm: 89 cells"):
        tiny_spec(sampler="nsga2", confirm={"seeds": list(range(1, 10)),
                                             "steps": list(range(10, 90, 10))})


def _study(spec, rows: dict[str, dict]) -> optuna.Study:  # noqa: ANN001
    """A study with one completed trial per (key -> traffic, degradation) and stored cells
    (traffic 0.1 on each, or the row's `cell_traffic`)."""
    study = optuna.create_study()
    dist = {"x": FloatDistribution(0, 1)}
    for i, (key, r) in enumerate(rows.items()):
        study.add_trial(create_trial(params={"x": i / 10}, distributions=dist, value=r["traffic"],
                                     user_attrs={"key": key, "traffic_fraction": r["traffic"],
                                                 "degradation": r["degr"],
                                                 "metric": 0.9 - r["degr"]}))
    for cell in spec.confirm_cells():
        study.set_user_attr(reference_job(cell), {"metric": 0.9})
    for key, r in rows.items():
        for cell, metric in r.get("cells", {}).items():
            study.set_user_attr(cell_job(key, cell), {"metric": metric,
                                                      "traffic_fraction": r.get("cell_traffic", 0.1)})
    return study


def test_the_winner_is_the_cheapest_candidate_that_holds_on_every_cell() -> None:
    spec = tiny_spec(steps=40, eval_every=10, tolerance=0.05,
                     confirm={"seeds": [1], "candidates": 3})
    ref = {"metric": 0.9}
    study = _study(spec, {
        "cheap": {"traffic": 0.05, "degr": 0.01, "cells": {(1, 40): 0.84}},  # 0.06 on seed 1
        "twin": {"traffic": 0.05, "degr": 0.02},  # as cheap, more degradation: second
        "mid": {"traffic": 0.2, "degr": 0.04, "cells": {(1, 40): 0.85}},  # exactly 0.05: holds
        "dear": {"traffic": 0.5, "degr": 0.0},
        "bad": {"traffic": 0.01, "degr": 0.3},  # out of tolerance on its own seed
    })
    assert [t.user_attrs["key"] for t in candidates(study, spec)] == ["cheap", "twin", "mid"]
    # "twin" was never confirmed: it is pending, and nothing after it may win yet
    assert robust_winner(study, spec, True, ref) is None
    assert pending(study, spec, True, ref)
    study.set_user_attr(cell_job("twin", (1, 40)), {"metric": 0.7, "traffic_fraction": 0.1})
    winner = robust_winner(study, spec, True, ref)
    assert winner is not None and winner.user_attrs["key"] == "mid"
    assert not pending(study, spec, True, ref)
    v = verdicts(study, spec, True, ref)
    assert [x["status"] for x in v] == ["fails", "fails", "holds"]
    assert v[0]["worst_degradation"] == pytest.approx(0.06)
    # nothing holds: no winner (the profile is all fp32)
    study.set_user_attr(cell_job("mid", (1, 40)), {"metric": 0.8, "traffic_fraction": 0.1})
    assert robust_winner(study, spec, True, ref) is None
    assert not pending(study, spec, True, ref)


def test_the_search_plot_draws_each_failed_candidate_down_to_its_worst_cell() -> None:
    """A trial inside tolerance on the search's cell that failed elsewhere reads as admissible
    in the plot unless its worst cell is drawn too: the failed candidates, in order, with
    their search-cell and worst-cell degradation; one that holds is not among them."""
    spec = tiny_spec(steps=40, eval_every=10, tolerance=0.05,
                     confirm={"seeds": [1], "candidates": 3})
    ref = {"metric": 0.9}
    study = _study(spec, {
        "cheap": {"traffic": 0.05, "degr": 0.01, "cells": {(1, 40): 0.84}},
        "twin": {"traffic": 0.06, "degr": 0.02, "cells": {(1, 40): 0.7}},
        "mid": {"traffic": 0.2, "degr": 0.04, "cells": {(1, 40): 0.86}},
    })
    drawn = failed_confirmation(verdicts(study, spec, True, ref))
    assert [c for point in drawn for c in point] == pytest.approx([0.05, 0.01, 0.06, 0.06, 0.02, 0.2])


def test_of_the_candidates_that_hold_the_least_traffic_over_their_cells_wins() -> None:
    """A candidate whose monitor falls back on other seeds or world sizes sends those fp32
    steps too: the breast-cancer example's cheapest holder (6.8 % in the search) sent 49 % at
    two ranks. The next candidates are confirmed while their search traffic is below the
    holder's mean over its cells; one at or above it is never trained (nor waited for)."""
    spec = tiny_spec(steps=40, eval_every=10, tolerance=0.05,
                     confirm={"seeds": [1, 2], "candidates": 4})
    ref = {"metric": 0.9}
    cells = {(1, 40): 0.88, (2, 40): 0.88}
    study = _study(spec, {
        "trips": {"traffic": 0.05, "degr": 0.0, "cells": cells, "cell_traffic": 0.5},
        "steady": {"traffic": 0.1, "degr": 0.0, "cells": cells, "cell_traffic": 0.12},
        "costly": {"traffic": 0.3, "degr": 0.0, "cells": cells, "cell_traffic": 0.05},
        "beyond": {"traffic": 0.4, "degr": 0.0},  # beaten by steady's 0.113: never trained
    })
    v = verdicts(study, spec, True, ref)
    assert [x["traffic_mean"] for x in v[:3]] == pytest.approx([0.35, 0.34 / 3, 0.4 / 3])
    assert [x["status"] for x in v] == ["holds", "holds", "holds", "pending"]
    winner = robust_winner(study, spec, True, ref)
    assert winner is not None and winner.user_attrs["key"] == "steady"
    assert not pending(study, spec, True, ref)
    # before "steady" is confirmed the choice is open: it could beat "trips"
    for cell in spec.confirm_cells():
        study.set_user_attr(cell_job("steady", cell), None)
    assert robust_winner(study, spec, True, ref) is None and pending(study, spec, True, ref)


def test_a_boundary_between_phases_that_route_alike_does_not_make_another_candidate() -> None:
    spec = tiny_spec(steps=40, eval_every=10, tolerance=0.05,
                     confirm={"seeds": [1], "candidates": 3})

    def key(boundary: float, warmup: str = "sign") -> str:
        return json.dumps({"boundaries": [boundary], "ef": False, "tau": None,
                           "routes": [[warmup, "int8"], ["sign", "int8"]]}, sort_keys=True)

    study = _study(spec, {
        key(0.05): {"traffic": 0.05, "degr": 0.01},
        key(0.16): {"traffic": 0.05, "degr": 0.01},  # the same training: not a candidate
        key(0.2): {"traffic": 0.05, "degr": 0.02},  # routes alike, another result: one
        key(0.05, "int8"): {"traffic": 0.06, "degr": 0.01},
        key(0.16, "int8"): {"traffic": 0.06, "degr": 0.01},  # phases differ: the boundary counts
    })
    assert [t.user_attrs["key"] for t in candidates(study, spec)] == [
        key(0.05), key(0.2), key(0.05, "int8")]


def test_calibrate_confirms_on_real_runs_and_records_where_the_profile_was_proven(
        tmp_path) -> None:  # noqa: ANN001
    wl = get_workload(TINY)
    url = f"sqlite:///{tmp_path}/s.db"
    # the search alone first: its winner is the cheapest admissible trial
    plain = tiny_spec(trials=8, steps=40, eval_every=10, tolerance=0.05)
    _, first = calibrate(wl, plain, url, "s", tmp_path / "out", processes=1)
    assert first.path.name == "tiny.v1.parquet" and "confirmation" not in first.best
    # the finished study confirmed later: no trial trains again, and a new profile is written
    spec = tiny_spec(trials=8, steps=40, eval_every=10, tolerance=0.05,
                     confirm={"seeds": [1], "steps": [80]})
    run, out = calibrate(wl, spec, url, "s", tmp_path / "out", processes=1)
    assert out.new_trials == 0 and out.path.name == "tiny.v2.parquet"
    conf = out.best["confirmation"]
    assert conf["candidates"][0]["trial"] == first.best["trial"]
    statuses = [v["status"] for v in conf["candidates"]]
    # on this study the two cheapest admissible trials fail a cell; the third holds on all
    assert statuses == ["fails", "fails", "holds"], conf
    held = conf["candidates"][2]
    assert out.best["trial"] == held["trial"]
    assert out.best["traffic_fraction"] > conf["candidates"][0]["traffic_fraction"]
    # every cell of the winner is a real run: one cell retrained alone gives the same metric
    winner = next(t for t in run.study.trials if t.number == held["trial"])
    seed, steps = 1, 80
    bindings = compile_profile(config_profile(spec, config_of(winner, spec),
                                              {"world_size": 2, "health": spec.health}),
                               wl.build_model(0), world_size=2, bucket_cap_mb=None,
                               total_steps=steps)
    alone = simulate_run(wl, bindings, 2, steps, seed, (steps,), processes=1)
    cell = next(c for c in held["cells"] if (c["seed"], c["steps"]) == (seed, steps))
    assert cell["metric"] == alone.metric
    # the profile says where it was proven, and what confirmation cost
    profile = read_profile(out.path)
    # ... and the published profile is what was proven: compiled as a user compiles it, it
    # trains the cell to the same metric
    published = compile_profile(profile, wl.build_model(seed), world_size=2, total_steps=steps)
    again = simulate_run(wl, published, 2, steps, seed, (steps,), processes=1)
    assert again.metric == cell["metric"]
    proven = profile.meta["proven"]
    assert proven["seeds"] == [0, 1] and proven["steps"] == [40, 80]
    assert proven["world_size"] == 2 and len(proven["cells"]) == 4
    assert proven["worst_degradation"] == held["worst_degradation"] <= 0.05 + 1e-12
    cost = profile.meta["provenance"]["confirmation"]
    # a reference per cell; the candidates train 2, 1 (the cell the first failed on, first,
    # where it fails too) and 3
    assert cost["runs"] == 3 + 2 + 1 + 3
    assert out.steps_spent > sum(t.user_attrs.get("steps_run", 0) for t in run.study.trials)
    assert outside_proven(profile.meta, seeds=[0, 1], steps=60, world_size=2) == []
    [line] = outside_proven(profile.meta, seeds=[1, 5], steps=200, world_size=4)
    assert "seeds 0, 1 at 40, 80 steps, world size 2" in line
    assert "outside that range here: seed 5, 200 steps, world size 4 (a result" in line
    assert study_status(url, "s")["confirmation"] == cost  # --status counts the cells
    # a rerun of the finished study trains nothing and confirms nothing again
    run2, out2 = calibrate(wl, spec, url, "s", tmp_path / "out", processes=1)
    assert out2.best["trial"] == out.best["trial"] and out2.path == out.path
    assert out2.best["confirmation"]["cost"] == conf["cost"]


def test_calibrate_confirms_at_other_world_sizes_and_records_them(tmp_path) -> None:  # noqa: ANN001
    """`confirm.world_sizes`: the winner is retrained at each other world size (a real run
    there), and the profile is proven, and checked, at each."""
    wl = get_workload(TINY)
    spec = tiny_spec(trials=4, steps=40, eval_every=10, tolerance=0.05,
                     confirm={"seeds": [1], "world_sizes": [3]})
    run, out = calibrate(wl, spec, f"sqlite:///{tmp_path}/s.db", "s", tmp_path / "out",
                         processes=1)
    conf = out.best["confirmation"]
    assert conf["cells"] == [[1, 40, 2], [0, 40, 3], [1, 40, 3]]
    held = next(v for v in conf["candidates"] if v["trial"] == out.best["trial"])
    assert held["status"] == "holds"
    assert [(c["seed"], c["world_size"]) for c in held["cells"]] == [(0, 2), (1, 2), (0, 3),
                                                                       (1, 3)]
    # the three-rank cell is a three-rank run of the published profile
    profile = read_profile(out.path)
    cell = held["cells"][3]
    published = compile_profile(profile, wl.build_model(1), world_size=3, total_steps=40)
    assert simulate_run(wl, published, 3, 40, 1, (40,), processes=1).metric == cell["metric"]
    two = compile_profile(profile, wl.build_model(1), world_size=2, total_steps=40)
    assert simulate_run(wl, two, 2, 40, 1, (40,), processes=1).metric == held["cells"][1]["metric"]
    proven = profile.meta["proven"]
    assert proven["world_size"] == 2 and proven["world_sizes"] == [2, 3]
    assert proven["rule"] == "every cell within tolerance of its own fp32 reference"
    # recorded whatever the rule: the bound the worst of five more seeds stays under
    assert proven["validate_seeds"] == 5 and proven["validate_bound95"] == validation_bound(
        [c["degradation"] for c in held["cells"]], 5)
    assert outside_proven(profile.meta, seeds=[0, 1], steps=40, world_size=3) == []
    [line] = outside_proven(profile.meta, seeds=[1], steps=40, world_size=4)
    assert "seeds 0, 1 at 40 steps, world sizes 2, 3; outside that range here: world size 4" in line


def test_profiles_from_before_confirmation_were_proven_on_their_one_seed_and_length() -> None:
    meta = {"world_size": 4, "provenance": {"source": "calibrate", "seed": 0,
                                            "budget": {"steps": 150}}}
    rng = proven_range(meta)
    assert rng is not None and (rng.seeds, rng.steps, rng.recorded) == ((0,), (150,), False)
    [line] = outside_proven(meta, seeds=[0, 1, 2], steps=600, world_size=4)
    assert "seed 0 at 150 steps, world size 4 (calibrated before confirmation" in line
    assert "outside that range here: seeds 1, 2, 600 steps (" in line
    assert outside_proven(meta, seeds=[0], steps=150, world_size=4) == []
    # hand-written profiles record no range: nothing to compare
    assert outside_proven({"provenance": {"source": "profile init"}}, seeds=[3], steps=9) == []
    # nor does a calibrated one that is all fp32 because no candidate held (the reference)
    assert proven_range({**meta, "proven": {"fp32": True}}) is None
    assert outside_proven({**meta, "proven": {"fp32": True}}, seeds=[3], steps=600) == []


def test_the_bound_rule_asks_for_margin_the_worst_rule_does_not() -> None:
    ref = {"metric": 0.9}
    rows = {
        # cells 0.01, 0.04, 0.045: every cell within 0.05, but spread out
        "thin": {"traffic": 0.05, "degr": 0.01, "cells": {(1, 40): 0.86, (2, 40): 0.855}},
        # cells 0.0, 0.005, 0.0: tight
        "wide": {"traffic": 0.2, "degr": 0.0, "cells": {(1, 40): 0.895, (2, 40): 0.9}},
    }
    worst = tiny_spec(steps=40, eval_every=10, tolerance=0.05, confirm={"seeds": [1, 2]})
    bound = tiny_spec(steps=40, eval_every=10, tolerance=0.05,
                      confirm={"seeds": [1, 2], "rule": "bound"})
    study = _study(worst, rows)
    assert robust_winner(study, worst, True, ref).user_attrs["key"] == "thin"
    v = verdicts(study, bound, True, ref)
    # 3 cells: mean + t(0.95, 2) * sd * sqrt(4/3)
    thin = [0.01, 0.9 - 0.86, 0.9 - 0.855]
    expected = statistics.fmean(thin) + 2.919986 * statistics.stdev(thin) * math.sqrt(4 / 3)
    assert v[0]["bound95"] == pytest.approx(expected, rel=1e-5) and v[0]["bound95"] > 0.05
    assert [x["status"] for x in v] == ["fails", "holds"]
    assert robust_winner(study, bound, True, ref).user_attrs["key"] == "wide"


def test_the_validate_rule_asks_the_margin_a_validation_of_several_seeds_needs() -> None:
    """Every cell within tolerance and the 95 % bound for one more seed too, but spread out:
    the worst of five more seeds (one validation on five unseen seeds) would likely miss. The
    `validate` rule takes the dearer candidate the other two pass; like `worst`, it stops a
    candidate at its first cell outside tolerance."""
    ref = {"metric": 0.9}
    edge_degrs = [0.02, 0.01, 0.03, 0.02, 0.0, 0.025]  # seed 0 (the search's), then 1-5
    rows = {"edge": {"traffic": 0.05, "degr": edge_degrs[0],
                     "cells": {(seed, 40): 0.9 - d for seed, d in enumerate(edge_degrs) if seed}},
            "tight": {"traffic": 0.2, "degr": 0.0,
                      "cells": {(seed, 40): 0.9 for seed in range(1, 6)}}}
    specs = {rule: tiny_spec(steps=40, eval_every=10, tolerance=0.05,
                             confirm={"seeds": [1, 2, 3, 4, 5], "rule": rule})
             for rule in ("worst", "bound", "validate")}
    study = _study(specs["worst"], rows)
    edge = verdicts(study, specs["validate"], True, ref)[0]
    assert edge["worst_degradation"] == pytest.approx(0.03)
    mean, sd = statistics.fmean(edge_degrs), statistics.stdev(edge_degrs)
    assert edge["bound95"] == pytest.approx(mean + 2.015048 * sd * math.sqrt(7 / 6), rel=1e-5)
    # t(0.95 ** (1 / 5), 5) = 3.346248
    assert edge["validate_bound95"] == pytest.approx(
        mean + 3.346248 * sd * math.sqrt(7 / 6), rel=1e-5)
    assert edge["bound95"] < 0.05 < edge["validate_bound95"]
    won = {rule: robust_winner(study, spec, True, ref).user_attrs["key"]
           for rule, spec in specs.items()}
    assert won == {"worst": "edge", "bound": "edge", "validate": "tight"}
    # fewer seeds asked: less margin
    one = tiny_spec(steps=40, eval_every=10, tolerance=0.05,
                    confirm={"seeds": [1, 2, 3, 4, 5], "rule": "validate", "validate_seeds": 1})
    assert verdicts(study, one, True, ref)[0]["validate_bound95"] == edge["bound95"]
    out = _study(specs["validate"], {"edge": {"traffic": 0.05, "degr": 0.0,
                                              "cells": {(4, 40): 0.8}}})
    assert verdicts(out, specs["validate"], True, ref)[0]["status"] == "fails"
    assert failed_first(out, specs["validate"], True)[0] == (4, 40, None)
    assert rule_text(specs["validate"]) == (
        "every cell within tolerance of its own fp32 reference, and the worst of 5 more seeds "
        "within it at 95 % (the prediction bound for one more seed at 98.98%)")
    assert rule_text(None) == rule_text(specs["worst"])
    with pytest.raises(InputError, match="confirm.rule: one of worst, bound, validate"):
        tiny_spec(confirm={"rule": "median"})
    with pytest.raises(InputError, match=r"confirm.validate_seeds must be in \[1, 100\], got 0"):
        tiny_spec(confirm={"validate_seeds": 0})


def test_a_study_resumed_by_other_code_names_the_results_it_did_not_train(
        tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """Every stored result carries the fingerprint of the code that trained it; resumed by
    other code (here: another package tree), the study says which results that code did not
    train, and the profile's provenance counts them. A fresh study counts none."""
    from nfabric_cli.calibration import codeprint

    wl, url = get_workload(TINY), f"sqlite:///{tmp_path}/s.db"
    spec = tiny_spec(trials=4, steps=20, eval_every=10, tolerance=0.05,
                     confirm={"seeds": [1], "steps": [20]})
    sink = Notes()
    run, out = calibrate(wl, spec, url, "s", tmp_path / "out", sink=sink, processes=1)
    here = codeprint.code_fingerprint()
    assert len(here) == 16 and codeprint.foreign_results(run.study) == []
    prov = read_profile(out.path).meta["provenance"]
    assert prov["code_fingerprint"] == here and prov["foreign_results"] == 0
    assert not [n for n in sink.notes if "other nfabric code" in n]
    stored = [k for k in run.study.user_attrs if k.startswith(("reference", "confirm/"))]
    assert "reference" in stored and any(k.startswith("confirm/") for k in stored)

    other = tmp_path / "other"
    other.mkdir()
    (other / "x.py").write_text("x = 1\n")
    monkeypatch.setattr(codeprint, "_PACKAGE", other)
    codeprint.code_fingerprint.cache_clear()
    try:
        assert codeprint.code_fingerprint() != here
        sink = Notes()
        spec2 = tiny_spec(trials=5, steps=20, eval_every=10, tolerance=0.05,
                          confirm={"seeds": [1], "steps": [20]})
        run2, out2 = calibrate(wl, spec2, url, "s", tmp_path / "out", sink=sink, processes=1)
        foreign = codeprint.foreign_results(run2.study)
        done = [t for t in run2.study.trials if "metric" in t.user_attrs
                and t.state == optuna.trial.TrialState.COMPLETE]
        # the four trials and every stored run of the first pass; not the fifth trial
        assert len(foreign) == len(stored) + len(done) - 1, foreign
        [note] = [n for n in sink.notes if "other nfabric code" in n]
        assert note.startswith(f"study s: {len(foreign)} stored result(s) (") \
            and "a new --study retrains everything" in note
        assert read_profile(out2.path).meta["provenance"]["foreign_results"] == len(foreign)
    finally:
        codeprint.code_fingerprint.cache_clear()


def test_a_candidate_fails_on_any_cell_outside_tolerance_and_later_ones_train_there_first(
        ) -> None:
    """Confirmation trains the cells more candidates failed on first (`failed_first`), so a
    candidate's stored cells need not be a prefix of the grid: any stored cell outside
    tolerance fails it, a missing one before it no longer leaves it pending."""
    spec = tiny_spec(steps=40, eval_every=10, tolerance=0.05,
                     confirm={"seeds": [1, 2, 3], "candidates": 3})
    ref = {"metric": 0.9}
    study = _study(spec, {
        "a": {"traffic": 0.05, "degr": 0.0, "cells": {(1, 40): 0.88, (3, 40): 0.8}},
        "b": {"traffic": 0.06, "degr": 0.0, "cells": {(3, 40): 0.7}},  # seeds 1, 2 untrained
        "c": {"traffic": 0.07, "degr": 0.0},
    })
    assert [v["status"] for v in verdicts(study, spec, True, ref)] == ["fails", "fails", "pending"]
    assert [c["seed"] for c in verdicts(study, spec, True, ref)[1]["cells"]] == [0, 3]
    assert failed_first(study, spec, True) == [(3, 40, None), (1, 40, None), (2, 40, None)]
    # the bound rule trains every cell anyway: the grid's order
    bound = tiny_spec(steps=40, eval_every=10, tolerance=0.05,
                      confirm={"seeds": [1, 2, 3], "rule": "bound"})
    assert failed_first(study, bound, True) == bound.confirm_cells()


def test_repairs_join_the_candidates_without_taking_a_searched_candidates_place() -> None:
    spec = tiny_spec(steps=40, eval_every=10, tolerance=0.05,
                     confirm={"seeds": [1], "candidates": 2})
    rows = {"a": {"traffic": 0.05, "degr": 0.0}, "b": {"traffic": 0.07, "degr": 0.0},
            "c": {"traffic": 0.08, "degr": 0.0}}
    study = _study(spec, rows)
    assert [t.user_attrs["key"] for t in candidates(study, spec)] == ["a", "b"]
    dist = {"x": FloatDistribution(0, 1)}
    for key, traffic, number in (("r1", 0.06, 1), ("r2", 0.09, 2)):
        study.add_trial(create_trial(
            params={"x": 0.9}, distributions=dist, value=traffic,
            user_attrs={"key": key, "traffic_fraction": traffic, "degradation": 0.0,
                        "metric": 0.9, "kind": "repair", "repair_round": number,
                        "repair_of": 0, "region": "head"}))
    # r1 (round 1) sits between a and b by traffic; b keeps its place; r2 is round 2
    assert [t.user_attrs["key"] for t in candidates(study, spec)] == ["a", "r1", "b"]
    two = tiny_spec(steps=40, eval_every=10, tolerance=0.05,
                    confirm={"seeds": [1], "candidates": 2, "repairs": 2})
    assert [t.user_attrs["key"] for t in candidates(study, two)] == ["a", "r1", "b", "r2"]
    off = tiny_spec(steps=40, eval_every=10, tolerance=0.05,
                    confirm={"seeds": [1], "candidates": 2, "repairs": 0})
    assert [t.user_attrs["key"] for t in candidates(study, off)] == ["a", "b"]

    # repairs use no budget: three trials of it, whatever the repairs
    assert budgeted(study.trials) == 3
    # a repair that reused a searched trial's result (same configuration): that trial is the
    # repair's candidate, and takes no searched candidate's place; with repairs off, a
    # searched trial that reused a repair's result is a searched candidate as any other
    one = tiny_spec(steps=40, eval_every=10, tolerance=0.05,
                    confirm={"seeds": [1], "candidates": 1})
    twin = _study(one, rows)
    twin.add_trial(create_trial(
        params={"x": 0.9}, distributions=dist, value=0.07,
        user_attrs={"key": "b", "traffic_fraction": 0.07, "degradation": 0.0, "metric": 0.9,
                    "kind": "repair", "repair_round": 1, "repair_of": 0, "region": "head"}))
    assert [t.number for t in candidates(twin, one)] == [0, 1]  # a, then b (searched)
    off1 = tiny_spec(steps=40, eval_every=10, tolerance=0.05,
                     confirm={"seeds": [1], "candidates": 1, "repairs": 0})
    assert [t.number for t in candidates(twin, off1)] == [0]
    first = optuna.create_study()
    for key, kind in (("r", "repair"), ("r", "search")):
        first.add_trial(create_trial(
            params={"x": 0.5}, distributions=dist, value=0.05,
            user_attrs={"key": key, "traffic_fraction": 0.05, "degradation": 0.0,
                        "metric": 0.9, "kind": kind, "repair_round": 1}))
    assert [t.number for t in candidates(first, off1)] == [1]

def test_the_warm_starts_trial_is_a_candidate_wherever_it_ranks() -> None:
    """glyphs' recalibration from v6: three cheaper trials took the three places, so v6's own
    routes would not have been confirmed, and had the three failed (v6's cheaper rivals did,
    at two ranks) the profile would have been all fp32 though the last winner still held."""
    spec = tiny_spec(steps=40, eval_every=10, tolerance=0.05,
                     confirm={"seeds": [1], "candidates": 2, "repairs": 0})
    rows = {"a": {"traffic": 0.05, "degr": 0.0}, "b": {"traffic": 0.07, "degr": 0.0},
            "w": {"traffic": 0.11, "degr": 0.0}, "c": {"traffic": 0.12, "degr": 0.0}}
    study = _study(spec, rows)
    assert [t.user_attrs["key"] for t in candidates(study, spec)] == ["a", "b"]
    dist = {"x": FloatDistribution(0, 1)}
    study.add_trial(create_trial(
        params={"x": 0.8}, distributions=dist, value=0.11,
        user_attrs={"key": "warm", "traffic_fraction": 0.11, "degradation": 0.0, "metric": 0.9,
                    "kind": "warm"}))
    assert [t.user_attrs["key"] for t in candidates(study, spec)] == ["a", "b", "warm"]
    far = {**{k: {**v, "degr": 0.3} for k, v in rows.items()}}  # the warm trial out of tolerance
    late = _study(spec, far)
    late.add_trial(create_trial(
        params={"x": 0.8}, distributions=dist, value=0.11,
        user_attrs={"key": "warm", "traffic_fraction": 0.11, "degradation": 0.3, "metric": 0.6,
                    "kind": "warm"}))
    assert candidates(late, spec) == []



def test_raised_puts_each_low_bit_region_on_fp32_in_every_phase() -> None:
    spec = tiny_spec(steps=40, eval_every=10)
    both = Config((("sign", "ternary"), ("sign", "sign")), (0.3,), 0.4, False)
    assert raised(both, spec) == {
        "head": Config((("fp32", "ternary"), ("fp32", "sign")), (0.3,), 0.4, False),
        "rest": Config((("sign", "fp32"), ("sign", "fp32")), (0.3,), 0.4, False)}
    # rest is on fp32 already, and the head on fp32 too would be the reference: nothing
    config = Config((("sign", "fp32"), ("int8", "fp32")), (0.3,), 0.5, True)
    assert raised(config, spec) == {}
    # a region that may not take fp32 is not raised
    regions = [{"name": "head", "selector": "head.*", "routes": ["fp32", "int8", "sign"]},
               {"name": "rest", "selector": "*", "routes": ["ternary", "sign"]}]
    assert list(raised(both, tiny_spec(regions=regions))) == ["head"]
    with pytest.raises(InputError, match=r"confirm.repairs must be in \[0, 8\], got 9"):
        tiny_spec(confirm={"repairs": 9})
    assert tiny_spec().confirm_repairs == 1


def test_when_no_candidate_holds_a_repair_puts_a_region_of_the_cheapest_on_fp32(
        tmp_path) -> None:  # noqa: ANN001
    """The tiny study's only candidate (all low-bit) fails seed 1; without repairs the profile
    is all fp32. Repair round 1 retrains it with each region on fp32 in turn (outside the
    trial budget, never pruned): with the head on fp32 it holds on every cell and wins."""
    wl = get_workload(TINY)
    grid = {"seeds": [1], "candidates": 1}
    off = tiny_spec(trials=8, steps=40, eval_every=10, tolerance=0.05,
                    confirm={**grid, "repairs": 0})
    url = f"sqlite:///{tmp_path}/s.db"
    _, plain = calibrate(wl, off, url, "s", tmp_path / "out", processes=1)
    [failed] = plain.best["confirmation"]["candidates"]
    assert failed["status"] == "fails" and plain.best["trial"] is None  # all fp32
    # the same study repaired later: only the repairs train
    spec = tiny_spec(trials=8, steps=40, eval_every=10, tolerance=0.05, confirm=grid)
    notes = Notes()
    run, out = calibrate(wl, spec, url, "s", tmp_path / "out", sink=notes, processes=1)
    assert out.new_trials == 2 and out.path.name == "tiny.v2.parquet"
    assert (f"no candidate holds: repair round 1 trains trial {failed['trial']} with one region "
            "on fp32 (head, rest)") in notes.notes
    conf = out.best["confirmation"]["candidates"]
    assert [v["status"] for v in conf[:2]] == ["fails", "holds"]
    won = conf[1]
    assert out.best["trial"] == won["trial"]
    assert won["repair"] == {"of": failed["trial"], "round": 1, "region": "head"}
    assert won["worst_degradation"] <= 0.05 + 1e-12 and len(won["cells"]) == 2
    trials = {t.number: t for t in run.study.trials}
    repairs = [t for t in run.study.trials if t.user_attrs.get("kind") == "repair"]
    assert len(repairs) == 2 and all(t.state.name == "COMPLETE" for t in repairs)
    assert sum(1 for t in run.study.trials if t.user_attrs.get("kind") != "repair") == 8
    parent = config_of(trials[failed["trial"]], spec)
    assert config_of(trials[won["trial"]], spec) == raised(parent, spec)["head"]
    assert all(r == "fp32" for per_phase in config_of(trials[won["trial"]], spec).routes
               for r in per_phase[:1])
    # the profile is what held: its routes put the head on fp32
    profile = read_profile(out.path)
    assert {r.route for r in profile.rows if r.region == "head.*"} == {"fp32"}
    assert profile.meta["proven"]["worst_degradation"] == won["worst_degradation"]
    # a rerun trains and repairs nothing more
    run2, out2 = calibrate(wl, spec, url, "s", tmp_path / "out", sink=Notes(), processes=1)
    assert out2.new_trials == 0 and out2.best["trial"] == won["trial"] and out2.path == out.path
    # the command line's table names the repair by the trial it repairs and the region
    (tmp_path / "spec.toml").write_text(toml_text(tiny_spec_dict(
        trials=8, steps=40, eval_every=10, tolerance=0.05, confirm=grid)))
    res = CliRunner().invoke(app, ["calibrate", TINY, "--spec", str(tmp_path / "spec.toml"),
                                   "--storage", url, "--study", "s", "--out",
                                   str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert f" {won['trial']} ({failed['trial']}, head" in res.output, res.output  # then fp32
    # with repairs off, the study's repairs are no candidates: all fp32 again
    _, none = calibrate(wl, off, url, "s", tmp_path / "out", processes=1)
    assert none.new_trials == 0 and none.best["trial"] is None
    # repairs use none of the budget: a larger one trains that many more search trials
    more = tiny_spec(trials=9, steps=40, eval_every=10, tolerance=0.05, confirm=grid)
    run3, _ = calibrate(wl, more, url, "s", tmp_path / "out", processes=1)
    assert sum(1 for t in run3.study.trials if t.user_attrs.get("kind") != "repair"
               and t.state.name in ("COMPLETE", "PRUNED")) == 9


def test_a_repair_round_a_stopped_run_left_waiting_is_finished_when_rerun(tmp_path) -> None:  # noqa: ANN001
    """A run stopped after enqueueing its round: the rerun trains the waiting repairs and
    confirms them, though the round count says the round was started already."""
    wl = get_workload(TINY)
    grid = {"seeds": [1], "candidates": 1}
    url = f"sqlite:///{tmp_path}/s.db"
    off = tiny_spec(trials=8, steps=40, eval_every=10, tolerance=0.05,
                    confirm={**grid, "repairs": 0})
    run, plain = calibrate(wl, off, url, "s", tmp_path / "out", processes=1)
    [failed] = plain.best["confirmation"]["candidates"]
    parent = next(t for t in run.study.trials if t.number == failed["trial"])
    spec = tiny_spec(trials=8, steps=40, eval_every=10, tolerance=0.05, confirm=grid)
    assert enqueue_repairs(run.study, spec, 1, parent) == ["head", "rest"]
    run2, out = calibrate(wl, spec, url, "s", tmp_path / "out", processes=1)
    assert out.new_trials == 2
    won = next(v for v in out.best["confirmation"]["candidates"] if v["trial"] == out.best["trial"])
    assert won["repair"] == {"of": failed["trial"], "round": 1, "region": "head"}
    assert sum(1 for t in run2.study.trials if t.user_attrs.get("kind") == "repair") == 2
