"""Several `nfabric calibrate` workers on one study: every piece of work is done once.

Workers share nothing but the Optuna storage (PostgreSQL for many machines). What they must
agree on, and how they do it with what every Optuna storage offers:

- **The budget.** `spec.trials` is the study's total. A trial is *surplus* when the study held
  that many finished or running trials before it was created (RDB storages number trials under
  a lock on the study row, so the count is exact); a surplus trial is dropped untrained.
- **Claims.** The FP32 reference and each profile write are claimed by creating a study named
  `<study>~<job>`: study names are unique in every storage, so exactly one creation succeeds.
  The holder refreshes a heartbeat on it; a claim whose holder is gone, or that its holder
  gave up, is taken over as `<job>#2`, `#3`, ...; one released with its job done is not, so a
  worker that read "not done yet" just before the holder stored the result reads it again.
- **Liveness.** A running trial or claim whose worker is gone is failed or taken over: after
  `GRACE_S` without a heartbeat (`storage.py`: the worker's record and claims beat on every
  storage, the journal file included, which has no heartbeat of Optuna's; RDB storages also
  run Optuna's trial heartbeat), or at once when the worker ran in this machine's process
  namespace and its pid no longer exists.
- **The same configuration twice.** A trial whose configuration a live trial is training waits
  for it, then reuses its result; an enqueued sweep or seed trial that another trial already
  holds is a duplicate of two workers enqueueing at once, and is dropped untrained.

Dropped trials end FAIL with a `dropped` user attribute saying why; they do not count toward
the budget. Each worker records itself in the study's user attributes (`worker:<host>:<pid>`)
with what it is doing, so `nfabric calibrate --status` and optuna-dashboard show who runs what.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from nfabric_cli.calibration import storage as _storage
from nfabric_cli.calibration.choice import REPAIR

COUNTED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)
WORKER_PREFIX = "worker:"
CLAIM_SEP = "~"
POLL_S = 1.0


class Dropped(Exception):
    """A trial this worker must not train (surplus or a duplicate); it ends FAIL."""


def _node() -> str:
    """Kernel boot and pid namespace: two pids are comparable only within one node."""
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


@dataclass(frozen=True)
class Worker:
    """One calibrate process: `host:pid` names it; `node` tells whether its pid is checkable."""

    host: str
    pid: int
    node: str

    @property
    def id(self) -> str:
        return f"{self.host}:{self.pid}"

    @classmethod
    def current(cls) -> Worker:
        return cls(socket.gethostname(), os.getpid(), _node())

    def record(self) -> dict[str, Any]:
        return {"worker": self.id, "host": self.host, "pid": self.pid, "node": self.node}

    def tag(self, trial: optuna.Trial) -> None:
        """Mark `trial` as this worker's (its record in the study says where it runs)."""
        trial.set_user_attr("worker", self.id)

    def gone(self, record: dict[str, Any]) -> bool:
        """True when `record` names a process of this node that no longer exists."""
        if not self.node or record.get("node") != self.node:
            return False
        try:
            pid = int(record.get("pid") or str(record.get("worker", "")).rsplit(":", 1)[1])
        except (IndexError, ValueError):
            return False
        if pid == self.pid:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


def stale(record: dict[str, Any], now: float | None = None) -> bool:
    seen = record.get("seen")
    return seen is not None and (now or time.time()) - float(seen) > _storage.GRACE_S


def worker_gone(record: dict[str, Any], me: Worker, now: float | None = None) -> bool:
    """A worker record's worker is gone: stopped, silent past the grace period, or a dead
    process of this node."""
    return record.get("doing") == "stopped" or stale(record, now) or me.gone(record)


