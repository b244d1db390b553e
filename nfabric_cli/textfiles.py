"""Reading small TOML/JSON input files with one-line errors (a bad file is bad input)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from nfabric_cli.errors import InputError


def _existing_file(path: str | Path, what: str) -> Path:
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{what} {p}: " + ("is a folder, not a file" if p.is_dir() else
                                            "no such file"))
    return p


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    """Parse a TOML file; missing or malformed -> `InputError` naming `what` and the path."""
    p = _existing_file(path, what)
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{p}: malformed TOML in the {what} ({exc})") from None


def read_json(path: str | Path, what: str) -> Any:
    """Parse a JSON file; missing or malformed -> `InputError` naming `what` and the path."""
    p = _existing_file(path, what)
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{p}: malformed JSON in the {what} ({exc})") from None
