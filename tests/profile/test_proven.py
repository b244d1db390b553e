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
    cfg = SimpleNamespace(steps=60, world_size=2)
    assert RunPlan(cfg, "glyphs", True, meta, "5a4bb1fd87fb" + "1" * 52).outside_proven([0]) == [line]
    assert RunPlan(cfg, "glyphs", True, meta, "06c77cafaa94" + "0" * 52).outside_proven([0]) == []
