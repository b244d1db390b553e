"""`run_function_ranks`: ranks forked from a server that imported torch and nfabric once still
see the caller's environment and working directory as they are at the call (nfabric's settings
included), and return their results."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from tests.distutil import run_ranks

KERNELS = "nfabric_cli.routes.kernels"  # (imported in the ranks only: see `_where`)


def _where(rank: int, world: int) -> dict:
    preloaded = KERNELS in sys.modules  # this module does not import it: the fork server did
    # what torch's optimizers import when the first is built (~1.5 s a rank, `preload.py`)
    dynamo = "torch._dynamo" in sys.modules
    from threadpoolctl import threadpool_info

    from nfabric_cli.routes import kernels

    t = torch.full((1,), float(rank + 1))
    torch.distributed.all_reduce(t)
    return {"env": os.environ.get("NFABRIC_TEST_MARK"), "cwd": os.getcwd(), "sum": t,
            "threads": torch.get_num_threads(), "kernels": kernels.status(), "preloaded": preloaded,
            "dynamo": dynamo, "pools": sorted({p["num_threads"] for p in threadpool_info()})}


def test_ranks_take_the_callers_environment_and_directory_at_each_call(
    tmp_path: Path, monkeypatch
) -> None:
    run_ranks(_where, 2)  # the fork server is up before the settings below change
    from nfabric_cli.routes.kernels import DISABLE_ENV

    monkeypatch.setenv("NFABRIC_TEST_MARK", "second")
    monkeypatch.setenv(DISABLE_ENV, "1")
    monkeypatch.chdir(tmp_path)
    results = run_ranks(_where, 2)
    assert [r["env"] for r in results] == ["second", "second"]
    assert [r["cwd"] for r in results] == [str(tmp_path)] * 2
    assert [float(r["sum"]) for r in results] == [3.0, 3.0]  # a real gloo all-reduce
    assert [r["threads"] for r in results] == [1, 1]
    # imported in the fork server, the native kernels still follow the caller's setting
    assert [(r["preloaded"], r["kernels"]) for r in results] == [
        (True, f"torch fallback: {DISABLE_ENV}=1")] * 2
    assert [r["dynamo"] for r in results] == [True, True]


def test_ranks_run_the_preloaded_thread_pools_on_one_thread() -> None:
    """scipy's and scikit-learn's pools (BLAS, OpenMP) are loaded in the fork server, before a
    rank sets one thread: held to one there, from a caller that set no thread count (this
    suite sets OMP_NUM_THREADS=1, which the server would inherit: a fresh interpreter)."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    code = ("from nfabric_cli.ranks.functions import run_function_ranks\n"
            "from tests.test_function_ranks import _where\n"
            "if __name__ == '__main__':\n"
            "    print([r['pools'] for r in run_function_ranks(_where, 2)])\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[[1], [1]]"
