"""gloo's collectives side by side: why the fabric gathers results with posted sends.

On the same ranks, rounds interleaved, the median time of: the flat all-gather of one result
shard per rank (`all_gather_into_tensor`), the list all-gather, the fabric's all-gather as
posted sends and receives (`Comm.all_gather` on gloo), an all-to-all of the same bytes
(`all_to_all_single`), and the fp32 all-reduce of the whole gradient the shards stand for.
Default sizes: 9.4M elements (one Linear(3072, 3072) weight) with an int8 route's 16-bit
result, i.e. 2 bytes per element gathered.

    python -m bench.collectives [--numel 9437184] [--bytes-per-elem 2] [--world-sizes 2,4]
                                [--repeats 7] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from nfabric_cli.ranks.functions import run_function_ranks
from nfabric_cli.routes.comm import Comm


def _ranks(rank: int, world: int, numel: int, per_elem: int, repeats: int) -> dict:
    comm = Comm()
    shard = numel * per_elem // world
    mine = torch.full((shard,), rank, dtype=torch.uint8)
    out = torch.empty(shard * world, dtype=torch.uint8)
    outs = list(out.view(world, shard).unbind(0))
    grad = torch.randn(numel)
    arms = {
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(out, mine),
        "all_gather (list)": lambda: dist.all_gather(outs, mine),
        "fabric all_gather (posted sends)": lambda: comm.all_gather(mine),
        "posted sends, output reused": lambda: comm.all_gather(mine, out=out),
        "all_to_all_single (same bytes)": lambda: dist.all_to_all_single(out, mine.repeat(world)),
        "fp32 all_reduce (whole gradient)": lambda: dist.all_reduce(grad),
    }
    times: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(repeats + 1):  # round 0 warms up
        for name, fn in arms.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            if r:
                times[name].append(time.perf_counter() - t0)
    got = comm.all_gather(mine).view(world, shard)[:, 0].tolist()
    assert got == list(range(world)), got  # rank order, as the flat all-gather gives
    return {name: statistics.median(ts) for name, ts in times.items()}


def run(numel: int, per_elem: int, world: int, repeats: int) -> dict:
    per_rank = run_function_ranks(_ranks, world, numel, per_elem, repeats)
    slowest = {name: max(r[name] for r in per_rank) for name in per_rank[0]}
    ref = slowest["all_gather_into_tensor"]
    return {"world_size": world, "numel": numel, "gathered_bytes": numel * per_elem,
            "arms": {name: {"ms": 1e3 * s, "vs_flat_all_gather": s / ref}
                     for name, s in slowest.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=3072 * 3072)
    parser.add_argument("--bytes-per-elem", type=int, default=2)
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = [run(args.numel, args.bytes_per_elem, int(w), args.repeats)
               for w in args.world_sizes.split(",")]
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for res in results:
        print(f"W={res['world_size']}, {res['gathered_bytes'] / 1e6:.1f} MB gathered:")
        for name, v in res["arms"].items():
            print(f"  {name:34s} {v['ms']:7.1f} ms  {v['vs_flat_all_gather']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
