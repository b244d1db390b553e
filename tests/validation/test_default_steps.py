"""`validate` without `--steps` runs the length the profile was calibrated at, so its default
run is one calibration vouches for (a bindings file's `--total-steps` first, the workload's
default last)."""

from __future__ import annotations

from pathlib import Path

from nfabric_cli.binding import compile_profile, write_bindings
from nfabric_cli.profile.store import read_profile
from nfabric_cli.validation.config import ValidateConfig
from nfabric_cli.validation.run import default_steps, plan
from tests.validation.common import TINY, head_fp32_profile
from tests.validation.tiny import TinyWorkload

PROVEN = {"seeds": [0, 1], "steps": [12, 6], "world_size": 2}


def _planned(source: Path, tmp_path: Path, steps: int | None = None) -> int | None:
    cfg = ValidateConfig(source=str(source), workload=TINY, steps=steps,
                         report_dir=str(tmp_path / "report"))
    return plan(cfg).cfg.steps


def test_the_default_length_is_the_profiles_calibrated_one(tmp_path: Path) -> None:
    assert TinyWorkload.default_steps == 8  # what a profile without a record falls back to
    proven = head_fp32_profile(tmp_path / "proven.parquet", proven=PROVEN)
    assert _planned(proven, tmp_path) == 6  # the shortest proven length
    assert _planned(proven, tmp_path, steps=10) == 10  # --steps wins
    bare = head_fp32_profile(tmp_path / "bare.parquet")
    assert _planned(bare, tmp_path) == 8
    model = TinyWorkload().build_model(0)
    for total, expected in ((5, 5), (None, 6)):  # a bindings file: its run length, else its
        bindings = compile_profile(read_profile(proven), model, total_steps=total)  # profile's
        write_bindings(bindings, tmp_path / f"b{total}.parquet")
        assert _planned(tmp_path / f"b{total}.parquet", tmp_path) == expected


def test_default_steps_reads_a_profile_before_its_provenance() -> None:
    old = {"provenance": {"source": "calibrate", "seed": 0, "budget": {"steps": 300}}}
    assert default_steps("profile", old, 200) == 300  # calibrated before `proven` existed
    assert default_steps("profile", {}, 200) == 200  # hand-written: the workload's
    assert default_steps("profile", {"proven": {"fp32": True}}, 200) == 200  # nothing proven
    assert default_steps("bindings", {"total_steps": None, "profile": old}, 200) == 300


def test_a_bindings_file_of_another_world_size_is_said_before_the_run(tmp_path: Path) -> None:
    """Its routes hold at any size; its modelled bytes and verdicts are worked out again for
    the run's, and the run says so (beside the proven-range lines), once."""
    proven = head_fp32_profile(tmp_path / "proven.parquet", proven=PROVEN)
    model = TinyWorkload().build_model(0)
    for compiled in (4, 2):
        path = tmp_path / f"w{compiled}.parquet"
        write_bindings(compile_profile(read_profile(proven), model, world_size=compiled), path)
        cfg = ValidateConfig(source=str(path), workload=TINY, world_size=2,
                             report_dir=str(tmp_path / "report"))
        notes = [n for n in plan(cfg).outside_proven([0]) if "compiled for" in n]
        assert notes == ([] if compiled == 2 else [
            "these bindings were compiled for 4 ranks and run on 2: their modelled bytes and "
            "capacity verdicts are worked out again for 2 (compile-profile --world-size 2 keeps "
            "a file of this run's own)"])
