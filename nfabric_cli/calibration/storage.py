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

import re
import warnings
from pathlib import Path
from typing import Any

import optuna

from nfabric_cli.errors import InputError

DEFAULT_STORAGE = "sqlite:///.nfabric/studies.db"
JOURNAL_PREFIX = "journal:"
HEARTBEAT_S = 30
GRACE_S = 90


def redact(url: str) -> str:
    """The URL with any password replaced by ***, for logs and provenance."""
    return re.sub(r"://([^:/@]+):[^@/]*@", r"://\1:***@", url)


def open_storage(url: str | None) -> optuna.storages.BaseStorage:
    """Open (creating if needed) the storage at `url`; InputError if it cannot be opened."""
    url = url or DEFAULT_STORAGE
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            if url.startswith(JOURNAL_PREFIX):
                path = Path(url[len(JOURNAL_PREFIX) :])
                if not path.parent.is_dir():
                    raise InputError(f"journal folder {path.parent} does not exist")
                from optuna.storages.journal import JournalFileBackend

                return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
            if url == DEFAULT_STORAGE:
                Path(".nfabric").mkdir(exist_ok=True)
            return optuna.storages.RDBStorage(
                url, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S
            )
    except InputError as exc:
        raise InputError(f"cannot open storage {redact(url)}: {exc}") from None
    except Exception as exc:  # sqlalchemy / driver errors come in many types
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InputError(f"cannot open storage {redact(url)}: {first}") from None


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
    study = optuna.create_study(
        storage=storage,
        study_name=name,
        sampler=sampler,
        pruner=pruner,
        directions=["minimize"] * n_objectives,
        load_if_exists=True,
    )
    if resumed:
        check_compatible(study, name, n_objectives, attrs)
    else:
        for key, value in attrs.items():
            study.set_user_attr(key, value)
    return study, resumed


def check_compatible(study: optuna.Study, name: str, n_objectives: int, attrs: dict[str, Any]) -> None:
    found = study.user_attrs
    workload = found.get("workload")
    if workload != attrs["workload"]:
        raise InputError(
            f"study {name!r} belongs to workload {workload!r}, not {attrs['workload']!r}; "
            "pick another --study name"
        )
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