class Claim:
    """An exclusive job among the workers of one study (see the module docstring)."""

    def __init__(self, study: optuna.Study, job: str, worker: Worker) -> None:
        self.storage = study._storage
        self.base = f"{study.study_name}{CLAIM_SEP}{job}"
        self.worker = worker
        self.held: int | None = None  # study id of the claim this worker holds
        self.holder: dict[str, Any] = {}  # the live holder's record when another has it
        self._first_empty: dict[int, float] = {}

    def _name(self, generation: int) -> str:
        return self.base if generation == 1 else f"{self.base}#{generation}"

    def try_acquire(self) -> bool:
        """True if this worker now holds the job; False (with `holder` set) if a live
        worker holds it or one has done it (`holder["done"]`)."""
        generation = 1
        while True:
            name = self._name(generation)
            try:
                sid = self.storage.create_new_study([StudyDirection.MINIMIZE], name)
            except optuna.exceptions.DuplicatedStudyError:
                sid = self.storage.get_study_id_from_name(name)
                record = self.storage.get_study_user_attrs(sid)
                if self._free(sid, record):
                    generation += 1
                    continue
                self.holder = record
                return False
            self.held = sid
            self.refresh()
            return True

    def _free(self, sid: int, record: dict[str, Any]) -> bool:
        if record.get("done"):
            return False
        if record.get("released") or stale(record) or self.worker.gone(record):
            return True
        if not record:  # created but never written: its creator died at once
            first = self._first_empty.setdefault(sid, time.time())
            return time.time() - first > _storage.GRACE_S
        return False

    def peek(self) -> dict[str, Any] | None:
        """The live holder's record, without claiming anything; None if nobody holds it."""
        generation = 1
        while True:
            try:
                sid = self.storage.get_study_id_from_name(self._name(generation))
            except KeyError:
                return None
            record = self.storage.get_study_user_attrs(sid)
            if record.get("done"):
                return None
            if not self._free(sid, record):
                return record
            generation += 1

    def refresh(self) -> None:
        if self.held is not None:
            for key, value in {**self.worker.record(), "seen": time.time()}.items():
                self.storage.set_study_user_attr(self.held, key, value)

    def release(self, done: bool = False) -> None:
        """Give the claim up; `done`: its job is finished and stored, nobody takes it over."""
        if self.held is not None:
            self.storage.set_study_user_attr(self.held, "done" if done else "released", True)
            self.held = None


def is_claim(study_name: str) -> bool:
    return CLAIM_SEP in study_name


class WorkerLog:
    """This worker's record in the study (what it does, when last seen), refreshed with the
    claims it holds by one heartbeat thread."""

    def __init__(self, study: optuna.Study, worker: Worker, budget: int) -> None:
        self.study = study
        self.worker = worker
        self.key = WORKER_PREFIX + worker.id
        self.started = time.time()
        self.budget = budget
        self.doing = "starting"
        self.claims: list[Claim] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def set(self, doing: str) -> None:
        self.doing = doing
        self.write()

    def write(self) -> None:
        with self._lock:
            record = {**self.worker.record(), "started": self.started, "seen": time.time(),
                      "budget": self.budget, "doing": self.doing}
            self.study.set_user_attr(self.key, record)
            for claim in list(self.claims):
                claim.refresh()

    def _beat(self) -> None:
        while not self._stop.wait(_storage.HEARTBEAT_S):
            with contextlib.suppress(Exception):  # a missed beat is retried, never fatal
                self.write()

    @contextlib.contextmanager
    def running(self) -> Iterator[WorkerLog]:
        self.write()
        self._thread = threading.Thread(target=self._beat, name="nfabric-worker-heartbeat",
                                        daemon=True)
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join(timeout=5)
            with contextlib.suppress(Exception):
                self.set("stopped")

    def shared(self, job: str, compute: Callable[[], dict[str, Any]],
               on_wait: Callable[[str], None]) -> dict[str, Any]:
        """The result the study stores under the user attribute `job`; else computed here,
        under a claim on `job` the heartbeat keeps alive, and stored, while other workers wait
        (`on_wait(holder)` once per holder). A claim whose holder died is taken over."""
        claim = Claim(self.study, job, self.worker)
        told, reread = None, False
        while (result := self.study.user_attrs.get(job)) is None:
            if claim.try_acquire():
                with self.holding(claim):
                    result = self.study.user_attrs.get(job)  # stored while we claimed
                    if result is None:
                        self.set(job)
                        result = compute()
                        self.study.set_user_attr(job, result)
                    claim.release(done=True)
                return result
            holder = claim.holder.get("worker", "another worker")
            if claim.holder.get("done") and not reread:
                reread = True  # stored since we read the study: read it again, at once
                continue  # (once: a done claim whose result is missing is waited on)
            if told != holder:
                told = holder
                on_wait(holder)
                self.set(f"waiting for {job} ({holder})")
            time.sleep(POLL_S)
        return result

    @contextlib.contextmanager
    def holding(self, claim: Claim) -> Iterator[Claim]:
        self.claims.append(claim)
        try:
            yield claim
        finally:
            self.claims.remove(claim)
            claim.release()


