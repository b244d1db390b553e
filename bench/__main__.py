"""`make bench`: the quick benchmarks, each printing ratios measured side by side in one run.

    python -m bench            # quick set (a few minutes on 2 cores)
    python -m bench all        # also the long figure benchmarks (tens of minutes, root for links)

Every benchmark can also run alone: `python -m bench.<name> --help`.
"""

from __future__ import annotations

import subprocess
import sys

QUICK = [
    ("routes: codec GB/s vs a read pass of the same buffer", [sys.executable, "-m", "nfabric_cli", "bench", "routes"]),
    ("runtime: all-fp32 profile step time / plain DDP (goal <= 1.05); the monitor's fallback path beside it", [sys.executable, "-m", "nfabric_cli", "bench", "runtime"]),
    ("routes: one route's reduce / the fp32 all-reduce of 9.4M elements, W=2 (goal sign <= 0.35, int8 <= 0.6)", [sys.executable, "-m", "bench.reduce_path", "--world-sizes", "2"]),
    ("collectives: gloo's all-gathers vs the fabric's posted sends, 9.4M x 2 B gathered", [sys.executable, "-m", "bench.collectives", "--world-sizes", "2"]),
    ("calibration: simulated 4 workers vs real 4-rank DDP (goal <= 0.5x)", [sys.executable, "-m", "bench.calibrate_sim_vs_ddp"]),
    ("health: a ramp's element clip on a 47M-parameter update / the model's compute, and / the first formula", [sys.executable, "-m", "bench.ramp_cost"]),
    ("checkpoints: host memory of the fabric state per rank, gathered to all / to rank 0 / per rank", [sys.executable, "-m", "bench.checkpoint_memory"]),
]
LONG = [
    ("runtime: 47M-parameter step, fabric fp32/sign/int8, PyTorch hooks / plain DDP, same round (goal sign <= 1.0, fp32 <= 1.05)", [sys.executable, "-m", "bench.model_step"]),
    ("teardown: 30 runs of a multi-collective hook, abnormal exits (goal 0)", [sys.executable, "-m", "bench.teardown", "30"]),
    ("calibration: Hyperband vs no pruning, steps to the same best (goal <= 40 %)", [sys.executable, "-m", "bench.calibrate_pruning"]),
    ("calibration: 1 vs 2 workers on one study, SQLite vs PostgreSQL", [sys.executable, "-m", "bench.calibrate_workers"]),
    ("validation: static vs profile vs fp32 on lm and vision, 4 ranks", [sys.executable, "-m", "bench.validate_figures"]),
    ("validation: step time behind shaped links vs PyTorch hooks (root)", [sys.executable, "-m", "bench.validate_link"]),
    ("validation: the same sweep, arms interleaved in the same ranks (root; goal profile <= 1.05x min(fp32, static), <= 0.8x PowerSGD at 20 Mbit/s)", [sys.executable, "-m", "bench.link_paired"]),
    ("capacity: cost-model error on shaped links, fit by replay (root)", [sys.executable, "-m", "bench.capacity_model_error"]),
    ("workloads: fp32 vs all-sign vs head-fp32 at 4 workers", [sys.executable, "-m", "bench.workload_sensitivity"]),
    ("calibration: run-to-run noise, fp32 against itself in another summation order (glyphs, 5 seeds)", [sys.executable, "-m", "bench.noise_floor", "--tolerance", "0.02"]),
    ("health: monitor never worse than none, faults rescued, false trips (goal 0 / all / <= 1 %)", [sys.executable, "-m", "bench.robustness"]),
]


def main(argv: list[str]) -> int:
    todo = QUICK + (LONG if argv[:1] == ["all"] else [])
    failed = 0
    for title, cmd in todo:
        print(f"\n== {title}\n$ {' '.join(cmd[1:])}", flush=True)
        failed += subprocess.run(cmd).returncode != 0
    if argv[:1] != ["all"]:
        print("\n(long benchmarks: python -m bench all)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
