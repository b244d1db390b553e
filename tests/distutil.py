"""Run a function on N real gloo ranks: the ground floor's runner (`nfabric_cli.ranks`), and
what their events must agree on."""

from collections.abc import Iterable
from typing import Any

from nfabric_cli.ranks.functions import run_function_ranks as run_ranks

__all__ = ["agreed", "run_ranks"]


def agreed(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Events as every rank must hold them: less the `rank` that logged each."""
    return [{k: v for k, v in e.items() if k != "rank"} for e in events]
