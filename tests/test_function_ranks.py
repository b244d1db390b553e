"""`run_function_ranks`: ranks forked from a server that imported torch once still see the
caller's environment and working directory as they are at the call, and return their results."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tests.distutil import run_ranks


def _where(rank: int, world: int) -> dict:
    t = torch.full((1,), float(rank + 1))
    torch.distributed.all_reduce(t)
    return {"env": os.environ.get("NFABRIC_TEST_MARK"), "cwd": os.getcwd(), "sum": t,
            "threads": torch.get_num_threads()}


def test_ranks_take_the_callers_environment_and_directory_at_each_call(
    tmp_path: Path, monkeypatch
) -> None:
    run_ranks(_where, 2)  # the fork server is up before the settings below change
    monkeypatch.setenv("NFABRIC_TEST_MARK", "second")
    monkeypatch.chdir(tmp_path)
    results = run_ranks(_where, 2)
    assert [r["env"] for r in results] == ["second", "second"]
    assert [r["cwd"] for r in results] == [str(tmp_path)] * 2
    assert [float(r["sum"]) for r in results] == [3.0, 3.0]  # a real gloo all-reduce
    assert [r["threads"] for r in results] == [1, 1]
