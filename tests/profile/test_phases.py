"""Phase boundaries: parsing, names, and which phase a step falls in."""

from __future__ import annotations

import pytest

from nfabric_cli.errors import InputError
from nfabric_cli.profile import Phase, parse_phases, phase_at


def test_parse_and_names():
    assert parse_phases(None) == [Phase("all", 0.0, 1.0)]
    assert parse_phases("0.1,0.8") == [
        Phase("warmup", 0.0, 0.1),
        Phase("main", 0.1, 0.8),
        Phase("final", 0.8, 1.0),
    ]
    assert [p.name for p in parse_phases("0.5")] == ["warmup", "main"]
    assert [p.name for p in parse_phases("0.1,0.2,0.3,0.9")] == [
        "warmup",
        "main1",
        "main2",
        "main3",
        "final",
    ]


@pytest.mark.parametrize("text", ["0.8,0.1", "0,0.5", "0.5,1", "a,b", "0.5,0.5", "1.5"])
def test_bad_boundaries(text):
    with pytest.raises(InputError, match="--phases"):
        parse_phases(text)


def test_phase_at_edges():
    phases = parse_phases("0.1,0.8")
    got = [phase_at(phases, s, 10).name for s in range(11)]
    assert got == ["warmup"] + ["main"] * 7 + ["final"] * 3
    assert phase_at(phases, 12, 10).name == "final"  # past the end: still the last phase
    with pytest.raises(InputError, match="total steps must be >= 1"):
        phase_at(phases, 0, 0)
