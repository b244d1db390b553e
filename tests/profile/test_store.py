"""The profile store: every column and metadata field round-trips, writes are deterministic
and atomic, unusable files are refused with one clear line."""

from __future__ import annotations

import json
import random
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nfabric_cli.errors import InputError
from nfabric_cli.profile import (
    SCHEMA_VERSION,
    OperatingProfile,
    ProfileRow,
    next_profile_path,
    read_profile,
    resolve_profile,
    write_profile,
)
from nfabric_cli.profile.parquet import write_table
from nfabric_cli.profile.schema import PROFILE_SCHEMA
from nfabric_cli.profile.store import profile_table

META = {
    "profile_version": 3,
    "workload": "vision",
    "model_fingerprint": "0123456789abcdef",
    "world_size": 8,
    "substrate": {"link_gbps": 10.0, "latency_us": 5.0, "endpoint_gbps": 25.0},
    "health": {"loss_spike": 3.0, "cooldown": 10},
    "target": {
        "metric": "accuracy",
        "reference": 0.61,
        "tolerance": 0.01,
        "higher_is_better": True,
    },
    "provenance": {
        "seed": 7,
        "sampler": "tpe",
        "pruner": "hyperband",
        "trials": 40,
        "budget": "60s",
        "packages": {"torch": "2.13.0"},
        "git_revision": "abc123",
        "data_fingerprint": "feed",
    },
}


def full_profile() -> OperatingProfile:
    """Two phases; every column set to a non-default value somewhere."""
    rows = [
        ProfileRow("head.*", "warmup", 0.0, 0.25, 0, "fp32"),
        ProfileRow(
            "*",
            "warmup",
            0.0,
            0.25,
            1,
            "int8",
            chunk=1024,
            rounding="stochastic",
            traffic_fraction=0.27,
            metric_delta=-0.002,
            trials=12,
        ),
        ProfileRow("head.*", "main", 0.25, 1.0, 0, "bf16", error_feedback=True),
        ProfileRow(
            "type:LayerNorm",
            "main",
            0.25,
            1.0,
            1,
            "ternary",
            tau=0.35,
            reducer="central",
            traffic_fraction=0.06,
            metric_delta=0.001,
            trials=30,
        ),
        ProfileRow(
            "*",
            "main",
            0.25,
            1.0,
            2,
            "sign",
            error_feedback=True,
            mode="count",
            traffic_fraction=0.036,
            metric_delta=-0.008,
            trials=30,
        ),
    ]
    return OperatingProfile(rows, dict(META))


def test_round_trip_every_column_and_metadata_field(tmp_path):
    prof = full_profile()
    write_profile(prof, tmp_path / "p.parquet")
    back = read_profile(tmp_path / "p.parquet")
    assert back.rows == prof.sorted_rows()
    assert back.meta == {**META, "schema_version": SCHEMA_VERSION}
    assert back.rows[1].spec().rounding == "stochastic" and back.rows[4].spec().mode == "count"
    assert [p.name for p in back.phases()] == ["warmup", "main"]
    assert [r.region for r in back.rules("main")] == ["head.*", "type:LayerNorm", "*"]


def test_same_content_same_bytes_whatever_row_order(tmp_path):
    prof = full_profile()
    shuffled = list(prof.rows)
    random.Random(1).shuffle(shuffled)
    write_profile(prof, tmp_path / "a.parquet")
    write_profile(
        OperatingProfile(shuffled, dict(reversed(list(META.items())))), tmp_path / "b.parquet"
    )
    assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()
    kv = pq.ParquetFile(tmp_path / "a.parquet").schema_arrow.metadata
    assert b"pandas" not in kv
    assert json.loads(kv[b"nfabric.target"]) == META["target"]


