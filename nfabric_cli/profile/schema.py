"""The profile's on-disk format: an explicit pyarrow schema and its semantic version.

Bump the minor version for additive changes (a new nullable column, a new metadata key):
older readers still read the file. Bump the major version for anything else: older readers
then refuse the file with a message naming both versions.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

SCHEMA_VERSION = "1.1.0"  # 1.1: `zeros`, sign's vote for an exact zero

PROFILE_SCHEMA = pa.schema(
    [
        pa.field("region", pa.string()),
        pa.field("phase", pa.string()),
        pa.field("phase_start", pa.float64()),
        pa.field("phase_end", pa.float64()),
        pa.field("priority", pa.int32()),
        pa.field("route", pa.string()),
        pa.field("tau", pa.float64()),
        pa.field("chunk", pa.int64()),
        pa.field("error_feedback", pa.bool_()),
        pa.field("reducer", pa.string()),
        pa.field("traffic_fraction", pa.float64()),
        pa.field("metric_delta", pa.float64()),
        pa.field("trials", pa.int64()),
        pa.field("rounding", pa.string()),
        pa.field("mode", pa.string()),
        pa.field("zeros", pa.string()),
    ]
)

#: Values for columns a file of an older minor version does not have.
PROFILE_COLUMN_DEFAULTS: dict[str, Any] = {"error_feedback": False, "reducer": "sharded"}


#: The profile and bindings schema that added `zeros` (both went 1.0 -> 1.1 with it).
ZEROS_SINCE = (1, 1)


def zeros_as_written(route: str, zeros: str | None, version: str) -> str | None:
    """Sign's zero vote as a row of a file of schema `version` meant it: as written; or, in a
    file older than `ZEROS_SINCE`, "negative" for a sign row, the only rule there was then,
    so that a profile replays what it was proven with."""
    from nfabric_cli.profile.parquet import parse_semver

    if zeros is None and route == "sign" and parse_semver(version)[:2] < ZEROS_SINCE:
        return "negative"
    return zeros
