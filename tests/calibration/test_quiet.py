"""The loss-spike floor is raised until the fp32 references are quiet (`calibration/quiet.py`)."""

from __future__ import annotations

import math
from pathlib import Path

from typer.testing import CliRunner

from nfabric_cli.app import app
from nfabric_cli.calibration.quiet import CAP, MARGIN, quiet_floor, spike_heights
from nfabric_cli.profile.store import read_profile, resolve_profile

DETECTIONS = [(3, "all", "loss spike 9.8x median (11 robust sd)"),
              (4, "*", "grad-norm blow-up 12.0x median"),
              (7, "all", "loss spike 8.0x median (10 robust sd)")]


def test_spike_heights_are_loss_spikes_against_the_early_loss() -> None:
    losses = [2.0, 1.0, 0.5, 0.8, 3.0, 0.1, 0.1, 0.4]
    assert spike_heights(DETECTIONS, losses, 2.0) == [(3, 0.4), (7, 0.2)]
    assert spike_heights(DETECTIONS, losses, None) == []
    assert spike_heights(DETECTIONS, [*losses[:7], math.nan], 2.0) == [(3, 0.4)]


def test_the_floor_clears_the_highest_spike_with_a_margin_up_to_the_early_loss() -> None:
    raised, note = quiet_floor([(3, 0.4), (7, 0.2)], {})
    assert raised == {"loss_spike_floor": math.ceil(MARGIN * 0.4 * 100) / 100} == \
        {"loss_spike_floor": 0.5}
    assert note.startswith("health: loss_spike_floor 0.25 -> 0.5: the fp32 references' own "
                           "losses spiked 2 time(s) (steps 3, 7; up to 0.40x the early loss)")
    raised, note = quiet_floor([(98, 2.8)], {})  # fp32 itself climbed past its start
    assert raised == {"loss_spike_floor": CAP} and "capped at 1x the early loss" in note
    assert quiet_floor([], {}) == ({}, None)  # a quiet reference changes nothing
    assert quiet_floor([(3, 0.1)], {}) == ({}, None)  # already clear of the default 0.25
    raised, note = quiet_floor([(3, 0.4)], {"loss_spike_floor": 0.3})  # the spec's is kept
    assert raised == {} and note.startswith("warning: the fp32 references' own losses")
    assert "above the spec's loss_spike_floor 0.3" in note


def test_calibrate_raises_the_floor_over_the_references_and_the_profile_keeps_it(
        tmp_path: Path) -> None:
    """The example MLP nearly fits its data: one hard batch of 16 reads 8-13x the median loss,
    up to 0.89x the early loss, on fp32 runs where nothing is wrong (seeds 0-2, 150 steps, 2
    and 4 ranks: the search's reference and the confirmation cells')."""
    res = CliRunner().invoke(app, ["calibrate", "examples.plugin_workload:workload",
                                   "--trials", "2", "--out", str(tmp_path / "o"),
                                   "--storage", f"sqlite:///{tmp_path}/s.db"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "health: loss_spike_floor 0.25 -> 1: the fp32 references' own losses spiked" in text
    profile = read_profile(resolve_profile(tmp_path / "o" / "breast-cancer-mlp"))
    assert profile.meta["health"]["loss_spike_floor"] == 1.0
