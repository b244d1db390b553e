"""Warm starts (`calibrate --warm-start`): a profile read back into the search space, refused
where it does not fit, enqueued once as the study's first trial."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState
from typer.testing import CliRunner

from nfabric_cli.app import app
from nfabric_cli.binding.fingerprint import model_fingerprint
from nfabric_cli.calibration import run_study
from nfabric_cli.calibration.space import Config, config_profile
from nfabric_cli.calibration.warm import enqueue_warm, warm_start
from nfabric_cli.errors import InputError
from nfabric_cli.profile import write_profile
from nfabric_cli.profile.operating import OperatingProfile
from nfabric_cli.workloads.registry import get_workload
from tests.calibration.helpers import TINY, Notes, tiny_spec, tiny_spec_dict, toml_text

optuna.logging.set_verbosity(optuna.logging.WARNING)

# tiny_spec: head (fp32, int8, sign), rest (fp32, ternary, sign); boundary in [0.2, 0.5],
# tau in [0.3, 0.7], error feedback searched
CONFIG = Config(routes=(("int8", "sign"), ("sign", "ternary")), boundaries=(0.3,), tau=0.4,
                error_feedback=True)


def _profile(config: Config = CONFIG, **changes: object) -> OperatingProfile:
    """`config`'s profile, every row changed by `changes` (a field per keyword)."""
    prof = config_profile(tiny_spec(), config)
    return OperatingProfile([dataclasses.replace(r, **changes) for r in prof.rows], prof.meta)


def test_a_profile_reads_back_as_the_config_it_was_written_from() -> None:
    w = warm_start(tiny_spec(), _profile(), "p.parquet")
    assert w.config == CONFIG and w.config.key() == CONFIG.key()
    assert w.notes == () and w.source == "p.parquet"
    # an all-fp32 phase: the options no row uses take the search's defaults
    fp32 = Config((("fp32", "fp32"), ("fp32", "sign")), (0.2,), 0.5, False)
    assert warm_start(tiny_spec(), _profile(fp32), "q").config == fp32


def test_a_ternary_row_without_tau_reads_as_the_default_tau() -> None:
    """`profile init` leaves tau unset on ternary rows: the route's default, 0.5, which the
    trial trains too (inside the spec's range), or which is refused (outside it)."""
    w = warm_start(tiny_spec(), _profile(tau=None), "p")
    assert w.config == dataclasses.replace(CONFIG, tau=0.5)
    narrow = tiny_spec(routes={"tau": [0.6, 0.9], "error_feedback": [False, True]})
    with pytest.raises(InputError, match="tau 0.5, outside the spec's range"):
        warm_start(narrow, _profile(tau=None), "p")


def test_options_the_search_does_not_vary_are_noted_not_kept() -> None:
    """A schema-1.0 profile's sign rows vote zeros "negative"; the trial trains the search's
    "split" vote, and says so, as it does for a hand-set chunk size."""
    prof = _profile()
    rows = [dataclasses.replace(r, zeros="negative") if r.route == "sign" else r
            for r in prof.rows]
    rows = [dataclasses.replace(r, chunk=512) if r.route == "int8" else r for r in rows]
    w = warm_start(tiny_spec(), OperatingProfile(rows, prof.meta), "old")
    assert w.config == CONFIG
    assert w.notes == (
        "chunk 512 -> the route's default on 1 row(s) (head.*@warmup): the search's, not the "
        "profile's",
        "zeros 'negative' -> 'split' on 2 row(s) (*@warmup, head.*@main): the search's, not "
        "the profile's",
    )


