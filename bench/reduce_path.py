"""One route's reduce against the fp32 all-reduce of the same tensor, on real gloo ranks.

Per route and world size: the median time of `route.reduce(x, comm)` (encode, the route's
collectives, combine, decode) on one rank's gradient, against the median `dist.all_reduce` of
the same tensor timed in the same processes, rounds interleaved so load on the machine hits
both alike. Ranks run one intra-op thread each, on loopback, rendezvous by a file store.
Issue 16's goals at 9.4M elements (one Linear(3072, 3072) weight), W = 2: sign <= 0.35x and
int8 <= 0.6x the fp32 all-reduce.

The fp32 all-reduce's median moves from one launch of the ranks to the next far more than
within one (23.2-43.0 ms at W = 2 over 25 launches of one session), so each world size is
launched `--launches` times, fresh processes each; the line gives every launch's ratio and
their median.

    python -m bench.reduce_path [--numel 9437184] [--world-sizes 2,4] [--routes sign,int8,...]
                                [--repeats 11] [--launches 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from nfabric_cli.ranks.functions import run_function_ranks
from nfabric_cli.routes import Comm, make_route
from nfabric_cli.routes.spec import RouteSpec

ROUTES = ("sign", "int8", "int4", "ternary")


def _ranks(rank: int, world_size: int, numel: int, routes: tuple[str, ...], repeats: int) -> dict:
    comm = Comm()
    gen = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(numel, generator=gen)
    impls = {name: make_route(RouteSpec(name)) for name in routes}
    times: dict[str, list[float]] = {"fp32": [], **{name: [] for name in routes}}
    buf = x.clone()
    for r in range(repeats + 1):  # round 0 warms up (page faults, kernel build, first sends)
        for name in ("fp32", *routes):
            buf.copy_(x)
            dist.barrier()
            t0 = time.perf_counter()
            if name == "fp32":
                dist.all_reduce(buf)
            else:
                impls[name].reduce(buf, comm)
            seconds = time.perf_counter() - t0
            comm.take()
            if r:
                times[name].append(seconds)
    return {name: statistics.median(ts) for name, ts in times.items()}


def launch(numel: int, world_size: int, routes: tuple[str, ...], repeats: int) -> dict:
    """One launch of the ranks: each route's median against the fp32 one, slowest rank."""
    per_rank = run_function_ranks(_ranks, world_size, numel, routes, repeats)
    slowest = {name: max(r[name] for r in per_rank) for name in per_rank[0]}
    fp32 = slowest["fp32"]
    return {"fp32_ms": 1e3 * fp32,
            "routes": {name: {"ms": 1e3 * slowest[name], "ratio": slowest[name] / fp32}
                       for name in routes}}


def run(numel: int, world_size: int, routes: tuple[str, ...], repeats: int, launches: int) -> dict:
    """`launches` launches; per route the median ratio (and ms) over them, and every launch."""
    runs = [launch(numel, world_size, routes, repeats) for _ in range(launches)]
    mid = statistics.median
    return {"numel": numel, "world_size": world_size, "launches": runs,
            "fp32_ms": mid(r["fp32_ms"] for r in runs),
            "routes": {name: {"ms": mid(r["routes"][name]["ms"] for r in runs),
                              "ratio": mid(r["routes"][name]["ratio"] for r in runs)}
                       for name in routes}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=3072 * 3072)
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--routes", default=",".join(ROUTES))
    parser.add_argument("--repeats", type=int, default=11, help="timed rounds per launch")
    parser.add_argument("--launches", type=int, default=3, help="fresh launches of the ranks")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    routes = tuple(r for r in args.routes.split(",") if r)
    results = [run(args.numel, int(w), routes, args.repeats, args.launches)
               for w in args.world_sizes.split(",")]
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for res in results:
        runs = res["launches"]
        each = ", ".join(f"{r['fp32_ms']:.1f}" for r in runs)
        line = (f"W={res['world_size']} numel={res['numel']:,}, {len(runs)} launches: "
                f"fp32 all_reduce {res['fp32_ms']:.1f} ms [{each}]")
        for name, v in res["routes"].items():
            each = ", ".join(f"{r['routes'][name]['ratio']:.2f}" for r in runs)
            line += f" | {name} {v['ms']:.1f} ms, {v['ratio']:.2f}x [{each}]"
        print(line, flush=True)


if __name__ == "__main__":
    main()