def fail_dead_trials(study: optuna.Study, worker: Worker) -> list[int]:
    """Fail running trials whose worker is gone: stale heartbeats (Optuna's on RDB storages;
    our worker records on every storage, the journal file included) and trials of processes
    of this node that no longer exist. Returns their numbers."""
    if isinstance(study._storage, optuna.storages.RDBStorage):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)
    failed = []
    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    records = study.user_attrs if running else {}
    now = time.time()
    for t in running:
        record = records.get(WORKER_PREFIX + str(t.user_attrs.get("worker")))
        if not isinstance(record, dict):
            continue  # a trial of a worker that kept no record: Optuna's heartbeat decides
        if worker_gone(record, worker, now):
            with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
                if study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL):
                    failed.append(t.number)
    return failed


def counted(study: optuna.Study) -> list[FrozenTrial]:
    """Trials that use the budget: finished ones and those in flight."""
    return study.get_trials(deepcopy=False, states=COUNTED)


def budgeted(trials: list[FrozenTrial]) -> int:
    """How many of `trials` use the budget: all but confirmation's repairs (`repair.py`)."""
    return sum(1 for t in trials if t.user_attrs.get("kind") != REPAIR)


def budget_reached(study: optuna.Study, budget: int, worker: Worker) -> bool:
    """True when the study's finished and live running trials fill `budget` (liveness is
    checked only when the count says so: it costs a read of every worker record)."""
    if budgeted(counted(study)) < budget:
        return False
    return not fail_dead_trials(study, worker) or budgeted(counted(study)) >= budget


def surplus(trials: list[FrozenTrial], trial: optuna.Trial, budget: int) -> bool:
    """True when `trials` (`counted`) held `budget` trials of the budget older than this one."""
    return budgeted([t for t in trials if t.number < trial.number]) >= budget


#: what names an enqueued trial's job
ENQUEUED_ID = {"sweep": "region", "derived": "key", "warm": "key", REPAIR: "key"}


def duplicate_of(trials: list[FrozenTrial], trial: optuna.Trial, kind: str) -> int | None:
    """An enqueued trial's twin: a lower-numbered trial of the same job (a sweep region, a
    seed's key, both set when enqueued) among `trials` (`counted`), because two workers
    enqueued it at once. Its number, or None."""
    field = ENQUEUED_ID.get(kind)
    if field is None:
        return None
    mine = trial.user_attrs.get(field)
    for t in trials:
        a = t.user_attrs
        if t.number < trial.number and a.get("kind") == kind and a.get(field) == mine:
            return t.number
    return None


def training_same(trials: list[FrozenTrial], trial: optuna.Trial, key: str) -> FrozenTrial | None:
    """The lowest-numbered running trial of `trials`, older than this one, with the same
    configuration."""
    same = [t for t in trials if t.state == TrialState.RUNNING and t.number < trial.number
            and t.user_attrs.get("key") == key]
    return min(same, key=lambda t: t.number) if same else None


def wait_for_same(study: optuna.Study, trials: list[FrozenTrial], trial: optuna.Trial, key: str,
                  worker: Worker, on_wait: Any = None) -> int | None:
    """Wait while an older live trial trains this configuration (`trials`: the study's
    `counted` trials as last read); its number, or None if there was none. The caller then
    reuses its result if it completed."""
    waited = None
    while (other := training_same(trials, trial, key)) is not None:
        if waited != other.number:
            waited = other.number
            if on_wait is not None:
                on_wait(other)
        time.sleep(POLL_S)
        fail_dead_trials(study, worker)
        trials = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    return waited


def live_workers(user_attrs: dict[str, Any], me: Worker) -> list[dict[str, Any]]:
    """The worker records in a study's `user_attrs`, each with `live` (not `worker_gone`)."""
    now = time.time()
    out = [{**record, "live": not worker_gone(record, me, now)}
           for key, record in user_attrs.items()
           if key.startswith(WORKER_PREFIX) and isinstance(record, dict)]
    return sorted(out, key=lambda r: r.get("started", 0))


def finished_by(study: optuna.Study, worker: Worker) -> int:
    """Finished trials of `study` that `worker` ran."""
    return sum(1 for t in study.get_trials(deepcopy=False, states=FINISHED)
               if t.user_attrs.get("worker") == worker.id)
