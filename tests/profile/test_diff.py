"""diff_profiles: added, removed and changed rows; metadata and provenance apart."""

from __future__ import annotations

from dataclasses import replace

from nfabric_cli.profile import OperatingProfile, ProfileRow, diff_profiles


def base() -> OperatingProfile:
    rows = [
        ProfileRow("head.*", "all", 0.0, 1.0, 0, "fp32"),
        ProfileRow("*", "all", 0.0, 1.0, 1, "ternary", tau=0.5, traffic_fraction=0.07, trials=10),
    ]
    meta = {
        "workload": "vision",
        "target": {
            "metric": "accuracy",
            "reference": 0.6,
            "tolerance": 0.01,
            "higher_is_better": True,
        },
        "provenance": {"seed": 1},
    }
    return OperatingProfile(rows, meta)


def test_equal():
    d = diff_profiles(base(), base())
    assert d.equal and d.to_dict() == {
        "equal": True,
        "changes": [],
        "metadata": [],
        "provenance": [],
        "provenance_ignored": False,
    }
    assert "no changes" in d.to_markdown()


def test_changed_fields_with_old_and_new_values():
    b = base()
    b.rows[1] = replace(b.rows[1], route="sign", tau=None)
    d = diff_profiles(base(), b)
    assert not d.equal
    assert d.to_dict()["changes"] == [
        {
            "region": "*",
            "phase": "all",
            "field": "route",
            "a": "ternary",
            "b": "sign",
            "kind": "changed",
        },
        {"region": "*", "phase": "all", "field": "tau", "a": 0.5, "b": None, "kind": "changed"},
    ]


def test_added_and_removed_rows():
    b = base()
    b.rows[0] = replace(b.rows[0], region="classifier.*")
    d = diff_profiles(base(), b)
    kinds = [(c.region, c.kind, c.field) for c in d.changes]
    assert sorted(kinds) == [("classifier.*", "added", "row"), ("head.*", "removed", "row")]
    added = next(c for c in d.changes if c.kind == "added")
    assert added.a is None and added.b["route"] == "fp32" and added.b["priority"] == 0
    md = d.to_markdown()
    assert (
        "| `classifier.*` | all | added | - | phase_start=0, phase_end=1, priority=0, route=fp32"
        in md
    )


def test_metadata_and_provenance():
    b = base()
    b.meta["target"] = {**b.meta["target"], "tolerance": 0.02}
    b.meta["provenance"] = {"seed": 2}
    b.meta["profile_version"] = 2
    d = diff_profiles(base(), b)
    assert [(m.key, m.a, m.b) for m in d.metadata] == [("target.tolerance", 0.01, 0.02)]
    assert [(m.key, m.a, m.b) for m in d.provenance] == [
        ("profile_version", 1, 2),
        ("provenance.seed", 1, 2),
    ]
    only_prov = base()
    only_prov.meta["provenance"] = {"seed": 2}
    assert not diff_profiles(base(), only_prov).equal
    ignored = diff_profiles(base(), only_prov, ignore_provenance=True)
    assert ignored.equal and ignored.to_dict()["provenance"] == [
        {"key": "provenance.seed", "a": 1, "b": 2}
    ]
    assert "provenance" not in ignored.to_markdown().split("no changes")[0]


def test_evidence_can_be_ignored():
    b = base()
    b.rows[1] = replace(b.rows[1], traffic_fraction=0.08, trials=12)
    assert [c.field for c in diff_profiles(base(), b).changes] == ["traffic_fraction", "trials"]
    assert diff_profiles(base(), b, ignore_evidence=True).equal
    b.rows[1] = replace(b.rows[1], tau=0.4)
    assert [c.field for c in diff_profiles(base(), b, ignore_evidence=True).changes] == ["tau"]
    # what confirmation measured is evidence; the range a profile claims is not
    a, c = base(), base()
    a.meta["proven"] = {"seeds": [0, 1], "cells": [{"metric": 0.9}], "worst_degradation": 0.01}
    c.meta["proven"] = {"seeds": [0, 1], "cells": [{"metric": 0.8}], "worst_degradation": 0.02}
    assert [m.key for m in diff_profiles(a, c).metadata] == ["proven.cells",
                                                           "proven.worst_degradation"]
    assert diff_profiles(a, c, ignore_evidence=True).equal
    c.meta["proven"]["seeds"] = [0]
    assert [m.key for m in diff_profiles(a, c, ignore_evidence=True).metadata] == ["proven.seeds"]


def test_long_lists_print_as_their_length_in_tables() -> None:
    from nfabric_cli.profile.diff import format_value

    params = [["layer.weight", [4, 4], "float32"]] * 20  # provenance.model_params
    assert format_value({"model_params": params, "seed": 0}) == "model_params=[20 items], seed=0"
    assert format_value([1, 2]) == "[1, 2]"


def test_route_options_compare_as_the_route_takes_them():
    """tau unset and tau = 0.5 (the default) are one route; a sign row's old zero vote
    (schema 1.0, "negative") and the default (split) are two."""
    a = base()
    b = OperatingProfile([replace(a.rows[0]), replace(a.rows[1], tau=None)], dict(a.meta))
    assert diff_profiles(a, b).equal
    c = OperatingProfile([replace(a.rows[0]), replace(a.rows[1], tau=0.3)], dict(a.meta))
    assert [(x.field, x.a, x.b) for x in diff_profiles(a, c).changes] == [("tau", 0.5, 0.3)]
    sign = OperatingProfile([replace(a.rows[0]), replace(a.rows[1], route="sign", tau=None)],
                            dict(a.meta))
    old = OperatingProfile([replace(a.rows[0]), replace(sign.rows[1], zeros="negative")],
                           dict(a.meta))
    assert [(x.field, x.a, x.b) for x in diff_profiles(old, sign).changes] == [
        ("zeros", "negative", "split")]  # the unset vote shown as what it is, not "-"


def test_health_thresholds_compare_as_the_monitor_takes_them():
    """An unset threshold is its default (hand-written) or, in a calibrated profile that
    predates it, the value that keeps its rule: shown as that, equal to it written out."""
    from nfabric_cli.profile.thresholds import HealthThresholds

    a, b = base(), base()
    b.meta["health"] = {"window": HealthThresholds().window}
    assert diff_profiles(a, b).equal
    b.meta["health"] = {"window": 9}
    assert [(m.key, m.a, m.b) for m in diff_profiles(a, b).metadata] == [
        ("health.window", HealthThresholds().window, 9)]
    old, new = base(), base()  # calibrated before `blowup_cap`, and after with it on
    for p in (old, new):
        p.meta["provenance"] = {"seed": 1, "source": "calibrate"}
    new.meta["health"] = {"blowup_cap": 1.0}
    changes = {m.key: (m.a, m.b) for m in diff_profiles(old, new).metadata}
    assert changes["health.blowup_cap"] == (0.0, 1.0)
