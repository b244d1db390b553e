"""Tiny studies end to end: profile written, resume, determinism, nsga2, bad input."""

from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState
from typer.testing import CliRunner

from nfabric_cli.app import app
from nfabric_cli.calibration import ProgressSink, calibrate, run_study
from nfabric_cli.calibration.objective import (
    INTERMEDIATE,
    intermediate_value,
    loss_scale,
    objective_value,
)
from nfabric_cli.calibration.strategy import make_pruner, pruner_label
from nfabric_cli.calibration.study import Calibrator
from nfabric_cli.errors import InputError
from nfabric_cli.profile import read_profile
from nfabric_cli.workloads.registry import get_workload
from tests.calibration.helpers import TINY, Notes, tiny_spec, tiny_spec_dict, toml_text

optuna.logging.set_verbosity(optuna.logging.WARNING)


class _Count(ProgressSink):
    def __init__(self) -> None:
        self.started: list[tuple[int | None, str]] = []

    def trial_started(self, number, kind, steps) -> None:  # noqa: ANN001
        self.started.append((number, kind))


def _finished(study: optuna.Study) -> list:
    return study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))


def test_objective_ranks_every_miss_behind_every_admissible_trial() -> None:
    assert objective_value(0.05, 0.01, 0.02) == 0.05
    assert objective_value(1.0, 0.0, 0.02) == 1.0  # the fp32 reference
    assert objective_value(0.05, 0.03, 0.02) == pytest.approx(1.0 + 0.05 + 0.5)
    # at a checkpoint, what the reference still gains widens the tolerance
    assert objective_value(0.05, 0.03, 0.02, slack=0.01) == 0.05
    assert objective_value(0.05, 0.05, 0.02, slack=0.01) == pytest.approx(1.0 + 0.05 + 1.0)


def test_intermediate_values_at_early_and_last_checkpoints() -> None:
    # traffic 0.05, 0.03 behind the reference at this step, tolerance 0.02, slack 0.04
    early = {f: intermediate_value(0.05, 0.03, 0.02, 0.04, False, f) for f in INTERMEDIATE}
    assert early == pytest.approx({
        "slack": 0.05,  # within 0.02 + 0.04
        "half-slack": 0.05,  # within 0.02 + 0.02
        "strict": 1.0 + 0.05 + 0.5,  # 0.01 beyond 0.02: half a tolerance
        "gap": 0.05 + 0.95 * 0.03 / 0.06,  # admissible, but the gap costs: still < 1
        "traffic": 0.05,
        "loss": 0.05,  # no loss prediction: the slack formula
    })
    # the loss formula judges the predicted degradation without widening
    assert intermediate_value(0.05, 0.03, 0.02, 0.04, False, "loss", 0.01) == 0.05
    assert intermediate_value(0.05, -0.5, 0.02, 0.04, False, "loss", 0.03) == pytest.approx(1.55)
    assert intermediate_value(0.05, -0.5, 0.02, 0.04, True, "loss", 0.03) == 0.05  # last: metric
    assert intermediate_value(0.05, -0.01, 0.02, 0.04, False, "gap") == 0.05  # ahead: no cost
    assert intermediate_value(0.05, 0.10, 0.02, 0.04, False, "gap") == pytest.approx(3.05)
    assert intermediate_value(0.05, 0.07, 0.02, 0.04, False, "half-slack") == pytest.approx(2.55)
    # the last checkpoint reports exactly the objective, whatever the formula or slack
    for formula in INTERMEDIATE:
        for degr in (-0.01, 0.01, 0.02, 0.03, 0.5):
            last = intermediate_value(0.05, degr, 0.02, 0.04, True, formula)
            assert last == objective_value(0.05, degr, 0.02), (formula, degr)
    assert intermediate_value(0.05, 0.03, 0.02, 0.04, True) == pytest.approx(1.55)
    with pytest.raises(ValueError, match="intermediate: one of slack, half-slack, .*got 'nope'"):
        Calibrator(get_workload(TINY), tiny_spec(), intermediate="nope")


def test_loss_scale_is_metric_gained_per_unit_of_loss_lost() -> None:
    curve, losses = [[5, 0.5], [10, 0.8], [15, 0.9]], [[5, 2.0], [10, 1.2], [15, 1.0]]
    assert loss_scale(curve, losses, True) == pytest.approx(0.4 / 1.0)  # accuracy per nat
    # a loss metric: the metric falls with the loss
    assert loss_scale([[5, 2.1], [15, 1.6]], [[5, 2.0], [15, 1.5]], False) == pytest.approx(1.0)
    assert loss_scale(curve, [[5, 1.0], [10, 1.2], [15, 1.1]], True) is None  # loss rose
    assert loss_scale([[5, 0.9], [15, 0.8]], [[5, 2.0], [15, 1.0]], True) is None  # metric fell
    assert loss_scale(curve, [], True) is None  # a reference kept without its losses
    assert loss_scale(curve[:1], losses[:1], True) is None


