"""The profile's own account of what it was calibrated on, said beside a run outside it
(`profile.proven`)."""

from __future__ import annotations


def test_other_data_is_one_sentence_naming_both_fingerprints() -> None:
    """A profile calibrated on other data (another --data-dir, or data built with other bits
    on another CPU) says so beside the proven-range warnings; nothing when they agree or
    either is unknown."""
    from types import SimpleNamespace

    from nfabric_cli.profile.proven import other_data
    from nfabric_cli.validation.run import RunPlan

    meta = {"provenance": {"data_fingerprint": "06c77cafaa94" + "0" * 52}}
    [line] = other_data(meta, "5a4bb1fd87fb" + "1" * 52)
    assert line == ("the profile was calibrated on other data (fingerprint 06c77cafaa94, here "
                    "5a4bb1fd87fb): a result here is not the one calibration measured")
    assert other_data(meta, "06c77cafaa94" + "0" * 52) == []
    assert other_data(meta, None) == [] and other_data({}, "5a4bb1fd87fb") == []
    assert other_data({"provenance": "not a dict"}, "5a4bb1fd87fb") == []
    cfg = SimpleNamespace(steps=60, world_size=2, tolerance=0.02)
    assert RunPlan(cfg, "glyphs", True, meta, "5a4bb1fd87fb" + "1" * 52).outside_proven([0]) == [line]
    assert RunPlan(cfg, "glyphs", True, meta, "06c77cafaa94" + "0" * 52).outside_proven([0]) == []


def test_another_cpu_is_one_sentence_naming_both() -> None:
    """A profile calibrated on another CPU (session 68: transformer.v12's proven cell seed 6,
    600 steps, two ranks, +1.39 points where it was calibrated, +2.50 here, with the same code,
    packages and data) says so beside the proven-range warnings; nothing on the same CPU, for
    a profile that does not record one, or for a hand-written one (nothing was measured)."""
    from types import SimpleNamespace

    from nfabric_cli.profile.proven import other_host
    from nfabric_cli.profile.provenance import base_provenance, host
    from nfabric_cli.validation.run import RunPlan

    there = {"machine": "x86_64", "kernels": "AVX2", "cpu": "AMD EPYC 7B12"}
    here = {"machine": "x86_64", "kernels": "AVX512", "cpu": "Intel(R) Xeon(R) Processor"}
    meta = {"provenance": {"source": "calibrate", "host": there}}
    [line] = other_host(meta, here)
    assert line == ("the profile was calibrated on another CPU or kernel level (AMD EPYC 7B12, "
                    "x86_64 AVX2; here Intel(R) Xeon(R) Processor, x86_64 AVX512): float "
                    "results may differ in their last bits from one to the other, so its proven "
                    "cells may not replay here exactly, each one then in effect a new seed")
    assert other_host(meta, dict(there)) == []
    # compared on what both name: a key one side lacks, or a model one side could not read
    assert other_host(meta, {**there, "numa": "2"}) == []
    assert other_host(meta, {**there, "cpu": ""}) == []
    assert len(other_host(meta, {**there, "kernels": "AVX512"})) == 1  # one field is enough
    assert other_host({"provenance": {"source": "calibrate"}}, here) == []  # before session 68
    assert other_host({"provenance": {"source": "profile init", "host": there}}, here) == []
    assert other_host({}, here) == []
    # what a profile made here records, and validate's plan on this machine: nothing to say
    recorded = base_provenance()["host"]
    assert recorded == host() and set(recorded) == {"machine", "kernels", "cpu"}
    assert recorded["kernels"]  # torch's dispatch level, never empty
    cfg = SimpleNamespace(steps=60, world_size=2, tolerance=0.02)
    mine = {"provenance": {"source": "calibrate", "host": recorded}}
    assert RunPlan(cfg, "vision", True, mine, None).outside_proven([0]) == []
    theirs = {"provenance": {"source": "calibrate", "host": there}}
    assert RunPlan(cfg, "vision", True, theirs, None).outside_proven([0])[0].startswith(
        "the profile was calibrated on another CPU or kernel level (AMD EPYC 7B12, x86_64 AVX2; "
        "here ")


def test_a_proof_without_room_for_the_new_seeds_worst_is_said() -> None:
    """lm.v11's 20 cells bound the worst of five new seeds past its tolerance (one of seeds
    10-14 missed); lm.v12's leave room for ten; seeds it was proven on are not new."""
    from pathlib import Path
    from types import SimpleNamespace

    from nfabric_cli.profile.proven import thin_margin
    from nfabric_cli.profile.store import read_profile
    from nfabric_cli.validation.run import RunPlan

    root = Path(__file__).resolve().parents[2] / "profiles" / "lm"
    v11, v12 = (read_profile(root / f"lm.{v}.parquet").meta for v in ("v11", "v12"))
    [line] = thin_margin(v11, list(range(10, 15)), 0.05)
    assert line == ("the profile's proof leaves no room for the worst of 5 new seeds: its 20 "
                    "cells bound it at +0.06206 (95 %) against a tolerance of 0.05, so a seed "
                    "may miss (calibrate's validate rule asks for that room: "
                    "docs/calibration.md, 'The rule')")
    assert thin_margin(v11, [0, 1, 2, 3, 4], 0.05) == []  # proven seeds: nothing new to bound
    assert thin_margin(v11, [10], 0.05) == []  # one new seed: its 95 % bound, +0.0478, inside
    # the run's tolerance judges (`--tolerance`): wider, room; narrower, one seed has none
    assert thin_margin(v11, list(range(10, 15)), 0.1) == []
    [narrow] = thin_margin(v11, [10], 0.02)
    assert narrow.startswith("the profile's proof leaves no room for a new seed: its 20 cells "
                             "bound it at +0.04776 (95 %) against a tolerance of 0.02")
    assert thin_margin(v12, list(range(10, 20)), 0.05) == []
    assert thin_margin({"proven": {"fp32": True}}, [10], 0.05) == []
    assert thin_margin({}, [10], 0.05) == []
    # hand-written cells: one without a degradation, or a diverged one, bound nothing
    for bad in ({"seed": 0}, {"degradation": None}, {"degradation": float("inf")}):
        meta = {**v11, "proven": {**v11["proven"], "cells": [*v11["proven"]["cells"], bad]}}
        assert thin_margin(meta, [10, 11, 12, 13, 14], 0.05) == []
    cfg = SimpleNamespace(steps=600, world_size=2, tolerance=0.05)
    lines = RunPlan(cfg, "lm", False, v11).outside_proven(list(range(10, 15)))
    assert lines[1] == line and lines[0].startswith("the profile was proven on seeds 0,")
