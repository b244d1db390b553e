"""One replay rank: ``python -m nfabric_cli.replay.worker PLAN RANK STORE OUT``.

Joins the run's gloo group through a FileStore (no ports, works inside a network namespace),
prepares its input for every case of the plan (a recorded payload sample, cycled over the
ranks, or random data of the recorded size), then runs `warmup` untimed and `repeats` timed
rounds through the real route code (`make_route(spec).reduce(flat, comm, segments)`), each
reduce started right after a barrier (behind a shaped link, after draining its token
bucket). Writes ``OUT/rank<R>.json``: per case the seconds of every repeat, its collectives
(`timed.Event`) and which input it used.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from nfabric_cli.atomic import atomic_write_text


def main(argv: list[str]) -> int:
    plan_path, rank, store_path, out_dir = argv[0], int(argv[1]), argv[2], Path(argv[3])
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    from nfabric_cli.replay.plan import ReplayPlan

    torch.set_num_threads(1)
    plan = ReplayPlan.from_dict(json.loads(Path(plan_path).read_text(encoding="utf-8")))
    store = dist.FileStore(store_path, plan.world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=plan.world_size,
                            timeout=timedelta(seconds=plan.timeout_s))
    try:
        cases = _measure_all(plan, rank)
        atomic_write_text(out_dir / f"rank{rank}.json", json.dumps({"rank": rank, "cases": cases}))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def _measure_all(plan: Any, rank: int) -> list[dict[str, Any]]:
    """Every case, round-robin: a warm-up round, then `repeats` rounds over all cases, so a
    burst of load from other processes hits every case alike, not one case's whole block."""
    import torch.distributed as dist

    from nfabric_cli.replay.timed import TimedComm
    from nfabric_cli.routes import make_route

    comm = TimedComm()
    inputs = [_input(plan, i, rank) for i in range(len(plan.cases))]
    drain = None
    if plan.link_mbit is not None:
        import torch

        from nfabric_cli.ranks.netns import burst_bytes

        drain = torch.zeros(burst_bytes(plan.link_mbit), dtype=torch.uint8)
    out: list[dict[str, Any]] = [
        {"seconds": [], "events": [], "input": source} for _, source in inputs
    ]
    for round_ in range(plan.warmup + plan.repeats):
        for case, (x, _), rec in zip(plan.cases, inputs, out, strict=True):
            y = x.clone()
            if drain is not None:
                # Empty tbf's token bucket first: time the link's sustained rate, which the
                # α-β model describes, not the burst a token bucket lets through at line rate.
                dist.broadcast(drain, 0)
            dist.barrier()
            t0 = comm.start()
            make_route(case.route).reduce(y, comm, tuple(case.segments))
            elapsed = time.perf_counter() - t0
            comm.take()
            if round_ >= plan.warmup:
                rec["seconds"].append(elapsed)
                rec["events"].append([list(e) for e in comm.events])
    return out


def _input(plan: Any, index: int, rank: int):  # noqa: ANN202 - (tensor, "payload"|"random")
    import torch

    from nfabric_cli.replay.trace import load_payload

    case = plan.cases[index]
    rel = case.payload_for(rank)
    if rel is not None:
        arr, _ = load_payload(Path(plan.trace_dir), rel, case.numel)
        if arr is not None:
            return torch.from_numpy(arr.copy()), "payload"
    gen = torch.Generator().manual_seed(1_000_003 * index + rank)
    return torch.randn(case.numel, generator=gen), "random"


if __name__ == "__main__":
    from nfabric_cli.ranks.exit import exit_rank

    exit_rank(main(sys.argv[1:]))
