"""Several calibrate workers on one study: on a real PostgreSQL server and a journal file.

The workers are real `nfabric calibrate` processes started together on the tiny workload; the
PostgreSQL tests run against a throw-away server (`tests/pgserver.py`) and are skipped, with
the reason, where none can run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from nfabric_cli.binding.compile import compile_profile
from nfabric_cli.calibration.choice import best_admissible, completed, config_of
from nfabric_cli.calibration.simulate import simulate_run
from nfabric_cli.calibration.space import config_profile
from nfabric_cli.calibration.storage import open_storage
from nfabric_cli.calibration.workers import Claim, Worker, is_claim
from nfabric_cli.profile import read_profile
from nfabric_cli.workloads.registry import get_workload
from tests.calibration.helpers import TINY, Notes, tiny_spec, tiny_spec_dict, toml_text

ROOT = Path(__file__).resolve().parents[2]
BUDGET = 10
STEPS, EVERY = 80, 20  # trials long enough (~0.3 s) for both workers to take some
# Liveness for the tests: beats every second. A killed worker of this machine is noticed at
# once by its pid; the grace only judges a silent one, and 10 s (not 3) keeps a live worker
# whose beat a loaded 2-core CI machine delays from being taken for dead.
FAST = {"NFABRIC_HEARTBEAT_S": "1", "NFABRIC_GRACE_S": "10", "OMP_NUM_THREADS": "1"}


def _spec(tmp_path: Path, **top) -> Path:
    path = tmp_path / "spec.toml"
    path.write_text(toml_text(tiny_spec_dict(trials=BUDGET, steps=STEPS, eval_every=EVERY, **top)))
    return path


#: Runs `python -m nfabric_cli ARGS` with a start barrier: a worker's first `Study.ask` waits
#: (up to 60 s) until both workers have reached theirs. Without it, on a loaded machine the
#: worker that finished importing first could take every trial of the tiny study before the
#: other asked for one, and "both took trials" failed on timing alone.
_BARRIER = """
import os, runpy, sys, time
import optuna
folder = sys.argv.pop(1)
ask, waited = optuna.study.Study.ask, []
def ask_once_both_are_ready(self, *args, **kwargs):
    if not waited:
        waited.append(True)
        open(os.path.join(folder, f"ready-{os.getpid()}"), "w").close()
        deadline = time.monotonic() + 60
        while len(os.listdir(folder)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    return ask(self, *args, **kwargs)
optuna.study.Study.ask = ask_once_both_are_ready
sys.argv[0] = "nfabric"
runpy.run_module("nfabric_cli", run_name="__main__")
"""


def _worker(tmp_path: Path, url: str, *extra: str, name: str = "shared",
            barrier: Path | None = None) -> subprocess.Popen:
    """`nfabric calibrate` on the shared study; with `barrier`, behind `_BARRIER`."""
    args = ["calibrate", TINY, "--spec", str(tmp_path / "spec.toml"), "--storage", url,
            "--study", name, "--out", str(tmp_path / "out"), "--processes", "1", *extra]
    run = ["-m", "nfabric_cli"] if barrier is None else ["-c", _BARRIER, str(barrier)]
    return subprocess.Popen([sys.executable, *run, *args], cwd=ROOT, env={**os.environ, **FAST},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"worker hung\n{out}\n{err}") from None
    return proc.returncode, out, err


def _trained(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
            and "reused_from" not in t.user_attrs and t.user_attrs.get("steps_run", 0) > 0]


def _check_shared_study(tmp_path: Path, url: str, logs: str) -> optuna.Study:
    """What two cooperating workers must leave: the budget exactly, each configuration
    trained once, one reference, one profile equal to the study's winner."""
    study = optuna.load_study(study_name="shared", storage=open_storage(url))
    finished = [t for t in study.trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(finished) == BUDGET, logs
    keys = [t.user_attrs["key"] for t in _trained(study)]
    assert len(keys) == len(set(keys)), logs  # no configuration trained twice
    # the reference ran once: one claim on it was ever taken, by the worker it names
    claims = [s.study_name for s in optuna.get_all_study_summaries(open_storage(url))
              if is_claim(s.study_name)]
    assert [c for c in claims if "reference" in c] == ["shared~reference"], (claims, logs)
    assert "worker:" + study.user_attrs["reference"]["worker"] in study.user_attrs
    assert {t.user_attrs["worker"] for t in finished} <= set(
        w[len("worker:"):] for w in study.user_attrs if w.startswith("worker:")), logs
    files = sorted((tmp_path / "out" / "tiny").glob("*.parquet"))
    assert [f.name for f in files] == ["tiny.v1.parquet"], logs
    # the profile is the winner of the study's trials, as one worker would pick it ...
    spec = tiny_spec(trials=BUDGET, steps=STEPS, eval_every=EVERY)
    winner = best_admissible(study, spec.tolerance)
    profile = read_profile(files[0])
    routes = [(r.region, r.phase, r.route) for r in profile.sorted_rows()]
    if winner is None:  # which trials run depends on the workers' timing: none may pass
        assert {route for _, _, route in routes} == {"fp32"}, logs
        assert all(t.user_attrs["degradation"] > spec.tolerance for t in completed(study))
        return study
    expected = config_profile(spec, config_of(winner, spec), {})
    assert routes == [(r.region, r.phase, r.route) for r in expected.sorted_rows()]
    # ... and the winner's result is what one process computes for its configuration alone
    wl = get_workload(TINY)
    bindings = compile_profile(config_profile(spec, config_of(winner, spec),
                                              {"world_size": 2, "health": spec.health}),
                               wl.build_model(0), world_size=2, bucket_cap_mb=None,
                               total_steps=spec.steps)
    alone = simulate_run(wl, bindings, 2, spec.steps, 0, spec.checkpoints(), processes=1)
    assert alone.metric == winner.user_attrs["metric"]
    assert alone.traffic_fraction == winner.user_attrs["traffic_fraction"]
    return study


def _two_workers(tmp_path: Path, url: str) -> None:
    _spec(tmp_path)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    procs = [_worker(tmp_path, url, barrier=barrier) for _ in range(2)]
    results = [_finish(p) for p in procs]
    logs = "\n".join(f"--- worker {i}: rc {rc}\n{out}\n{err}"
                     for i, (rc, out, err) in enumerate(results))
    assert all(rc == 0 for rc, _, _ in results), logs
    study = _check_shared_study(tmp_path, url, logs)
    finished = [t for t in study.trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len({t.user_attrs["worker"] for t in finished}) == 2, logs  # both took trials
    written = [out for _, out, _ in results if re.search(r"profile: \S+tiny\.v1\.parquet$", out,
                                                         re.M)]
    assert len(written) >= 1, logs
    assert study.user_attrs[f"profile@{BUDGET}"]["path"].endswith("tiny.v1.parquet")


@pytest.mark.slow
def test_two_workers_share_one_postgresql_study(tmp_path: Path, pg_url: str) -> None:
    _two_workers(tmp_path, pg_url)


@pytest.mark.slow
def test_two_workers_share_one_journal_file(tmp_path: Path) -> None:
    _two_workers(tmp_path, f"journal:{tmp_path}/study.log")


_KILLED_WORKER = """
import os, signal, sys
from nfabric_cli.calibration import ProgressSink, calibrate
from nfabric_cli.calibration.spec import load_spec
from nfabric_cli.workloads.registry import get_workload
from tests.calibration.helpers import TINY

class Kill(ProgressSink):
    number = None
    def trial_started(self, number, kind, steps):
        self.number = number
    def step(self, done):
        if self.number is not None and done == 40:  # the first trial it trains this far
            os.kill(os.getpid(), signal.SIGKILL)

wl = get_workload(TINY)
spec = load_spec(sys.argv[2], wl.name)
calibrate(wl, spec, sys.argv[1], "shared", sys.argv[3], Kill(), processes=1)
"""


@pytest.mark.slow
def test_a_killed_worker_loses_only_its_trial_and_a_restart_rejoins(tmp_path: Path,
                                                                   pg_url: str) -> None:
    _spec(tmp_path)
    # the doomed worker runs alone until it dies halfway through the first trial it trains
    # (started beside the survivor, a loaded machine could leave it only trials the survivor
    # prunes untrained, and it would finish instead of dying)
    doomed = subprocess.Popen([sys.executable, "-c", _KILLED_WORKER, pg_url,
                               str(tmp_path / "spec.toml"), str(tmp_path / "out")],
                              cwd=ROOT, env={**os.environ, **FAST}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    rc, out, err = _finish(doomed)
    assert rc == -signal.SIGKILL, (out, err)
    study = optuna.load_study(study_name="shared", storage=pg_url)
    # its trial in flight, left RUNNING: the workers that come next fail it (same machine, so
    # they see at once that the process is gone) and train everything else
    killed = [t for t in study.trials if t.state == TrialState.RUNNING
              and t.user_attrs.get("worker", "").endswith(f":{doomed.pid}")
              and "dropped" not in t.user_attrs]
    assert len(killed) == 1
    survivor = _worker(tmp_path, pg_url)
    restarted = _worker(tmp_path, pg_url)
    results = [_finish(survivor), _finish(restarted)]
    logs = "\n".join(f"--- rc {r}\n{o}\n{e}" for r, o, e in results)
    assert all(r == 0 for r, _, _ in results), logs
    study = _check_shared_study(tmp_path, pg_url, logs + out + err)
    failed = [t for t in study.trials if t.state == TrialState.FAIL]
    assert [t.number for t in failed if "dropped" not in t.user_attrs] == [killed[0].number]


def test_a_claim_goes_to_one_worker_and_is_taken_over_when_its_holder_dies(
        tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/s.db"
    study = optuna.create_study(study_name="s", storage=url)
    me = Worker.current()
    a, b = Claim(study, "job", me), Claim(study, "job", me)
    assert a.try_acquire() and not b.try_acquire()
    assert b.holder["worker"] == me.id and Claim(study, "job", me).peek()["worker"] == me.id
    a.release()
    assert Claim(study, "job", me).peek() is None and b.try_acquire()
    # a holder that died on this machine (its pid is gone) frees the claim at once
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    ghost = Worker(me.host, int(dead), me.node)
    g = Claim(study, "other", ghost)
    assert g.try_acquire()
    assert Claim(study, "other", me).try_acquire()
    names = [s.study_name for s in optuna.get_all_study_summaries(url)]
    assert sorted(n for n in names if is_claim(n)) == ["s~job", "s~job#2", "s~other",
                                                       "s~other#2"]


def test_a_claim_released_with_its_job_done_is_not_taken_again(tmp_path: Path) -> None:
    """A worker that read "no reference yet" just before the holder stored it and let go
    must read it again, not take the claim as `#2` (CI at stop 40 saw `reference#2`)."""
    url = f"sqlite:///{tmp_path}/s.db"
    study = optuna.create_study(study_name="s", storage=url)
    me = Worker.current()
    a, b = Claim(study, "job", me), Claim(study, "job", me)
    assert a.try_acquire()
    a.release(done=True)
    assert not b.try_acquire() and b.holder["done"] is True
    assert Claim(study, "job", me).peek() is None  # nobody holds it: it is done
    names = [s.study_name for s in optuna.get_all_study_summaries(url)]
    assert [n for n in names if is_claim(n)] == ["s~job"]


def test_shared_reads_the_result_again_when_its_holder_finished_meanwhile(
        tmp_path: Path, monkeypatch) -> None:
    """The race itself: the waiter's read of the study misses the result, the holder stores
    it and lets go, and only then does the waiter try the claim."""
    import nfabric_cli.calibration.workers as workers

    url = f"sqlite:///{tmp_path}/s.db"
    study = optuna.create_study(study_name="s", storage=url)
    me = Worker.current()
    holder = workers.WorkerLog(study, Worker(me.host, os.getppid(), me.node), 1)
    waiter = workers.WorkerLog(optuna.load_study(study_name="s", storage=url), me, 1)

    class Late(Claim):
        def try_acquire(self) -> bool:  # the holder runs its job between read and claim
            if self.worker == me and "job" not in study.user_attrs:
                holder.shared("job", lambda: {"by": "holder"}, lambda _: None)
            return super().try_acquire()

    monkeypatch.setattr(workers, "Claim", Late)
    waited: list[str] = []
    result = waiter.shared("job", lambda: {"by": "waiter"}, waited.append)
    assert result == {"by": "holder"} and waited == []
    names = [s.study_name for s in optuna.get_all_study_summaries(url)]
    assert [n for n in names if is_claim(n)] == ["s~job"]


def _cli(tmp_path: Path, *args: str, workload: bool = True):
    from typer.testing import CliRunner

    from nfabric_cli.app import app

    head = ["calibrate", TINY, "--spec", str(tmp_path / "spec.toml"), "--out",
            str(tmp_path / "out"), "--processes", "1"] if workload else ["calibrate"]
    return CliRunner().invoke(app, [*head, *args], env={"COLUMNS": "80"})


def test_status_shows_trials_best_workers_and_profile(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/s.db"
    _spec(tmp_path)
    res = _cli(tmp_path, "--storage", url, "--study", "shared", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    res = _cli(tmp_path, "--status", "--storage", url, "--study", "shared", "--json",
               workload=False)
    assert res.exit_code == 0, res.output
    state = json.loads(res.stdout)
    assert state["counts"]["complete"] + state["counts"]["pruned"] == BUDGET
    assert state["best"]["trial"] == doc["best"]["trial"]
    assert state["best"]["routes"] == doc["best"]["routes"]
    assert [(w["worker"], w["live"]) for w in state["workers"]] == [(Worker.current().id, False)]
    assert [p["path"] for p in state["profiles"]] == [doc["profile"]]
    assert state["reference"]["state"] == "done"
    human = _cli(tmp_path, "--status", "--storage", url, "--study", "shared", workload=False)
    assert human.exit_code == 0, human.output
    assert "best admissible on the search's own seed: trial" in human.stdout
    assert "tiny.v1.parquet" in human.stdout
    table_lines = [ln for ln in human.stdout.splitlines() if set(ln) & set("│┃━─")]
    assert table_lines and max(len(line) for line in table_lines) <= 80, human.stdout
    # a rerun of the complete study trains nothing and names the profile already written
    res = _cli(tmp_path, "--storage", url, "--study", "shared", "--json")
    again = json.loads(res.stdout)
    assert res.exit_code == 0 and again["profile"] == doc["profile"]
    assert len(list((tmp_path / "out" / "tiny").glob("*.parquet"))) == 1
    # into another --out it is written there (it named the first folder's file, exit 0); then
    # reported from there; and written again where the recorded one was moved away from
    other = _cli(tmp_path, "--storage", url, "--study", "shared", "--json", "--out",
                 str(tmp_path / "other"))
    assert other.exit_code == 0, other.output
    assert json.loads(other.stdout)["profile"] == str(tmp_path / "other" / "tiny" / "tiny.v1.parquet")
    again = _cli(tmp_path, "--storage", url, "--study", "shared", "--json", "--out",
                 str(tmp_path / "other"))
    assert json.loads(again.stdout)["profile"] == json.loads(other.stdout)["profile"]
    assert len(list((tmp_path / "other" / "tiny").glob("*.parquet"))) == 1
    for moved in ("moved", "moved-again"):  # twice: the second time it waited forever
        (tmp_path / "out").rename(tmp_path / moved)
        back = _cli(tmp_path, "--storage", url, "--study", "shared", "--json")
        assert back.exit_code == 0, back.output
        assert json.loads(back.stdout)["profile"] == doc["profile"]  # its name, written anew
        assert (tmp_path / "out" / "tiny" / "tiny.v1.parquet").is_file()
    missing = _cli(tmp_path, "--status", "--storage", url, "--study", "nope", workload=False)
    assert missing.exit_code == 2 and "no study 'nope'" in missing.output
    assert "its studies: shared" in missing.output  # claim studies are not listed
    alone = _cli(tmp_path, "--status", "--storage", url, workload=False)
    assert alone.exit_code == 2 and "--status needs --study NAME" in alone.output


def test_a_status_of_a_storage_that_does_not_exist_creates_none(tmp_path: Path,
                                                                monkeypatch) -> None:
    """`--status` only reads: a mistyped path left an empty database (or journal, or
    `.nfabric/studies.db` in the working directory) behind, then said it held no study."""
    monkeypatch.chdir(tmp_path)
    for url, shown in ((f"sqlite:///{tmp_path}/typo.db", "typo.db"),
                       (f"journal:{tmp_path}/typo.log", "typo.log"),
                       (None, ".nfabric/studies.db")):
        res = _cli(tmp_path, "--status", "--study", "x",
                   *(("--storage", url) if url else ()), workload=False)
        assert res.exit_code == 2 and "no storage at" in res.output and shown in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_no_write_worker_contributes_trials_only(tmp_path: Path) -> None:
    _spec(tmp_path)
    res = _cli(tmp_path, "--storage", f"sqlite:///{tmp_path}/s.db", "--json", "--no-write")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["profile"] is None and doc["written_by"] is None and doc["trials"] == BUDGET
    assert not (tmp_path / "out").exists()


def _cli_line(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    res = subprocess.run([sys.executable, "-m", "nfabric_cli", "calibrate", TINY, *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, **(env or {})})
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1, res.stdout + res.stderr
    return res.returncode, lines[0]


def test_wrong_password_and_unreachable_server_are_one_line_exit_2(pg_server) -> None:
    from tests.pgserver import PASSWORD

    code, line = _cli_line("--storage", pg_server.url("postgres", password="wrong-pw"))
    assert code == 2 and "password authentication failed" in line, line
    assert "cannot open storage postgresql://nfabric:***@127.0.0.1" in line
    assert "wrong-pw" not in line and PASSWORD not in line
    from tests.pgserver import _free_port

    code, line = _cli_line("--storage", pg_server.url("postgres", port=_free_port()))
    assert code == 2 and "cannot open storage" in line and PASSWORD not in line, line


def test_a_missing_postgresql_driver_says_what_to_install(tmp_path: Path) -> None:
    blocker = tmp_path / "sitecustomize.py"  # the driver modules cannot be imported
    blocker.write_text("import sys\nsys.modules['psycopg'] = None\nsys.modules['psycopg2'] = None\n")
    code, line = _cli_line("--storage", "postgresql://u:pw@127.0.0.1:1/db",
                           env={"PYTHONPATH": f"{tmp_path}:{ROOT}"})
    assert code == 2, line
    assert line.endswith("the PostgreSQL driver is not installed: pip install 'nfabric_cli[pg]'")
    assert ":pw@" not in line


def test_bad_liveness_settings_are_one_line_exit_2(tmp_path: Path) -> None:
    code, line = _cli_line("--storage", f"sqlite:///{tmp_path}/s.db",
                           env={"NFABRIC_GRACE_S": "soon"})
    assert code == 2 and "NFABRIC_GRACE_S must be a whole number of seconds >= 1" in line


def test_a_worker_waits_for_a_live_reference_holder_and_takes_over_when_it_stops(
        tmp_path: Path) -> None:
    import threading

    from nfabric_cli.calibration import run_study

    url = f"sqlite:///{tmp_path}/s.db"
    study = optuna.create_study(study_name="w", storage=url)
    for key, value in {"workload": "tiny", "search_key": tiny_spec().search_key(),
                       "spec": {}}.items():
        study.set_user_attr(key, value)
    me = Worker.current()
    other = Worker(me.host, os.getppid(), me.node)  # a live process of this machine
    held = Claim(study, "reference", other)
    assert held.try_acquire()
    sink = Notes()
    notes = sink.notes
    done: list = []
    thread = threading.Thread(target=lambda: done.append(
        run_study(get_workload(TINY), tiny_spec(trials=2), url, "w", sink)))
    thread.start()
    deadline = time.monotonic() + 60
    while not notes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert notes == [f"waiting for the FP32 reference: {other.id} is running it"]
    assert "reference" not in study.user_attrs
    held.release()  # the holder gave up without a reference: the waiter runs it itself
    thread.join(timeout=120)
    assert done and done[0].reference["worker"] == me.id
    assert len([t for t in done[0].study.trials if t.state == TrialState.COMPLETE]) == 2


def test_a_trial_of_a_silent_remote_worker_is_failed_after_the_grace_period(
        tmp_path: Path, monkeypatch) -> None:
    """Another machine's worker cannot be asked for its pid: its heartbeat decides (on every
    storage, the journal file too, which has no heartbeat of Optuna's)."""
    import nfabric_cli.calibration.storage as storage
    from nfabric_cli.calibration.workers import WORKER_PREFIX, fail_dead_trials

    monkeypatch.setattr(storage, "GRACE_S", 5)
    study = optuna.create_study(study_name="s",
                                storage=open_storage(f"journal:{tmp_path}/j.log"))
    remote = {"worker": "elsewhere:42", "host": "elsewhere", "pid": 42, "node": "other-node"}
    trial = study.ask()
    trial.set_user_attr("worker", "elsewhere:42")
    trial.set_user_attr("node", "other-node")
    me = Worker.current()
    study.set_user_attr(WORKER_PREFIX + "elsewhere:42", {**remote, "seen": time.time() - 1})
    assert fail_dead_trials(study, me) == [] and study.trials[0].state == TrialState.RUNNING
    study.set_user_attr(WORKER_PREFIX + "elsewhere:42", {**remote, "seen": time.time() - 6})
    assert fail_dead_trials(study, me) == [0] and study.trials[0].state == TrialState.FAIL


def test_an_outcome_counted_before_the_last_trial_finished_is_not_written(
        tmp_path: Path) -> None:
    """A worker that summed the study up while another's last trial ran, and looks again
    after it finished, must write the profile of all the trials, not of the ones it saw."""
    from nfabric_cli.binding.fingerprint import model_fingerprint
    from nfabric_cli.calibration import run_study
    from nfabric_cli.calibration.outcome import build_outcome
    from nfabric_cli.calibration.publish import publish

    url = f"sqlite:///{tmp_path}/s.db"
    wl = get_workload(TINY)
    run = run_study(wl, tiny_spec(trials=3), url, "p")
    fingerprint = model_fingerprint(wl.build_model(0))
    calls: list[int] = []

    def build():
        outcome = build_outcome(run, url, "p", fingerprint)
        if not calls:
            outcome.trials -= 1  # as seen while the last trial was still running
        calls.append(outcome.trials)
        return outcome

    outcome = publish(run, build, tmp_path / "out")
    assert calls == [2, 3] and outcome.path == tmp_path / "out" / "tiny" / "tiny.v1.parquet"
    assert [k for k in run.study.user_attrs if k.startswith("profile@")] == ["profile@3"]
    assert read_profile(outcome.path).meta["provenance"]["trials"] == 3


def test_a_trial_that_finishes_while_the_outcome_is_built_is_not_left_out(
        tmp_path: Path) -> None:
    """Building the outcome reads the study more than once: the winner from the completed
    trials, then the count. A trial that another worker finishes between the two reads must
    not give a profile of the other trials under the full count (CI, stop 39: the profile's
    routes were not the study's winner's)."""
    from nfabric_cli.binding.fingerprint import model_fingerprint
    from nfabric_cli.calibration import run_study
    from nfabric_cli.calibration.outcome import build_outcome
    from nfabric_cli.calibration.publish import publish

    url = f"sqlite:///{tmp_path}/s.db"
    wl = get_workload(TINY)
    run = run_study(wl, tiny_spec(trials=3), url, "p")
    study = run.study
    best = best_admissible(study, run.spec.tolerance)
    assert best is not None
    study.enqueue_trial(best.params)
    late = study.ask(fixed_distributions=best.distributions)  # another worker's, in flight
    late.set_user_attr("worker", "elsewhere:1")
    fingerprint = model_fingerprint(wl.build_model(0))

    def build():
        outcome = build_outcome(run, url, "p", fingerprint)
        if late.number not in {t.number for t in study.trials
                               if t.state == TrialState.COMPLETE}:
            # the other worker finishes its trial, cheaper than any, before the count is read
            for k in ("key", "metric", "degradation", "row_traffic", "curve"):
                if k in best.user_attrs:
                    late.set_user_attr(k, best.user_attrs[k])
            late.set_user_attr("traffic_fraction", best.user_attrs["traffic_fraction"] / 2)
            study.tell(late, best.values)
            outcome.trials += 1
        return outcome

    outcome = publish(run, build, tmp_path / "out")
    assert outcome.path is None and "1 trial(s) still running on elsewhere:1" in outcome.note
    assert not (tmp_path / "out").exists()
    outcome = publish(run, lambda: build_outcome(run, url, "p", fingerprint), tmp_path / "out")
    profile = read_profile(outcome.path)
    assert profile.meta["provenance"]["trials"] == 4
    assert profile.meta["provenance"]["winner_trial"] == late.number