def test_atomic_write_keeps_old_file_on_failure(tmp_path):
    path = tmp_path / "p.parquet"
    write_profile(full_profile(), path)
    before = path.read_bytes()
    bad = OperatingProfile(
        [ProfileRow("*", "all", 0.0, 0.5, 0, "sign")], {}
    )  # does not cover [0, 1]
    with pytest.raises(InputError, match=r"phases must cover \[0, 1\]"):
        write_profile(bad, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["p.parquet"]


def _raw_write(path, table, meta):
    write_table(path, table, "profile", meta)


def test_newer_major_refused_naming_both_versions(tmp_path):
    prof = full_profile()
    _raw_write(
        tmp_path / "p.parquet", profile_table(prof), {**prof.meta, "schema_version": "2.0.0"}
    )
    with pytest.raises(
        InputError, match=r"schema version 2\.0\.0 is newer than this nfabric reads \(1\.1\.0\)"
    ):
        read_profile(tmp_path / "p.parquet")


def test_older_minor_without_new_columns_and_newer_minor_with_extra_column(tmp_path):
    prof = full_profile()
    old = profile_table(prof).drop_columns(["rounding", "mode", "error_feedback", "reducer"])
    _raw_write(tmp_path / "old.parquet", old, {**prof.meta, "schema_version": "1.0.0"})
    back = read_profile(tmp_path / "old.parquet")
    assert [r.error_feedback for r in back.rows] == [False] * 5
    assert {r.reducer for r in back.rows} == {"sharded"} and {r.mode for r in back.rows} == {None}
    newer = profile_table(prof).append_column("future", pa.array(["x"] * 5))
    _raw_write(
        tmp_path / "new.parquet", newer, {**prof.meta, "schema_version": "1.4.0", "extra": 1}
    )
    assert read_profile(tmp_path / "new.parquet").rows == prof.sorted_rows()


def test_unusable_files(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        read_profile(tmp_path / "missing.parquet")
    write_profile(full_profile(), tmp_path / "p.parquet")
    data = (tmp_path / "p.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match="cut.parquet: not a readable Parquet file"):
        read_profile(tmp_path / "cut.parquet")
    (tmp_path / "text.parquet").write_text("region,phase\n*,all\n")
    with pytest.raises(InputError, match="text.parquet: not a readable Parquet file"):
        read_profile(tmp_path / "text.parquet")
    pq.write_table(pa.table({"a": [1]}), tmp_path / "other.parquet")
    with pytest.raises(InputError, match="not an nfabric profile or bindings file"):
        read_profile(tmp_path / "other.parquet")
    table = profile_table(full_profile()).set_column(5, "route", pa.array(["fp8"] * 5))
    _raw_write(tmp_path / "route.parquet", table, {"schema_version": "1.0.0"})
    with pytest.raises(InputError, match="route.parquet: unknown route 'fp8'"):
        read_profile(tmp_path / "route.parquet")
    assert PROFILE_SCHEMA.names[5] == "route"


def row(region: str, phase: str, start: float, end: float, prio: int) -> ProfileRow:
    return ProfileRow(region, phase, start, end, prio, "sign")


@pytest.mark.parametrize(
    ("rows", "meta", "message"),
    [
        ([row("*", "all", 0, 1, 0), row("*", "all", 0, 1, 1)], {}, r"rows: '\*'@all"),
        ([row("a", "all", 0, 1, 0), row("*", "all", 0, 1, 0)], {}, "all priority 0"),
        ([row("*", "a", 0, 0.4, 0), row("*", "b", 0.5, 1, 0)], {}, "leave a gap or overlap"),
        ([row("*", "a", 0, 1, 0), row("x", "a", 0, 0.5, 1)], {}, "different bounds"),
        (
            [row("*", "all", 0, 1, 0)],
            {"target": {"metric": "acc", "reference": 1, "higher_is_better": True}},
            "target is missing tolerance",
        ),
    ],
)
def test_inconsistent_profiles_refused(rows, meta, message):
    with pytest.raises(InputError, match=message):
        OperatingProfile(rows, meta).validate()


def test_versioned_names_newest_wins(tmp_path):
    root = tmp_path / "profiles"
    assert next_profile_path(root, "vision") == root / "vision" / "vision.v1.parquet"
    for n in (1, 2, 10):
        write_profile(full_profile(), root / "vision" / f"vision.v{n}.parquet")
    (root / "vision" / "notes.txt").write_text("x")
    assert resolve_profile(root / "vision") == root / "vision" / "vision.v10.parquet"
    assert next_profile_path(root, "vision") == root / "vision" / "vision.v11.parquet"
    assert resolve_profile(root / "vision" / "vision.v2.parquet").name == "vision.v2.parquet"
    with pytest.raises(InputError, match="no <workload>.v<N>.parquet profile"):
        resolve_profile(root)
    with pytest.raises(InputError, match="no such file or directory"):
        resolve_profile(root / "nope")
    write_profile(full_profile(), root / "vision" / "lm.v10.parquet")
    with pytest.raises(InputError, match="several workloads share the newest version"):
        resolve_profile(root / "vision")
    with pytest.raises(InputError, match="bad workload name"):
        next_profile_path(root, "../x")


@pytest.mark.parametrize("key,value,message", [
    ("target", 5, "profile target must be a table of keys and values, got int 5"),
    ("provenance", "x", "profile provenance must be a table of keys and values, got str 'x'"),
    ("health", [1], "profile health must be a table"),
    ("world_size", True, "profile world_size must be a positive integer, got True"),
    # thresholds the monitor refuses: refused on reading, not first inside the ranks
    ("health", {"window": -5}, "health threshold window must be >= 1, got -5"),
    ("health", {"window": "x"}, "health threshold window must be an integer, got 'x'"),
    ("health", {"windw": 9}, "unknown health threshold(s): windw"),
])
def test_metadata_of_the_wrong_shape_is_one_line_not_a_crash(tmp_path, key, value, message):
    """A `target` of 5 was a TypeError inside diff-profile (exit 1: "different" to CI)."""
    prof = full_profile()
    _raw_write(tmp_path / "p.parquet", profile_table(prof), {**prof.meta, key: value})
    with pytest.raises(InputError, match=re.escape(message)):
        read_profile(tmp_path / "p.parquet")


def test_metadata_that_is_not_utf8_is_one_line(tmp_path):
    import pyarrow.parquet as pq

    prof = full_profile()
    _raw_write(tmp_path / "p.parquet", profile_table(prof), prof.meta)
    table = pq.read_table(tmp_path / "p.parquet")
    meta = {**table.schema.metadata, b"nfabric.extra": b"\xff\xfe"}
    pq.write_table(table.replace_schema_metadata(meta), tmp_path / "bad.parquet")
    with pytest.raises(InputError, match="its metadata is not UTF-8 text"):
        read_profile(tmp_path / "bad.parquet")
