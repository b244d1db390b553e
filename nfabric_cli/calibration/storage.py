"""Where studies live: an embedded SQLite file by default, any Optuna storage URL otherwise.

- default: ``sqlite:///.nfabric/studies.db`` (the folder is created), no server needed;
- ``journal:PATH``: Optuna's journal file (append-only, safe for several local processes);
- any RDB URL (``postgresql://user:pw@host/db``, ``mysql://...``): many machines, one study.

RDB storages run a heartbeat, so a trial whose process was killed is marked failed when the
study is next opened (a resumed run loses at most the trial that was in flight). A study
records the workload and the spec hash it was made for; reopening it for another workload or
another spec is refused, since its trials would not be comparable.
"""

from __future__ import annotations

import json
import os
import random
import re
import time
import warnings
from pathlib import Path
from typing import Any

import optuna
from optuna.study import StudyDirection

from nfabric_cli.errors import InputError

DEFAULT_STORAGE = "sqlite:///.nfabric/studies.db"
JOURNAL_PREFIX = "journal:"
# A worker's liveness: Optuna's trial heartbeat and our worker records and claims beat every
# HEARTBEAT_S; after GRACE_S of silence a worker counts as dead. Operators may shorten both.
def _seconds(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise InputError(f"{name} must be a whole number of seconds >= 1, got {raw!r}")
    return int(raw)


HEARTBEAT_S = _seconds("NFABRIC_HEARTBEAT_S", 30)
GRACE_S = _seconds("NFABRIC_GRACE_S", 90)
DRIVERS = {"postgresql": "the PostgreSQL driver is not installed: pip install 'nfabric_cli[pg]'",
           "mysql": "the MySQL driver is not installed: pip install PyMySQL"}


def redact(url: str) -> str:
    """The URL with any password replaced by ***, for logs and provenance."""
    return re.sub(r"://([^:/@]+):[^@/]*@", r"://\1:***@", url)


def open_storage(url: str | None, create: bool = True) -> optuna.storages.BaseStorage:
    """Open (creating if needed, unless not `create`) the storage at `url`; InputError if it
    cannot be opened, or without `create` if its file does not exist (a status of a mistyped
    path left an empty database, or `.nfabric/` in the working directory, behind)."""
    url = url or DEFAULT_STORAGE
    if not create:
        path = _file_of(url)
        if path is not None and not path.is_file():
            raise InputError(f"no storage at {redact(url)}: {path} does not exist")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            if url.startswith(JOURNAL_PREFIX):
                path = Path(url[len(JOURNAL_PREFIX) :])
                if not path.parent.is_dir():
                    raise InputError(f"journal folder {path.parent} does not exist")
                _check_journal(path)
                from optuna.storages.journal import JournalFileBackend

                return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
            if url == DEFAULT_STORAGE:
                Path(".nfabric").mkdir(exist_ok=True)
            return _rdb(url)
    except InputError as exc:
        raise InputError(f"cannot open storage {redact(url)}: {exc}") from None
    except Exception as exc:  # sqlalchemy / driver errors come in many types
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if isinstance(exc, ImportError) or "Failed to import DB access module" in first:
            scheme = url.split(":", 1)[0].split("+", 1)[0]
            first = DRIVERS.get(scheme, f"{first.rstrip('.')} ({scheme})")
        raise InputError(f"cannot open storage {redact(url)}: {redact(first)}") from None


def _check_journal(path: Path) -> None:
    """Refuse a file that is not empty and not an Optuna journal (its first line a JSON
    record with an ``op_code``): Optuna would append a study to it, then fail to read it,
    so a mistyped path (the spec's, say) would be damaged."""
    if not path.exists():
        return
    if not path.is_file():
        raise InputError(f"{path} is not a file")
    with path.open("rb") as f:
        first = f.readline(1 << 20)
    if not first:
        return
    try:
        record = json.loads(first)
    except ValueError:
        record = None
    if not isinstance(record, dict) or "op_code" not in record:
        raise InputError(f"{path} is not an Optuna journal (its first line is not a journal "
                         "record); name a new file or an existing journal")


def _file_of(url: str) -> Path | None:
    """The file a journal or SQLite storage lives in; None for a server (or in-memory)."""
    if url.startswith(JOURNAL_PREFIX):
        return Path(url[len(JOURNAL_PREFIX) :])
    if url.startswith("sqlite:"):
        from sqlalchemy.engine import make_url

        try:
            database = make_url(url).database
        except Exception:  # a malformed URL: opening it says what is wrong
            return None
        return Path(database) if database and database != ":memory:" else None
    return None


def _rdb(url: str, attempts: int = 5) -> optuna.storages.RDBStorage:
    """Optuna's RDB storage. Workers started together on a fresh database race to create its
    tables (PostgreSQL: a unique violation in pg_type): the loser retries and finds them."""
    def connect() -> optuna.storages.RDBStorage:
        return optuna.storages.RDBStorage(url, heartbeat_interval=HEARTBEAT_S,
                                          grace_period=GRACE_S)

    for _ in range(attempts - 1):
        try:
            return connect()
        except Exception as exc:
            if "UniqueViolation" not in str(exc) and "already exists" not in str(exc):
                raise
            time.sleep(0.2 + random.random())
    return connect()


def load_or_create(
    storage: optuna.storages.BaseStorage,
    name: str,
    n_objectives: int,
    sampler: optuna.samplers.BaseSampler,
    pruner: optuna.pruners.BasePruner,
    attrs: dict[str, Any],
) -> tuple[optuna.Study, bool]:
    """(study, resumed). A resumed study must match `attrs` (workload, spec) and objectives."""
    try:
        existing = {s.study_name for s in optuna.study.get_all_study_summaries(storage)}
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InputError(f"cannot read studies from the storage: {first}") from None
    resumed = name in existing
    if not resumed:
        try:  # another worker may create it between the listing and here
            storage.create_new_study([StudyDirection.MINIMIZE] * n_objectives, name)
        except optuna.exceptions.DuplicatedStudyError:
            resumed = True
        else:
            sid = storage.get_study_id_from_name(name)
            for key, value in attrs.items():
                storage.set_study_user_attr(sid, key, value)
    study = optuna.load_study(study_name=name, storage=storage, sampler=sampler, pruner=pruner)
    if resumed:
        deadline = time.monotonic() + 10  # a worker that just created it is writing its attrs
        while _attrs_pending(study.user_attrs, attrs) and time.monotonic() < deadline:
            time.sleep(0.2)
        check_compatible(study, name, n_objectives, attrs)
    return study, resumed


def _attrs_pending(found: dict[str, Any], attrs: dict[str, Any]) -> bool:
    """Whether a resumed study's attrs may still be on their way: not yet all written, and
    nothing written so far already rules it out (another workload's study needs no wait)."""
    workload = found.get("workload", attrs["workload"])
    return "search_key" not in found and workload == attrs["workload"]


def check_compatible(study: optuna.Study, name: str, n_objectives: int, attrs: dict[str, Any]) -> None:
    found = study.user_attrs
    workload = found.get("workload")
    if workload != attrs["workload"]:
        raise InputError(
            f"study {name!r} belongs to workload {workload!r}, not {attrs['workload']!r}; "
            "pick another --study name"
        )
    # data first: a model sized by its data (lm's vocabulary) differs because the data does.
    # (a study from before these were stored holds neither: not known, not refused)
    for key, what, hint in (
        ("data", "other data", "this machine builds or reads other data than the study's "
         "(glyphs' images follow the CPU, lm's text the Python release): a worker joining the "
         "study needs the same data, or pick another --study name"),
        ("model", "another model", "its results are not this model's; pick another --study "
         "name"),
    ):
        if found.get(key) is not None and found[key] != attrs.get(key):
            raise InputError(f"study {name!r} was trained on {what} (fingerprint "
                             f"{str(found[key])[:12]}, here {str(attrs.get(key))[:12]}): {hint}")
    if len(study.directions) != n_objectives:
        kind = "multi-objective (nsga2)" if len(study.directions) > 1 else "single-objective"
        raise InputError(f"study {name!r} is {kind}; use a sampler of that kind or another --study")
    if found.get("search_key") != attrs["search_key"]:
        old, new = found.get("spec") or {}, attrs["spec"]
        changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        raise InputError(
            f"study {name!r} was run with a different calibration spec "
            f"(changed: {', '.join(changed) or 'unknown'}); pick another --study name"
        )