@pytest.mark.parametrize(
    ("profile", "message"),
    [
        (lambda: _profile(region="body.*"),
         "phase 'warmup' has rules for ['body.*'], the spec's regions are ['*', 'head.*']"),
        (lambda: _profile(Config((("int8", "int8"), ("sign", "sign")), (0.3,), 0.4, True)),
         "region 'rest' in phase 'warmup' takes 'int8', not one of the spec's fp32, ternary, sign"),
        (lambda: _profile(Config((("int8", "sign"), ("sign", "sign")), (0.6,), 0.4, True)),
         "phase 'main' starts at 0.6, outside the spec's range [0.2, 0.5]"),
        (lambda: _profile(Config((("int8", "sign"), ("sign", "sign")), (0.305,), 0.4, True)),
         "phase 'main' starts at 0.305, not on the search's grid of 0.01 from 0.2"),
        (lambda: _profile(tau=0.9), "tau 0.9, outside the spec's range [0.3, 0.7]"),
        (lambda: _profile(rounding="stochastic"),
         "its rounding 'stochastic' is not one of the spec's nearest"),
        (lambda: OperatingProfile(
            [dataclasses.replace(r, error_feedback=r.route == "sign") for r in _profile().rows]),
         "its rows disagree on error_feedback (False, True), and a trial sets one"),
        (lambda: OperatingProfile([r for r in _profile().rows if r.phase == "main"]),
         "its phases (main) are not the spec's (warmup, main)"),
    ],
)
def test_a_profile_that_does_not_fit_the_spec_is_refused_in_one_line(profile, message: str) -> None:  # noqa: ANN001
    with pytest.raises(InputError) as err:
        warm_start(tiny_spec(), profile(), "p.parquet")
    assert str(err.value) == f"--warm-start p.parquet: {message}"


def test_the_warm_start_is_the_first_trial_and_is_enqueued_once(tmp_path: Path) -> None:
    url, wl = f"sqlite:///{tmp_path}/s.db", get_workload(TINY)
    w = warm_start(tiny_spec(), _profile(), "p.parquet")
    run = run_study(wl, tiny_spec(trials=3), url, "w", warm=[w])
    first = run.study.trials[0].user_attrs
    assert (first["kind"], first["key"], first["source"]) == ("warm", CONFIG.key(), "p.parquet")
    assert first["routes"] == {"head@warmup": "int8", "rest@warmup": "sign",
                               "head@main": "sign", "rest@main": "ternary"}
    assert [t.user_attrs["kind"] for t in _finished(run.study)] == ["warm", "sweep", "sweep"]
    # resumed with a larger budget and the same warm start: it is not trained again
    notes = Notes()
    run = run_study(wl, tiny_spec(trials=4), url, "w", notes, warm=[w, w])
    assert notes.notes.count("warm start p.parquet: the study holds its configuration already "
                             "(finished trial 0)") == 2
    assert [t.user_attrs["kind"] for t in run.study.trials].count("warm") == 1
    assert len(_finished(run.study)) == 4
    # another warm start into a study that holds its budget: said, not queued to never run
    other = warm_start(tiny_spec(), _profile(dataclasses.replace(CONFIG, tau=0.6)), "q")
    notes = Notes()
    run = run_study(wl, tiny_spec(trials=4), url, "w", notes, warm=[other])
    assert notes.notes[0] == ("warm start q: not trained, the study holds its budget of 4 "
                              "trials (a larger --trials extends it)")
    assert [t.user_attrs["kind"] for t in run.study.trials].count("warm") == 1


def test_a_pruned_trial_does_not_answer_a_warm_start_and_a_queued_one_does() -> None:
    spec, w = tiny_spec(), warm_start(tiny_spec(), _profile(), "p")
    study = optuna.create_study()
    study.add_trial(optuna.trial.create_trial(state=TrialState.PRUNED,
                                              user_attrs={"key": CONFIG.key()}))
    assert enqueue_warm(study, spec, [w], study.get_trials(), full=False) == []
    queued = study.get_trials(states=(TrialState.WAITING,))
    assert [t.user_attrs["kind"] for t in queued] == ["warm"]
    assert enqueue_warm(study, spec, [w], study.get_trials(), full=False) == [
        "warm start p: the study holds its configuration already (queued trial 1)"]
    assert len(study.get_trials(states=(TrialState.WAITING,))) == 1
    # queued in a study that has since filled its budget: it will never train, and says so
    assert enqueue_warm(study, spec, [w], study.get_trials(), full=True) == [
        "warm start p: not trained, the study holds its budget of 4 trials (a larger --trials "
        "extends it)"]


def _finished(study: optuna.Study) -> list:
    return study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))


