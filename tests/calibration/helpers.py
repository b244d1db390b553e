"""Small specs shared by the calibration tests (the tiny workload, a few steps)."""

from __future__ import annotations

from typing import Any

from nfabric_cli.calibration.spec import CalibrationSpec, parse_spec
from nfabric_cli.calibration.study import ProgressSink


def tiny_spec_dict(**top: Any) -> dict[str, Any]:
    """Two regions (head, rest), one searched phase boundary, a few steps."""
    data: dict[str, Any] = {
        "world_size": 2,
        "seed": 0,
        "steps": 6,
        "eval_every": 2,
        "tolerance": 0.05,
        "trials": 4,
        "phases": {"boundaries": [[0.2, 0.5]]},
        "routes": {"tau": [0.3, 0.7], "error_feedback": [False, True]},
        "regions": [
            {"name": "head", "selector": "head.*", "routes": ["fp32", "int8", "sign"]},
            {"name": "rest", "selector": "*", "routes": ["fp32", "ternary", "sign"]},
        ],
    }
    data.update(top)
    return data


TINY = "tests.calibration.tiny:workload"


def tiny_spec(workload: str = "tiny", **top: Any) -> CalibrationSpec:
    return parse_spec(tiny_spec_dict(**top), workload)


def toml_text(data: dict[str, Any]) -> str:
    """Minimal TOML writer for the spec shapes above (tests only)."""
    lines: list[str] = []
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    arrays = {k: v for k, v in data.items() if isinstance(v, list) and v and isinstance(v[0], dict)}
    for k, v in data.items():
        if k not in tables and k not in arrays:
            lines.append(f"{k} = {_value(v)}")
    for name, table in tables.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {_value(v)}" for k, v in table.items()]
    for name, items in arrays.items():
        for item in items:
            lines.append(f"[[{name}]]")
            lines += [f"{k} = {_value(v)}" for k, v in item.items()]
    return "\n".join(lines) + "\n"


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return repr(v)


class Notes(ProgressSink):
    """A sink that keeps the study's notes (`notes`), for tests that read what it said."""

    def __init__(self) -> None:
        self.notes: list[str] = []

    def note(self, message: str) -> None:
        self.notes.append(message)
