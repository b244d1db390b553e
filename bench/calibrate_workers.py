"""Calibrate workers on one study: one vs two workers, SQLite vs PostgreSQL, side by side.

Every arm runs real `nfabric calibrate` processes on a fresh study with the same spec and
reports wall time from the first start to the last exit, the study's finished trials and
simulated training steps (reference included), and both per minute (the arms' samplers see
different histories, so their trial sets differ: steps per minute is the like-for-like
throughput); ratios (x) are against one worker on SQLite measured in the same run. A throw-away PostgreSQL server (`tests/pgserver.py`) holds the PostgreSQL arms.
A second pass on the tiny test workload (a trial costs milliseconds of compute) measures what
the storage itself costs per trial.

On this machine two workers share its CPUs with each other (one worker alone already uses
every CPU for its simulated ranks), so two workers cannot beat one here; on two machines
each has its own CPUs, and the work the second adds is bounded by what must run in order
(the FP32 reference, which the other worker waits for) and by trials waiting for a running
twin of their configuration.

    OMP_NUM_THREADS=1 python -m bench.calibrate_workers [--workload vision] [--trials 8]
        [--steps 60] [--tiny-trials 30]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
from optuna.trial import TrialState

from nfabric_cli.calibration.storage import open_storage

ROOT = Path(__file__).resolve().parents[1]
TINY = "tests.calibration.tiny:workload"


def run_arm(workload: str, url: str, workers: int, extra: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "nfabric_cli", "calibrate", workload, "--storage", url,
           "--study", "bench", "--out", str(out), "--json", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(workers)]
    results = [p.communicate() for p in procs]
    wall = time.perf_counter() - t0
    for p, (_, err) in zip(procs, results, strict=True):
        if p.returncode != 0:
            raise SystemExit(f"worker failed ({p.returncode}): {err.strip()[-500:]}")
    study = optuna.load_study(study_name="bench", storage=open_storage(url))
    done = [t for t in study.trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    per_worker: dict[str, int] = {}
    for t in done:
        per_worker[t.user_attrs.get("worker", "?")] = per_worker.get(t.user_attrs.get("worker"),
                                                                     0) + 1
    steps = int(study.user_attrs["reference"]["steps_run"]) + sum(
        int(t.user_attrs.get("steps_run", 0)) for t in study.trials)
    written = [json.loads(o)["profile"] for o, _ in results]
    return {"wall": wall, "trials": len(done), "steps": steps,
            "per_worker": sorted(per_worker.values(), reverse=True),
            "profiles": len({p for p in written if p}), "best": json.loads(results[0][0])["best"]}


def table(title: str, arms: dict[str, dict]) -> None:
    base = arms["sqlite, 1 worker"]
    print(f"\n{title}")
    print(f"{'arm':<22} {'wall s':>7} {'trials':>6} {'trials/min':>10} {'x':>5} "
          f"{'steps':>6} {'steps/min':>9} {'x':>5}  trials per worker")
    for name, a in arms.items():
        rate, srate = a["trials"] / a["wall"] * 60, a["steps"] / a["wall"] * 60
        ratio = rate / (base["trials"] / base["wall"] * 60)
        sratio = srate / (base["steps"] / base["wall"] * 60)
        print(f"{name:<22} {a['wall']:>7.1f} {a['trials']:>6} {rate:>10.1f} {ratio:>5.2f} "
              f"{a['steps']:>6} {srate:>9.0f} {sratio:>5.2f}  {a['per_worker']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="vision")
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--tiny-trials", type=int, default=30)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from tests import pgserver

    why = pgserver.unavailable()
    if why:
        raise SystemExit(f"no PostgreSQL server for this benchmark: {why}")
    server = pgserver.PgServer().start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            real = ["--trials", str(args.trials), "--steps", str(args.steps)]
            arms = {
                "sqlite, 1 worker": run_arm(args.workload, f"sqlite:///{tmp}/a.db", 1, real,
                                            Path(tmp) / "a"),
                "postgresql, 1 worker": run_arm(args.workload, server.create_database(), 1,
                                                real, Path(tmp) / "b"),
                "postgresql, 2 workers": run_arm(args.workload, server.create_database(), 2,
                                                 real, Path(tmp) / "c"),
            }
            table(f"{args.workload}: {args.trials} trials x {args.steps} steps", arms)
            spec = Path(tmp) / "tiny.toml"
            sys_path = str(ROOT)
            if sys_path not in sys.path:
                sys.path.insert(0, sys_path)
            from tests.calibration.helpers import tiny_spec_dict, toml_text

            spec.write_text(toml_text(tiny_spec_dict(trials=args.tiny_trials, steps=6,
                                                     eval_every=2)))
            cheap = ["--spec", str(spec), "--processes", "1"]
            tiny = {
                "sqlite, 1 worker": run_arm(TINY, f"sqlite:///{tmp}/t.db", 1, cheap,
                                            Path(tmp) / "t1"),
                "postgresql, 1 worker": run_arm(TINY, server.create_database(), 1, cheap,
                                                Path(tmp) / "t2"),
            }
            table(f"tiny: {args.tiny_trials} trials of ~1 ms compute (storage cost)", tiny)
            s, p = tiny["sqlite, 1 worker"], tiny["postgresql, 1 worker"]
            extra = (p["wall"] - s["wall"]) / p["trials"] * 1000
            print(f"\nPostgreSQL - SQLite per trial (whole-process wall, tiny): {extra:+.0f} ms")
            same = arms["postgresql, 2 workers"]["best"]["routes"] == \
                arms["sqlite, 1 worker"]["best"]["routes"]
            print(f"profiles written by the 2-worker arm: {arms['postgresql, 2 workers']['profiles']}"
                  f"; its best routes equal one SQLite worker's: {same}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
