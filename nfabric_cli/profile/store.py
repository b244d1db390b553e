"""Versioned profile store: `profiles/<workload>/<workload>.v<N>.parquet`, newest N wins.

`write_profile` is atomic and byte-deterministic; `read_profile` validates what it reads and
refuses a newer major schema version.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pyarrow as pa

from nfabric_cli.errors import InputError
from nfabric_cli.profile.operating import ROW_FIELDS, OperatingProfile, ProfileRow
from nfabric_cli.profile.parquet import read_metadata, read_table, write_table
from nfabric_cli.profile.provenance import calibrated
from nfabric_cli.profile.schema import (
    PROFILE_COLUMN_DEFAULTS,
    PROFILE_SCHEMA,
    SCHEMA_VERSION,
    zeros_as_written,
)

_REQUIRED = ("region", "phase", "phase_start", "phase_end", "priority", "route")
_VERSIONED = re.compile(r"^(?P<workload>.+)\.v(?P<n>\d+)\.parquet$")


def profile_table(profile: OperatingProfile) -> pa.Table:
    rows = profile.sorted_rows()
    return pa.table(
        {name: [getattr(r, name) for r in rows] for name in PROFILE_SCHEMA.names},
        schema=PROFILE_SCHEMA,
    )


def write_profile(profile: OperatingProfile, path: str | os.PathLike[str],
                  exclusive: bool = False) -> Path:
    """Validate and write `profile` (rows sorted by phase start, priority) atomically
    (`exclusive`: FileExistsError rather than replace an existing file)."""
    profile.validate()
    meta = {**profile.meta, "schema_version": SCHEMA_VERSION}
    write_table(path, profile_table(profile), "profile", meta, exclusive)
    return Path(path)


def write_next_version(profile: OperatingProfile, root: str | os.PathLike[str],
                       workload: str) -> Path:
    """Write `profile` as `root/<workload>/<workload>.v<N+1>.parquet`; two writers racing for
    the same N never overwrite each other: the later one takes N+2."""
    while True:
        path = next_profile_path(root, workload)
        try:
            return write_profile(profile, path, exclusive=True)
        except FileExistsError:
            continue


def read_profile(path: str | os.PathLike[str]) -> OperatingProfile:
    """Read and validate a profile file (InputError on anything unusable)."""
    table, meta = read_table(
        path, "profile", PROFILE_SCHEMA, SCHEMA_VERSION, PROFILE_COLUMN_DEFAULTS
    )
    rows = []
    for record in table.to_pylist():
        missing = [k for k in _REQUIRED if record[k] is None]
        if missing:
            raise InputError(f"{path}: a row has no {', '.join(missing)}")
        record["zeros"] = zeros_as_written(record["route"], record["zeros"],
                                           meta["schema_version"])
        rows.append(ProfileRow(**{k: record[k] for k in ROW_FIELDS}))
    try:
        return OperatingProfile(rows, meta).validate()
    except InputError as exc:
        raise InputError(f"{path}: {exc}") from None


def is_calibrated(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a profile `nfabric calibrate` wrote (its provenance says so): hours
    of search and confirmation that a hand-written profile must not replace unasked."""
    kind, meta = read_metadata(path)
    return kind == "profile" and calibrated(meta)


def profile_version_of(path: str | os.PathLike[str]) -> tuple[str, int] | None:
    """(workload, N) from a file named `<workload>.v<N>.parquet`, else None."""
    m = _VERSIONED.match(Path(path).name)
    return (m.group("workload"), int(m.group("n"))) if m else None


def resolve_profile(path_or_dir: str | os.PathLike[str]) -> Path:
    """A file path as given; a directory -> its newest `<workload>.v<N>.parquet`."""
    p = Path(path_or_dir)
    if not p.exists():
        raise InputError(f"{p}: no such file or directory")
    if not p.is_dir():
        return p
    found = [(v, f) for f in p.iterdir() if f.is_file() and (v := profile_version_of(f))]
    if not found:
        raise InputError(f"{p}: no <workload>.v<N>.parquet profile in this directory")
    newest = max(n for (_, n), _ in found)
    best = sorted(f for (_, n), f in found if n == newest)
    if len(best) > 1:
        names = ", ".join(f.name for f in best)
        raise InputError(
            f"{p}: several workloads share the newest version ({names}); name one file"
        )
    return best[0]


def next_profile_path(root: str | os.PathLike[str], workload: str) -> Path:
    """`root/<workload>/<workload>.v<N+1>.parquet` where N is the newest existing version."""
    if not workload or "/" in workload or workload.startswith("."):
        raise InputError(f"bad workload name for a profile path: {workload!r}")
    folder = Path(root) / workload
    versions = [0]
    if folder.is_dir():
        for f in folder.iterdir():
            v = profile_version_of(f)
            if v is not None and v[0] == workload:
                versions.append(v[1])
    return folder / f"{workload}.v{max(versions) + 1}.parquet"