def test_trials_record_their_raw_checkpoints(tmp_path: Path) -> None:
    """The `checkpoints` user attr (step, metric, projected traffic, window training loss) is
    what the reported values were computed from, so a bench can recompute them with another
    formula; the reference keeps its window losses too."""
    wl = get_workload(TINY)
    spec = tiny_spec(trials=3, pruner="none")
    run = run_study(wl, spec, f"sqlite:///{tmp_path}/s.db", "c", sweep=False)
    calibrator = Calibrator(wl, spec)
    calibrator.reference = run.reference
    marks = spec.checkpoints()
    trained = [t for t in run.study.trials if "reused_from" not in t.user_attrs]
    assert trained
    for t in trained:
        cps = t.user_attrs["checkpoints"]
        assert [c[0] for c in cps] == list(marks) == [2, 4, 6]
        assert [[s, m] for s, m, _, _ in cps] == t.user_attrs["curve"]
        assert cps[-1][2] == t.user_attrs["traffic_fraction"]
        assert 0 < min(c[2] for c in cps) <= 1
        again = {marks.index(s) + 1: intermediate_value(
            tr, calibrator.degr(m, s), spec.tolerance, calibrator.slack(s), s == 6)
            for s, m, tr, _ in cps}
        assert t.intermediate_values == again
        assert t.intermediate_values[3] == t.value
        ref_loss = dict(run.reference["loss_curve"])
        scale = loss_scale(run.reference["curve"], run.reference["loss_curve"], wl.higher_is_better)
        assert scale is not None and scale > 0  # the tiny reference learns
        for s, _, _, loss in cps:
            assert math.isfinite(loss) and math.isfinite(ref_loss[s])
            assert calibrator.loss_degr(s, loss) == pytest.approx(scale * (loss - ref_loss[s]))
        assert calibrator.loss_degr(2, None) is None
    assert [s for s, _ in run.reference["loss_curve"]] == list(marks)


def test_tiny_study_end_to_end_writes_a_valid_profile(tmp_path: Path) -> None:
    wl = get_workload(TINY)
    spec = tiny_spec(trials=4)
    url = f"sqlite:///{tmp_path}/s.db"
    sink = _Count()
    run, out = calibrate(wl, spec, url, "t", tmp_path / "profiles", sink)
    assert out.path == tmp_path / "profiles" / "tiny" / "tiny.v1.parquet"
    assert out.png is not None and out.png.read_bytes()[:4] == b"\x89PNG"
    assert sink.started[0] == (None, "reference")
    kinds = [t.user_attrs["kind"] for t in run.study.trials]
    assert kinds[:2] == ["sweep", "sweep"] and len(kinds) == 4  # sweep first, 4 trials in all
    assert out.trials == 4 and out.trials == len(_finished(run.study))
    prof = read_profile(out.path)
    meta = prof.meta
    ref = run.study.user_attrs["reference"]["metric"]
    assert meta["target"] == {"metric": "accuracy", "reference": ref, "tolerance": 0.05,
                              "higher_is_better": True}
    prov = meta["provenance"]
    for key in ("sampler", "pruner", "seed", "trials", "pruned", "budget", "reference_metric",
                "data_fingerprint", "packages", "host"):
        assert key in prov, key
    assert (prov["sampler"], prov["seed"], prov["trials"]) == ("tpe", 0, 4)
    assert prov["pruner"] == "hyperband(min_resource=1, reduction_factor=2, brackets=2, checkpoints=3)"
    assert prov["data_fingerprint"] == wl.data_fingerprint()
    assert prov["budget"]["train_steps_spent"] == out.steps_spent > 0
    assert meta["world_size"] == 2 and meta["workload"] == "tiny"
    best = out.best
    assert best["metric_delta"] >= -1 and best["reference"] == ref
    assert ref - best["metric"] <= 0.05  # within tolerance, by construction
    rows = prof.rows
    assert len(rows) == 4 and all(r.trials is not None and r.metric_delta is not None for r in rows)
    if best["trial"] is not None:
        winner = run.study.trials[best["trial"]]
        assert best["traffic_fraction"] == winner.user_attrs["traffic_fraction"]
        assert all(r.metric_delta == pytest.approx(best["metric_delta"]) for r in rows)


