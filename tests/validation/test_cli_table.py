"""`nfabric validate`'s table: its caption explains the columns it has, and no others."""

from __future__ import annotations

from rich.console import Console

from nfabric_cli.cli.validate import _table


def _render(summary: dict) -> str:
    console = Console(width=200, record=True)
    console.print(_table(summary))
    return console.export_text()


def _summary(**extra) -> dict:
    arm = {"metric": 0.97, "metric_delta": -0.01, "bytes_per_step": 1000.0,
           "traffic_fraction": 0.05, "step_time_s": 0.012, "fallbacks": 0}
    return {"workload": "vision", "world_size": 2, "steps": 300, "higher_is_better": True,
            "arms": {"fp32": {**arm, "metric_delta": 0.0}, "profile": arm}, **extra}


def test_the_link_columns_and_their_caption_come_only_with_a_link() -> None:
    plain = _render(_summary())
    assert "fb: fallbacks to fp32" in plain
    assert "link" not in plain  # no link columns, so no word about them
    linked = _render(_summary(link_mbit=20.0))
    for arm in ("fp32", "profile"):
        assert arm in linked
    assert "link claimed" in linked and "measured" in linked
    assert "link claimed / measured: bytes sent by all ranks" in linked
