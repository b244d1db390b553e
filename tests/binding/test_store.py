"""Bindings on disk: round trip, determinism, and loading either artefact."""

from __future__ import annotations

import pytest

from nfabric_cli.binding import (
    compile_profile,
    load_bindings_or_profile,
    read_bindings,
    static_profile,
    write_bindings,
)
from nfabric_cli.errors import InputError
from nfabric_cli.profile import parse_phases, write_profile
from tests.binding import models


@pytest.fixture()
def profile():
    return static_profile(
        models.tied(),
        "ternary",
        [("head.*", "fp32"), ("*.bias", "int8")],
        parse_phases("0.2"),
        workload="tied",
        tau=0.25,
        error_feedback=True,
        reducer="central",
        world_size=4,
    )


def test_round_trip_and_same_bytes(tmp_path, profile):
    b = compile_profile(profile, models.tied(), total_steps=50, bucket_cap_mb=0.001)
    assert len(b.buckets) > 1
    write_bindings(b, tmp_path / "a.parquet")
    write_bindings(b, tmp_path / "b.parquet")
    assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()
    back = read_bindings(tmp_path / "a.parquet")
    assert back == b
    assert back.params["embed.weight"].aliases == ("embed.weight", "head.weight")
    assert back.route_for("body.bias", "main").name == "int8"
    assert back.meta["workload"] == "tied" and back.total_steps == 50
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.parquet", "b.parquet"]  # no temp files


def test_load_either_kind(tmp_path, profile):
    write_profile(profile, tmp_path / "tied.v1.parquet")
    from_profile = load_bindings_or_profile(tmp_path, models.tied(), world_size=8)
    assert from_profile.world_size == 8
    write_bindings(from_profile, tmp_path / "bind.parquet")
    same = load_bindings_or_profile(tmp_path / "bind.parquet", None)
    assert same == from_profile
    # A new world size re-derives the modelled bytes from the stored routes.
    again = load_bindings_or_profile(tmp_path / "bind.parquet", models.tied(), world_size=2)
    ref = compile_profile(profile, models.tied(), world_size=2)
    assert [bk.wire_bytes for bk in again.buckets] == [bk.wire_bytes for bk in ref.buckets]
    with pytest.raises(InputError, match="is a profile: give --workload or --model"):
        load_bindings_or_profile(tmp_path / "tied.v1.parquet", None)
    with pytest.raises(InputError, match="was compiled for another model"):
        load_bindings_or_profile(tmp_path / "bind.parquet", models.mlp())
    # Another bucket cap re-plans the buckets from the model; the routes stay as compiled.
    with pytest.raises(InputError, match=r"planned for DDP's default bucket cap \(25 MB, 1 MB first bucket\) .* give the model"):
        load_bindings_or_profile(tmp_path / "bind.parquet", None, bucket_cap_mb=0.001)
    small = load_bindings_or_profile(tmp_path / "bind.parquet", models.tied(), bucket_cap_mb=0.001)
    fresh = compile_profile(profile, models.tied(), world_size=8, bucket_cap_mb=0.001)
    assert len(small.buckets) == 2 and small == fresh
    with pytest.raises(InputError, match="cannot apply ready_orders"):
        load_bindings_or_profile(tmp_path / "bind.parquet", None, ready_orders=[])


def test_bindings_file_is_not_a_profile(tmp_path, profile):
    from nfabric_cli.profile import read_profile

    write_bindings(compile_profile(profile, models.tied()), tmp_path / "bind.parquet")
    with pytest.raises(InputError, match="is a bindings file, expected a profile file"):
        read_profile(tmp_path / "bind.parquet")


def test_bindings_with_thresholds_the_monitor_refuses_fail_on_reading(tmp_path, profile):
    """Bad thresholds in a bindings file (compiled before profiles were checked for them, or
    edited): one line on reading, as in a profile, not first at attach in the ranks."""
    import json

    import pyarrow.parquet as pq

    from nfabric_cli.profile.parquet import META_PREFIX

    write_bindings(compile_profile(profile, models.tied()), tmp_path / "bind.parquet")
    table = pq.read_table(tmp_path / "bind.parquet")
    meta = dict(table.schema.metadata)
    key = (META_PREFIX + "profile").encode()
    doc = json.loads(meta[key])
    doc["health"] = {"window": 0}
    meta[key] = json.dumps(doc).encode()
    pq.write_table(table.replace_schema_metadata(meta), tmp_path / "bad.parquet")
    with pytest.raises(InputError, match=r"bad\.parquet: health threshold window must be >= 1, "
                                         r"got 0"):
        read_bindings(tmp_path / "bad.parquet")
