"""The example CI workflow parses and calls profile commands only with flags they have."""

from __future__ import annotations

import re
from pathlib import Path

import typer.main
import yaml

from nfabric_cli.app import app

WORKFLOW = Path(__file__).resolve().parents[2] / "examples" / "ci" / "profile-check.yml"


def test_workflow_uses_existing_flags():
    doc = yaml.safe_load(WORKFLOW.read_text())
    steps = doc["jobs"]["profile"]["steps"]
    script = "\n".join(s.get("run", "") for s in steps)
    commands = typer.main.get_command(app).commands
    checked = 0
    for name in ("compile-profile", "diff-profile"):
        flags = {o for p in commands[name].params for o in getattr(p, "opts", [])}
        for line in re.findall(rf"\$NF {name} [^\n>]*", script):
            used = set(re.findall(r"(--[a-z-]+)", line))
            assert used <= flags, (line, used - flags)
            checked += 1
    assert checked == 3