def _cli(tmp_path: Path, *args: str):
    spec = tmp_path / "spec.toml"
    spec.write_text(toml_text(tiny_spec_dict(trials=2)))
    return CliRunner().invoke(app, ["calibrate", TINY, "--spec", str(spec), "--storage",
                                    f"sqlite:///{tmp_path}/s.db", "--out", str(tmp_path / "o"),
                                    *args])


def test_cli_warm_start_trains_it_first_and_warns_of_what_it_changes(tmp_path: Path) -> None:
    prof = _profile()
    rows = [dataclasses.replace(r, zeros="negative") if r.route == "sign" else r
            for r in prof.rows]
    path = write_profile(OperatingProfile(rows, prof.meta), tmp_path / "old" / "tiny.v1.parquet")
    res = _cli(tmp_path, "--warm-start", str(tmp_path / "old"))  # a directory: its newest
    assert res.exit_code == 0, res.output
    assert (f"warning: --warm-start {path}: zeros 'negative' -> 'split' on 2 row(s)"
            in " ".join(res.stderr.split()))
    assert "warm 0" in res.output


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("nope.parquet", "nope.parquet: no such file or directory"),
        ("profiles/lm/lm.v7.parquet", "--warm-start profiles/lm/lm.v7.parquet: "
         "phase 'warmup' has rules for ['*', '*embed*', 'head.*', 'type:LayerNorm'], the spec's "
         "regions are ['*', 'head.*']"),
    ],
)
def test_cli_bad_warm_start_exits_2_with_one_line(tmp_path: Path, target: str, message: str) -> None:
    if target.startswith("profiles/"):
        target = str(Path(__file__).parents[2] / target)
        message = message.replace("profiles/", str(Path(__file__).parents[2] / "profiles") + "/")
    res = _cli(tmp_path, "--warm-start", target)
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], res.output
    assert not (tmp_path / "s.db").exists()  # refused before the study opened


def test_cli_notes_a_profile_it_could_warm_start_from(tmp_path: Path) -> None:
    """A rerun into the same --out is told that the profile there could start it; a run told
    to start from it, or with nothing there, is not."""
    first = _cli(tmp_path)
    assert first.exit_code == 0, first.output
    assert "--warm-start" not in first.stderr
    folder = tmp_path / "o" / "tiny"
    again = CliRunner().invoke(app, ["calibrate", TINY, "--spec", str(tmp_path / "spec.toml"),
                                     "--storage", f"sqlite:///{tmp_path}/t.db", "--out",
                                     str(tmp_path / "o")])
    assert again.exit_code == 0, again.output
    assert (f"note: {folder / 'tiny.v1.parquet'} exists; --warm-start {folder} would train "
            "its routes first") in " ".join(again.stderr.split())
    warm = _cli(tmp_path, "--warm-start", str(folder))
    assert warm.exit_code == 0, warm.output
    assert "would train its routes first" not in warm.stderr


def test_a_profile_of_another_model_is_not_offered_and_warned_of_when_given(
        tmp_path: Path) -> None:
    """Another plugin of the same name wrote OUT/<name>/ (another model, same regions): no
    note offers it; given as --warm-start it is read by region, with a warning naming both
    fingerprints."""
    prof = _profile()
    theirs = write_profile(OperatingProfile(prof.rows, {**prof.meta, "model_fingerprint":
                                                        "0123456789abcdef"}),
                           tmp_path / "o" / "tiny" / "tiny.v1.parquet")
    quiet = _cli(tmp_path)
    assert quiet.exit_code == 0, quiet.output
    assert "--warm-start" not in quiet.stderr
    given = CliRunner().invoke(app, ["calibrate", TINY, "--spec", str(tmp_path / "spec.toml"),
                                     "--storage", f"sqlite:///{tmp_path}/t.db", "--warm-start",
                                     str(theirs), "--no-write"])
    assert given.exit_code == 0, given.output
    ours = get_workload(TINY).build_model(0)
    assert (f"warning: --warm-start {theirs}: it was calibrated for another model (fingerprint "
            f"0123456789abcdef, this workload's {model_fingerprint(ours)}): its routes are "
            "taken by region name") in " ".join(given.stderr.split())