def test_interrupted_study_resumes_and_counts_add_up(tmp_path: Path) -> None:
    wl = get_workload(TINY)
    url = f"sqlite:///{tmp_path}/s.db"

    def stop_after_two(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        if len(_finished(study)) >= 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_study(wl, tiny_spec(trials=5), url, "r", callbacks=[stop_after_two])
    first = optuna.load_study(study_name="r", storage=url)
    assert len(_finished(first)) == 2 and "reference" in first.user_attrs

    class Interrupt(ProgressSink):  # interrupt inside the third trial: it is lost, nothing else
        def step(self, done: int) -> None:
            if done == 3:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_study(wl, tiny_spec(trials=5), url, "r", Interrupt())
    second = optuna.load_study(study_name="r", storage=url)
    states = [t.state for t in second.trials]
    assert states.count(TrialState.FAIL) == 1 and states[-1] == TrialState.FAIL
    done = len(_finished(second))
    assert done >= 2

    sink = _Count()  # a rerun finishes the study's budget of 5: it adds what is missing
    run = run_study(wl, tiny_spec(trials=5), url, "r", sink)
    assert run.resumed and run.new_trials == 5 - done
    assert len(_finished(run.study)) == 5
    again = run_study(wl, tiny_spec(trials=5), url, "r")  # complete: nothing to add
    assert again.new_trials == 0 and len(_finished(again.study)) == 5
    # a sweep or seed trial that failed is queued again: each one completes once
    kinds = [t.user_attrs.get("kind") for t in run.study.trials if t.state == TrialState.COMPLETE]
    assert kinds.count("sweep") == 2 and kinds.count("derived") == len(set(
        t.user_attrs["key"] for t in run.study.trials if t.user_attrs.get("kind") == "derived"))
    assert all(kind != "reference" for _, kind in sink.started)  # the reference is reused


def test_fresh_studies_with_the_same_seed_and_name_agree(tmp_path: Path) -> None:
    wl = get_workload(TINY)
    spec = tiny_spec(trials=5, pruner="median")
    runs = [run_study(wl, spec, f"sqlite:///{tmp_path}/{i}.db", "same") for i in range(2)]
    a, b = ([(t.params, t.state, t.value) for t in r.study.trials] for r in runs)
    assert a == b
    assert runs[0].study.best_params == runs[1].study.best_params


def test_nsga2_reports_a_pareto_front(tmp_path: Path) -> None:
    wl = get_workload(TINY)
    spec = tiny_spec(trials=4, sampler="nsga2")
    run, out = calibrate(wl, spec, f"sqlite:///{tmp_path}/s.db", None, tmp_path / "p")
    assert run.study.study_name == "tiny-w2-s0-nsga2" and len(run.study.directions) == 2
    front = out.best["pareto_front"]
    assert front and all(p["traffic_fraction"] <= 1 for p in front)
    traffic = [p["traffic_fraction"] for p in front]
    degr = [p["degradation"] for p in front]
    assert traffic == sorted(traffic) and degr == sorted(degr, reverse=True)  # a real front
    assert out.pruned == 0


def test_a_multi_objective_study_with_a_confirmation_grid_writes_its_profile(tmp_path: Path) -> None:
    """nsga2 has a Pareto front, not a list of candidates, so it is not confirmed; the profile
    was never written ("confirmation cells are still in training"), waiting for cells nothing
    would train. Now the cheapest admissible trial wins, proven on the search's own cell."""
    wl = get_workload(TINY)
    spec = tiny_spec(trials=3, sampler="nsga2", confirm={"seeds": [1]})
    notes = Notes()
    run, out = calibrate(wl, spec, f"sqlite:///{tmp_path}/s.db", None, tmp_path / "p", sink=notes)
    assert not out.pending and out.path is not None and out.path.exists()
    assert any(n.startswith("no confirmation: a multi-objective study (nsga2)") for n in notes.notes)
    proven = read_profile(out.path).meta["proven"]
    assert (proven["seeds"], proven["steps"]) == ([0], [spec.steps])


def test_make_pruner_builds_hyperband_with_the_spec_shape() -> None:
    spec = tiny_spec(steps=24, eval_every=2, hyperband_min_resource=2, hyperband_reduction_factor=2)
    pruner = make_pruner(spec)
    assert isinstance(pruner, optuna.pruners.HyperbandPruner)
    assert (pruner._min_resource, pruner._max_resource, pruner._reduction_factor) == (2, 12, 2)
    assert pruner_label(spec) == \
        "hyperband(min_resource=2, reduction_factor=2, brackets=3, checkpoints=12)"
    assert _brackets(pruner) == 3  # first cuts at checkpoints 2, 4, 8
    for brackets in (1, 2):
        capped = make_pruner(spec.with_overrides(hyperband_brackets=brackets))
        assert (capped._min_resource, capped._reduction_factor) == (2, 2)
        assert _brackets(capped) == brackets
    assert isinstance(make_pruner(spec.with_overrides(pruner="median")), optuna.pruners.MedianPruner)
    assert pruner_label(spec.with_overrides(pruner="median")) == "median"
    assert isinstance(make_pruner(spec.with_overrides(pruner="none")), optuna.pruners.NopPruner)
    nsga2 = spec.with_overrides(sampler="nsga2")
    assert isinstance(make_pruner(nsga2), optuna.pruners.NopPruner)
    assert pruner_label(nsga2) == "none (multi-objective)"


def _brackets(pruner: optuna.pruners.HyperbandPruner) -> int:
    """The bracket count Optuna settles on (it is set at the first pruning question)."""
    study = optuna.create_study(pruner=pruner)
    trial = study.ask()
    trial.report(1.0, 1)
    trial.should_prune()
    return pruner._n_brackets


def test_resume_with_another_hyperband_shape_is_the_same_study(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/s.db"
    run_study(get_workload(TINY), tiny_spec(trials=1), url, "x")
    shaped = tiny_spec(trials=2, hyperband_min_resource=2, hyperband_reduction_factor=2)
    run = run_study(get_workload(TINY), shaped, url, "x")
    assert run.resumed and len(_finished(run.study)) == 2
    assert "hyperband_min_resource" not in run.study.user_attrs["spec"]


def test_study_of_another_workload_or_spec_is_refused(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/s.db"
    run_study(get_workload(TINY), tiny_spec(trials=1), url, "x")
    with pytest.raises(InputError, match="study 'x' was run with a different calibration spec "
                                         r"\(changed: steps\)"):
        run_study(get_workload(TINY), tiny_spec(trials=1, steps=4), url, "x")
    study = optuna.load_study(study_name="x", storage=url)
    study.set_user_attr("workload", "lm")
    with pytest.raises(InputError, match="study 'x' belongs to workload 'lm', not 'tiny'"):
        run_study(get_workload(TINY), tiny_spec(trials=1), url, "x")


def test_study_of_another_model_or_data_under_the_same_name_is_refused(tmp_path: Path) -> None:
    """A plugin edited between two runs keeps its workload name and spec: its study resumed,
    trained nothing new and wrote the old model's results under the new model's fingerprint
    (exit 0; an outsider's finding, session 68)."""
    from torch import nn

    from tests.calibration.tiny import TinyNet, TinyWorkload

    class Wider(TinyWorkload):
        def _make_model(self) -> nn.Module:
            net = TinyNet()
            net.body = nn.Linear(12, 32, bias=False)
            return net

    class Relabelled(TinyWorkload):
        def __init__(self) -> None:
            super().__init__()
            self.y = (self.y + 1) % 4
            self.fingerprint = "0" * 64

    url = f"sqlite:///{tmp_path}/s.db"
    first = run_study(get_workload(TINY), tiny_spec(trials=1), url, "x")
    here = first.study.user_attrs
    with pytest.raises(InputError, match=r"^study 'x' was trained on another model \(fingerprint "
                                         + here["model"][:12] + r", here [0-9a-f]{12}\): its "
                                         "results are not this model's; pick another "
                                         "--study name$"):
        run_study(Wider(), tiny_spec(trials=1), url, "x")
    with pytest.raises(InputError, match=r"^study 'x' was trained on other data \(fingerprint "
                                         + here["data"][:12] + r", here 000000000000\): this "
                                         "machine builds or reads other data than the "
                                         "study's"):
        run_study(Relabelled(), tiny_spec(trials=1), url, "x")
    assert run_study(get_workload(TINY), tiny_spec(trials=2), url, "x").resumed  # the same one
    # a study stored before these were kept holds neither: resumed as before
    study = optuna.load_study(study_name="x", storage=url)
    for key in ("model", "data"):
        study._storage.set_study_user_attr(study._study_id, key, None)
    assert run_study(Wider(), tiny_spec(trials=2), url, "x").resumed


def _cli(tmp_path: Path, *args: str):
    """`calibrate` on the tiny workload; its study and profile land in `tmp_path` unless
    `args` name others (the last --out / --storage wins): a case that runs where it was
    meant to fail must not write into the repository."""
    spec = tmp_path / "spec.toml"
    if not spec.exists():
        spec.write_text(toml_text(tiny_spec_dict(trials=2)))
    own = ["--storage", f"sqlite:///{tmp_path}/own.db", "--out", str(tmp_path / "own")]
    return CliRunner().invoke(app, ["calibrate", TINY, "--spec", str(spec), *own, *args])


def test_a_plugins_own_exception_is_its_error_not_an_internal_one(tmp_path: Path) -> None:
    """A plugin whose loss raises was reported as nfabric's bug (exit 3, "internal error"):
    now one line that names the plugin's frame, exit 2."""
    spec = tmp_path / "spec.toml"
    spec.write_text(toml_text(tiny_spec_dict(trials=2)))

    def run(fn: str, *more: str):  # noqa: ANN202
        return CliRunner().invoke(app, ["calibrate", f"tests.calibration.tiny:{fn}", "--spec",
                                        str(spec), "--storage", f"sqlite:///{tmp_path}/{fn}.db",
                                        "--out", str(tmp_path / "out"), *more])

    res = run("broken")
    assert res.exit_code == 2, res.output
    line = res.output.strip().splitlines()[-1]
    assert line.startswith("error: the plugin's code raised ValueError: Expected input "
                           "batch_size (16) to match target batch_size (3). (tiny.py:")
    assert line.endswith(" in loss; run with --debug for the traceback)")
    assert "Traceback" not in res.output and not (tmp_path / "out").exists()
    # raised in a simulated rank's process (two ranks, two processes): the same verdict
    for processes in ("2", "1"):
        res = run("late", "--world-size", "2", "--processes", processes)
        assert res.exit_code == 2, res.output
        line = res.output.strip().splitlines()[-1]
        assert line.startswith("error: the plugin's code raised ValueError: the loader broke "
                               "at step 3 (tiny.py:"), line
        assert " in train_batch" in line and "Traceback" not in res.output


def test_an_internal_error_stays_one() -> None:
    """What nfabric's own code raises stays exit 3 (`user_frame` None), even called from the
    user's code; torch refusing what the user's code handed it is the user's."""
    import torch

    from nfabric_cli.binding.fingerprint import model_fingerprint
    from nfabric_cli.errors import user_frame

    try:
        model_fingerprint(None)  # nfabric's frame raises (None has no parameters)
    except AttributeError as exc:
        assert user_frame(exc) is None
    try:
        torch.zeros(2).view(3)  # torch refuses: this file's frame is the one that called it
    except RuntimeError as exc:
        frame = user_frame(exc)
        assert frame is not None and frame.startswith("test_study.py:")
        assert frame.endswith(" in test_an_internal_error_stays_one")


def test_cli_json_output_is_exactly_the_documented_keys(tmp_path: Path) -> None:
    res = _cli(tmp_path, "--storage", f"sqlite:///{tmp_path}/s.db", "--out", str(tmp_path / "o"),
               "--trials", "2", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert list(doc) == ["profile", "trials", "pruned", "best", "written_by"]
    assert doc["written_by"] == f"{socket.gethostname()}:{os.getpid()}"  # CliRunner: in-process
    assert doc["profile"] == str(tmp_path / "o" / "tiny" / "tiny.v1.parquet")
    assert doc["trials"] == 2 and doc["pruned"] == 0
    assert set(doc["best"]) >= {"trial", "traffic_fraction", "metric", "metric_delta", "routes"}


@pytest.mark.parametrize("rule", ["worst", "validate"])
def test_cli_prints_the_confirmation_table_with_other_world_sizes(
        tmp_path: Path, rule: str) -> None:
    """The candidates' table names a cell at another world size (`/w3`) and, in its title,
    the bound the rule judges by; the run exits 0."""
    res = _cli(tmp_path, "--storage", f"sqlite:///{tmp_path}/s.db", "--out", str(tmp_path / "o"),
               "--confirm-world-sizes", "3", "--confirm-seeds", "none", "--confirm-rule", rule)
    assert res.exit_code == 0, res.output
    assert f"confirmation ({rule} rule): 2 cells" in res.output
    five = "min; bound95: for the worst of 5 more seeds"
    assert (five in " ".join(res.output.split())) == (rule == "validate"), res.output
    proven = read_profile(tmp_path / "o" / "tiny" / "tiny.v1.parquet").meta["proven"]
    rows = [ln for ln in res.output.splitlines() if ln.startswith("│")
            and ("holds" in ln or "fails" in ln)]
    if rule == "worst":
        assert proven["rule"] == "every cell within tolerance of its own fp32 reference"
    else:  # two cells bound no five more seeds (t(0.99, 1) is 31): nothing holds, all fp32
        assert proven == {"fp32": True} and all("fails" in ln for ln in rows), res.output
    # the search's own cell, then the same seed and length at three ranks
    assert rows and all("0/6 " in ln and "0/6/w3 " in ln for ln in rows), res.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tolerance", "0"], "tolerance must be in (0, 1]"),
        (["--trials", "0"], "trials must be in [1, 10000]"),
        (["--steps", "0"], "steps must be in [1"),
        (["--storage", "nosuchdb://x"], "cannot open storage nosuchdb://x"),
        (["--storage", "sqlite:////nonexistent/dir/s.db"], "cannot open storage"),
        (["--sampler", "nsga2", "--pruner", "hyperband"], "cannot prune"),
        (["--processes", "0"], "--processes must be >= 1, got 0"),
        (["--workload", "vision"], "and --workload 'vision'"),
        (["--confirm-world-sizes", "1"], "confirm.world_sizes must each be in [2, 64], got [1]"),
        (["--confirm-world-sizes", "two"], "--confirm-world-sizes: expected world sizes like"),
        (["--confirm-steps", "3x"], "--confirm-steps: expected lengths like 300,600 or none"),
        (["--confirm-repairs", "9"], "confirm.repairs must be in [0, 8], got 9"),
        (["--confirm-steps", ""], "--confirm-steps: expected lengths like 300,600 or none, got ''"),
        (["--out", "/proc/nfabric-out"], "--out /proc/nfabric-out/tiny: cannot write in /proc"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    res = _cli(tmp_path, *args)
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], res.output
    assert res.output.startswith("error: ")  # no blank line of a progress bar before it


def test_cli_refuses_a_journal_storage_that_is_another_file(tmp_path: Path) -> None:
    """A mistyped journal path (the spec's, say) is refused, not appended to and then
    misread: the file is left as it was. An empty file is a new journal."""
    spec = tmp_path / "spec.toml"
    spec.write_text(toml_text(tiny_spec_dict(trials=1)))
    before = spec.read_bytes()
    res = _cli(tmp_path, "--storage", f"journal:{spec}")
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and (f"cannot open storage journal:{spec}: {spec} is not an Optuna "
                                "journal (its first line is not a journal record)") in lines[0]
    assert spec.read_bytes() == before
    (tmp_path / "j.log").write_text("")
    res = _cli(tmp_path, "--storage", f"journal:{tmp_path}/j.log", "--out", str(tmp_path / "o"),
               "--trials", "1", "--confirm-seeds", "none")
    assert res.exit_code == 0, res.output
    assert '"op_code"' in (tmp_path / "j.log").read_text().splitlines()[0]


def test_cli_a_bf16_model_exits_2_saying_what_to_calibrate(tmp_path: Path) -> None:
    """The simulator computes in float32; DDP trains a bf16 model in bf16. Refused before any
    trial runs, with the way round it (a float32 build; the profile binds to the bf16 one)."""
    (tmp_path / "spec.toml").write_text(toml_text(tiny_spec_dict(trials=2)))
    res = CliRunner().invoke(app, ["calibrate", "tests.calibration.tiny:bf16_workload",
                                   "--spec", str(tmp_path / "spec.toml"),
                                   "--storage", f"sqlite:///{tmp_path}/s.db"])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1, res.output
    assert ("calibration simulates float32 models; 6 parameter(s) are not: body.weight "
            "(bfloat16), body.bias (bfloat16), norm.weight (bfloat16) (+3 more). Calibrate a "
            "float32 build") in lines[0]


def test_cli_warns_when_the_fp32_reference_learns_nothing(tmp_path: Path) -> None:
    """Against a reference that did not train, every route looks harmless: say so."""
    (tmp_path / "spec.toml").write_text(toml_text(tiny_spec_dict(trials=2)))
    args = ["--spec", str(tmp_path / "spec.toml"), "--out", str(tmp_path / "o")]
    stuck = CliRunner().invoke(app, ["calibrate", "tests.calibration.tiny:stuck_workload", *args,
                                     "--storage", f"sqlite:///{tmp_path}/a.db"])
    assert stuck.exit_code == 0, stuck.output
    assert "warning: the fp32 reference did not learn: accuracy" in stuck.output
    learns = CliRunner().invoke(app, ["calibrate", TINY, *args,
                                      "--storage", f"sqlite:///{tmp_path}/b.db"])
    assert learns.exit_code == 0 and "did not learn" not in learns.output, learns.output
    assert "SyncBatchNorm" not in learns.output


def test_cli_warns_that_sync_batchnorm_is_simulated_per_rank(tmp_path: Path) -> None:
    """The simulator's ranks run one at a time, so SyncBatchNorm normalises each rank's batch
    alone (outside a process group it is BatchNorm): the calibration says it approximates."""
    (tmp_path / "spec.toml").write_text(toml_text(tiny_spec_dict(trials=1)))
    res = CliRunner().invoke(app, ["calibrate", "tests.calibration.tiny:syncbn_workload",
                                   "--spec", str(tmp_path / "spec.toml"),
                                   "--out", str(tmp_path / "o"),
                                   "--storage", f"sqlite:///{tmp_path}/s.db"])
    assert res.exit_code == 0, res.output
    assert ("warning: 1 SyncBatchNorm layer(s) (norm): the simulator normalises each rank's "
            "batch on its own statistics") in " ".join(res.output.split())


def test_cli_bad_hyperband_shape_in_the_spec_exits_2(tmp_path: Path) -> None:
    (tmp_path / "spec.toml").write_text(toml_text(tiny_spec_dict(hyperband_reduction_factor=1)))
    res = _cli(tmp_path, "--storage", f"sqlite:///{tmp_path}/s.db")
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1, res.output
    assert "hyperband_reduction_factor must be an int >= 2, got 1" in lines[0]


def test_cli_unknown_region_and_other_workload_study_exit_2(tmp_path: Path) -> None:
    data = tiny_spec_dict(regions=[
        {"name": "h", "selector": "classifier.*", "routes": ["fp32", "sign"]},
        {"name": "r", "selector": "*", "routes": ["fp32", "sign"]}])
    (tmp_path / "spec.toml").write_text(toml_text(data))
    res = _cli(tmp_path, "--storage", f"sqlite:///{tmp_path}/s.db")
    assert res.exit_code == 2
    assert "selector 'classifier.*'" in res.output and "matches no trainable parameter" in res.output
    (tmp_path / "spec.toml").write_text(toml_text(tiny_spec_dict(trials=1)))
    url = f"sqlite:///{tmp_path}/s.db"
    optuna.create_study(study_name="taken", storage=url).set_user_attr("workload", "lm")
    res = _cli(tmp_path, "--storage", url, "--study", "taken")
    assert res.exit_code == 2 and "belongs to workload 'lm'" in res.output


_KILLED_RUN = """
import os, signal, sys
from nfabric_cli.calibration import ProgressSink, run_study
from nfabric_cli.workloads.registry import get_workload
from tests.calibration.helpers import TINY, tiny_spec

class Kill(ProgressSink):
    number = None
    def trial_started(self, number, kind, steps):
        self.number = number
    def step(self, done):
        if self.number == 1 and done == 3:
            os.kill(os.getpid(), signal.SIGKILL)

run_study(get_workload(TINY), tiny_spec(trials=5), sys.argv[1], "k", Kill())
"""


def test_killed_process_loses_only_the_trial_in_flight(tmp_path: Path, monkeypatch) -> None:
    import subprocess
    import sys
    import time

    import nfabric_cli.calibration.storage as storage

    url = f"sqlite:///{tmp_path}/s.db"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", _KILLED_RUN, url], cwd=root, timeout=120)
    assert proc.returncode == -9
    states = [t.state for t in optuna.load_study(study_name="k", storage=url).trials]
    assert states == [TrialState.COMPLETE, TrialState.RUNNING]  # the kill left a zombie
    monkeypatch.setattr(storage, "GRACE_S", 1)
    monkeypatch.setattr(storage, "HEARTBEAT_S", 1)
    time.sleep(1.5)
    run = run_study(get_workload(TINY), tiny_spec(trials=4), url, "k")
    states = [t.state for t in run.study.trials]
    assert states[1] == TrialState.FAIL and states.count(TrialState.FAIL) == 1
    assert len(_finished(run.study)) == 4 and run.new_trials == 3
    sweeps = [t.user_attrs["region"] for t in run.study.trials
              if t.user_attrs.get("kind") == "sweep" and t.state == TrialState.COMPLETE]
    assert sorted(sweeps) == ["head", "rest"]  # the killed sweep trial ran again


def test_a_config_whose_traffic_bound_cannot_win_is_pruned_untrained(tmp_path: Path) -> None:
    from nfabric_cli.calibration.space import uniform_config

    wl = get_workload(TINY)
    url = f"sqlite:///{tmp_path}/s.db"
    spec = tiny_spec(trials=3, tolerance=1.0)  # everything admissible: sweep 2 + 1 seed
    first = run_study(wl, spec, url, "b")
    assert [t.user_attrs["kind"] for t in first.study.trials] == ["sweep", "sweep", "derived"]
    best = min(t.user_attrs["traffic_fraction"] for t in first.study.trials)
    costly = uniform_config(spec, {"head": "int8"})  # the head alone on int8: ~99% of fp32
    first.study.enqueue_trial(costly.params(spec), {"kind": "search"})
    run = run_study(wl, tiny_spec(trials=4, tolerance=1.0), url, "b")
    last = run.study.trials[-1]
    assert last.state == TrialState.PRUNED and last.user_attrs["steps_run"] == 0
    assert last.user_attrs["traffic_bound"] > best
    assert run.study.trials[-1].intermediate_values == {}


def test_with_confirmation_a_config_is_pruned_only_if_it_cannot_be_a_candidate(
        tmp_path: Path) -> None:
    """Confirmation may reject the cheapest admissible trials, so the search keeps training
    configs that could be among the `candidates` cheapest: pruned by bound only once that
    many admissible trials are cheaper than its bound."""
    from nfabric_cli.calibration.space import uniform_config

    wl = get_workload(TINY)
    url = f"sqlite:///{tmp_path}/s.db"
    costly = uniform_config(tiny_spec(), {"head": "int8"})  # the head alone on int8: ~84 %
    states = {}
    for candidates in (4, 2):
        confirm = {"seeds": [1], "candidates": candidates}
        name = f"c{candidates}"
        first = run_study(wl, tiny_spec(trials=3, tolerance=1.0, confirm=confirm), url, name)
        traffic = sorted(t.user_attrs["traffic_fraction"] for t in first.study.trials)
        assert len(traffic) == 3 and traffic[1] < 0.5  # 3 admissible, the 2nd cheapest < 50 %
        first.study.enqueue_trial(costly.params(tiny_spec()), {"kind": "search"})
        last = run_study(wl, tiny_spec(trials=4, tolerance=1.0, confirm=confirm), url,
                         name).study.trials[-1]
        states[candidates] = (last.state, last.user_attrs["steps_run"] > 0)
    assert states[4] == (TrialState.COMPLETE, True)  # fewer admissible than candidates: trained
    assert states[2] == (TrialState.PRUNED, False)  # two cheaper admissible: it cannot place


def test_bench_replay_spends_exactly_the_steps_of_live_pruned_studies(tmp_path: Path) -> None:
    """bench.calibrate_pruning --replay judges shapes without training: it must reproduce what
    run_study does with the pruner and the traffic bound, trial by trial."""
    from bench.calibrate_pruning import compare, make_arms, replay, reported_values

    wl = get_workload(TINY)
    base = tiny_spec(steps=6, eval_every=1, trials=6, sampler="random", tolerance=0.01)
    # one shape with the strict formula, recomputed from the kept study's raw checkpoints
    arms = make_arms([(1, 2, None)], ("strict",)) + make_arms([(None, None, None)])[1:]
    assert [a.label for a in arms] == ["none", "hyperband/strict", "hyperband+bound/strict",
                                       "hyperband", "hyperband+bound"]
    live = compare(wl, base, 0, False, arms, 1, tmp_path)
    (replayed,) = replay(wl, base, 0, arms, tmp_path, ["bench"])
    assert sum(pruned for _, _, _, pruned in live.values()) > 0  # the pruners did act
    for label, (traj, best, _, pruned) in live.items():
        assert replayed[label][0] == traj, label
        assert (replayed[label][1], replayed[label][3]) == (best, pruned), label

    kept = optuna.load_study(study_name="bench", storage=f"sqlite:///{tmp_path}/seed0-arm0.db")
    trials = kept.get_trials()
    calibrator = Calibrator(wl, base)
    calibrator.reference = kept.user_attrs["reference"]
    strict = reported_values(trials, calibrator, "strict", 0)
    slack = reported_values(trials, calibrator, "slack", 0)
    assert slack == {t.number: t.intermediate_values for t in trials if t.intermediate_values}
    assert strict != slack  # the formulas differ on these trials ...
    assert all(strict[n][6] == slack[n][6] for n in slack)  # ... but never at the last one
    # a study kept before the raw checkpoints existed: its stored values, default formula only
    old = optuna.trial.create_trial(value=0.5, intermediate_values={1: 0.5, 2: 0.5},
                                    user_attrs={"key": "k"})
    old.number = 3
    assert reported_values([old], calibrator, "slack", 7) == {3: {1: 0.5, 2: 0.5}}
    with pytest.raises(SystemExit, match="seed 7: trial 3 has no raw checkpoints"):
        reported_values([old], calibrator, "strict", 7)


def test_ctrl_c_in_a_trial_is_not_reported_twice() -> None:
    """Optuna logs a failed trial with its traceback; for Ctrl-C the CLI's one line says it,
    so the CLI's filter drops that report and its "failed with value None" follow-up, and
    lets any other failure through."""
    import logging
    import sys

    from nfabric_cli.cli.calibrate import QuietInterrupt

    def record(message: str, exc: BaseException | None) -> logging.LogRecord:
        info = None
        if exc is not None:
            try:
                raise exc
            except BaseException:  # noqa: BLE001 - building exc_info
                info = sys.exc_info()
        return logging.LogRecord("optuna.study._optimize", logging.WARNING, __file__, 1,
                                 message, None, info)

    quiet = QuietInterrupt()
    assert not quiet.filter(record("Trial 3 failed with parameters: {} because of the "
                                   "following error: KeyboardInterrupt().", KeyboardInterrupt()))
    assert not quiet.filter(record("Trial 3 failed with value None.", None))
    assert quiet.filter(record("Trial 4 failed with parameters: {} because of the following "
                               "error: ValueError('x').", ValueError("x")))
    assert quiet.filter(record("Trial 4 failed with value None.", None))
    assert quiet.filter(record("Trial 5 finished with value: 0.1", None))
