"""Read a recorded bucket trace (`runtime/trace.py`) and group its rows for replay.

A trace directory holds `trace.json` (format "nfabric-trace", version, world size, backend),
`buckets-rank<R>.parquet` per rank and `payloads/*.npy`. Replay needs each distinct
(route spec, elements, segments) group once, with the seconds the run measured for it and the
payload samples recorded for it (ordered by step, then rank, so cycling them over replay ranks
is deterministic). Everything that makes a directory unusable is one `InputError` line.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from nfabric_cli.errors import InputError
from nfabric_cli.routes.spec import RouteSpec
from nfabric_cli.runtime.trace import TRACE_VERSION
from nfabric_cli.textfiles import read_json

TRACE_FORMAT = "nfabric-trace"
_COLUMNS = ("rank", "step", "route", "spec", "numel", "segments", "seconds", "payload")


@dataclass(frozen=True)
class TraceGroup:
    """One distinct (route spec, elements, segments) of the trace and what the run measured.

    ``recorded_s`` is the median of the run's per-rank, per-step seconds for this group (the
    runtime's own timer around `route.reduce`); ``payloads`` are paths relative to the trace
    directory, ordered by (step, rank).
    """

    spec: RouteSpec
    numel: int
    segments: tuple[int, ...]
    rows: int
    recorded_s: float
    payloads: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return self.spec.label()


@dataclass(frozen=True)
class Trace:
    """A loaded trace directory: its metadata and its groups, largest first."""

    directory: Path
    version: str
    world_size: int
    backend: str
    groups: tuple[TraceGroup, ...] = field(default_factory=tuple)


def load_trace(directory: str | Path) -> Trace:
    """Load and check a trace directory (see module doc); bad input raises `InputError`."""
    d = Path(directory)
    if not d.exists():
        raise InputError(f"trace directory not found: {d}")
    if not d.is_dir():
        raise InputError(f"{d} is not a directory (expected a trace directory)")
    meta = _read_meta(d)
    files = sorted(d.glob("buckets-rank*.parquet"))
    if not files:
        raise InputError(f"{d}: no buckets-rank*.parquet files (an empty or partial trace)")
    ranks = {f"buckets-rank{r}.parquet" for r in range(meta["world_size"])}
    stale = sorted(f.name for f in files if f.name not in ranks)
    if stale:  # another recording's, which would be fitted in with this one's
        raise InputError(f"{d}: {', '.join(stale)} lie beyond trace.json's world size "
                         f"{meta['world_size']} (left by another recording?): record into an "
                         "empty folder")
    rows: list[dict] = []
    for f in files:
        try:
            table = pq.read_table(f)
        except Exception as exc:  # pyarrow raises several types for a bad file
            raise InputError(f"{f}: not a readable Parquet file ({exc})") from None
        missing = [c for c in _COLUMNS if c not in table.column_names]
        if missing:
            raise InputError(f"{f}: not a bucket trace (missing column(s) {', '.join(missing)})")
        rows.extend(table.select(list(_COLUMNS)).to_pylist())
    if not rows:
        raise InputError(f"{d}: the trace has no bucket records")
    return Trace(d, meta["version"], meta["world_size"], meta.get("backend", "gloo"),
                 _group(rows, d))


def load_payload(
    trace_dir: Path, relpath: str, numel: int, mmap: bool = False
) -> tuple[np.ndarray | None, str]:
    """(float32 samples, "") or (None, why the sample cannot be used).

    A sample that is missing, unreadable or of another size than its row is unusable; replay
    then feeds random data of the recorded size and reports why. (A size mismatch happens when
    two route groups of one bucket and step wrote the same payload file name.)
    `mmap=True` only checks the file (its array stays on disk)."""
    path = trace_dir / relpath
    if not path.is_file():
        return None, f"{relpath}: missing"
    try:
        arr = np.load(path, allow_pickle=False, mmap_mode="r" if mmap else None)
    except (ValueError, OSError) as exc:
        return None, f"{relpath}: not a readable .npy payload ({exc})"
    if arr.size != numel:
        return None, f"{relpath}: {arr.size} elements, but its trace row says {numel}"
    if mmap:
        return arr, ""
    return np.ascontiguousarray(arr.reshape(-1), dtype=np.float32), ""


def _read_meta(d: Path) -> dict:
    path = d / "trace.json"
    if not path.is_file():
        raise InputError(f"{d}: not an nfabric trace (no trace.json)")
    meta = read_json(path, "trace metadata")
    if not isinstance(meta, dict) or meta.get("format") != TRACE_FORMAT:
        raise InputError(f"{d}: not an nfabric trace (trace.json format is not {TRACE_FORMAT!r})")
    version = str(meta.get("version", ""))
    if version.split(".")[0] != TRACE_VERSION.split(".")[0]:
        raise InputError(
            f"{d}: trace version {version or '?'} is incompatible "
            f"(this nfabric reads {TRACE_VERSION.split('.')[0]}.x)"
        )
    world = meta.get("world_size")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise InputError(f"{path}: world_size must be an integer >= 1, got {world!r}")
    meta["version"] = version
    return meta


def _group(rows: list[dict], d: Path) -> tuple[TraceGroup, ...]:
    by_key: dict[tuple[str, int, tuple[int, ...]], list[dict]] = {}
    for row in rows:
        key = (row["spec"], int(row["numel"]), tuple(int(s) for s in row["segments"] or ()))
        by_key.setdefault(key, []).append(row)
    groups = []
    for (spec_json, numel, segments), members in by_key.items():
        try:
            spec = RouteSpec.from_dict(json.loads(spec_json))
        except (json.JSONDecodeError, TypeError) as exc:
            raise InputError(f"{d}: bad route spec {spec_json!r} in the trace ({exc})") from None
        if sum(segments) != numel:
            raise InputError(f"{d}: segments {list(segments)} do not add up to numel {numel}")
        members.sort(key=lambda r: (r["step"], r["rank"]))
        payloads = tuple(r["payload"] for r in members if r["payload"])
        seconds = statistics.median(float(r["seconds"]) for r in members)
        groups.append(TraceGroup(spec, numel, segments, len(members), seconds, payloads))
    groups.sort(key=lambda g: (-g.numel, g.label, g.segments))
    return tuple(groups)
