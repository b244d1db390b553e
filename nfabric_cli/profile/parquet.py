"""Deterministic, atomic Parquet I/O shared by profiles and bindings.

Both artefacts are one table plus JSON metadata under ``nfabric.*`` keys. Writes use fixed
writer options, no pandas metadata and JSON with sorted keys, so the same content always
gives the same bytes (a `git diff` on a committed profile means the decisions changed).
Reads turn every way a file can be unusable into one `InputError` line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from nfabric_cli.atomic import atomic_path
from nfabric_cli.errors import InputError

META_PREFIX = "nfabric."
KIND_KEY = META_PREFIX + "kind"
KINDS: tuple[str, ...] = ("profile", "bindings")

# Fixed writer options: changing any of these changes bytes, so they are part of the format.
_WRITE_OPTIONS: dict[str, Any] = {
    "compression": "zstd",
    "compression_level": 3,
    "use_dictionary": False,
    "write_statistics": False,
    "version": "2.6",
    "data_page_version": "1.0",
    "store_schema": True,  # False would drop our key-value metadata too
}


def parse_semver(text: str) -> tuple[int, int, int]:
    try:
        major, minor, patch = (int(x) for x in str(text).split("."))
    except ValueError:
        raise InputError(f"bad schema version {text!r} (expected MAJOR.MINOR.PATCH)") from None
    return major, minor, patch


def check_schema_version(path: str | os.PathLike[str], found: str | None, supported: str) -> None:
    """Refuse a file whose major schema version is newer than this reader's."""
    if found is None:
        raise InputError(f"{path}: no schema_version in the file metadata")
    if parse_semver(found)[0] > parse_semver(supported)[0]:
        raise InputError(
            f"{path}: schema version {found} is newer than this nfabric reads ({supported}); "
            "upgrade nfabric_cli to read it"
        )


def write_table(
    path: str | os.PathLike[str], table: pa.Table, kind: str, meta: dict[str, Any],
    exclusive: bool = False,
) -> None:
    """Write `table` with `meta` as ``nfabric.<key>`` JSON values, atomically and reproducibly
    (`exclusive`: FileExistsError rather than replace an existing file)."""
    if kind not in KINDS:
        raise ValueError(f"unknown artefact kind {kind!r}")
    kv = {KIND_KEY: kind}
    for key in sorted(meta):
        kv[META_PREFIX + key] = json.dumps(meta[key], sort_keys=True, separators=(",", ":"))
    table = table.replace_schema_metadata(kv)
    with atomic_path(path, exclusive) as tmp:
        pq.write_table(table, tmp, **_WRITE_OPTIONS)


def _open(path: str | os.PathLike[str]) -> pq.ParquetFile:
    p = Path(path)
    if not p.exists():
        raise InputError(f"{p}: no such file")
    if p.is_dir():
        raise InputError(f"{p}: is a directory, expected a Parquet file")
    try:
        return pq.ParquetFile(p)
    except (pa.ArrowException, OSError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError(f"{p}: not a readable Parquet file ({first})") from None


def read_metadata(path: str | os.PathLike[str]) -> tuple[str, dict[str, Any]]:
    """(kind, meta) of an nfabric Parquet file, without reading its rows."""
    raw = _open(path).schema_arrow.metadata or {}
    try:
        kv = {k.decode(): v.decode() for k, v in raw.items()}
    except UnicodeDecodeError:
        raise InputError(f"{path}: its metadata is not UTF-8 text") from None
    kind = kv.get(KIND_KEY)
    if kind not in KINDS:
        raise InputError(f"{path}: a Parquet file, but not an nfabric profile or bindings file")
    meta: dict[str, Any] = {}
    for key, value in kv.items():
        if key.startswith(META_PREFIX) and key != KIND_KEY:
            try:
                meta[key[len(META_PREFIX) :]] = json.loads(value)
            except json.JSONDecodeError:
                raise InputError(f"{path}: metadata {key} is not valid JSON") from None
    return kind, meta


def read_table(
    path: str | os.PathLike[str],
    kind: str,
    schema: pa.Schema,
    supported_version: str,
    defaults: dict[str, Any],
) -> tuple[pa.Table, dict[str, Any]]:
    """Read an artefact of `kind` conformed to `schema`.

    The schema version is checked before any row is read (a newer major may have changed
    them). Columns a file lacks (older minor versions) are filled from `defaults` (or nulls);
    unknown columns (newer minors) are dropped.
    """
    found, meta = read_metadata(path)
    if found != kind:
        raise InputError(f"{path}: is a {found} file, expected a {kind} file")
    check_schema_version(path, meta.get("schema_version"), supported_version)
    try:
        table = _open(path).read()
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"{path}: cannot read rows ({str(exc).splitlines()[0]})") from None
    columns = []
    for fld in schema:
        if fld.name in table.column_names:
            col = table.column(fld.name)
        else:
            col = pa.array([defaults.get(fld.name)] * table.num_rows, type=fld.type)
        try:
            columns.append(col.cast(fld.type))
        except (pa.ArrowException, ValueError):
            raise InputError(
                f"{path}: column {fld.name!r} has type {col.type}, expected {fld.type}"
            ) from None
    conformed = pa.Table.from_arrays(columns, schema=schema.remove_metadata())
    return conformed, meta
