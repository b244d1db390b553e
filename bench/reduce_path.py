"""One route's reduce against the fp32 all-reduce of the same tensor, on real gloo ranks.

Per route and world size: the median time of `route.reduce(x, comm)` (encode, the route's
collectives, combine, decode) on one rank's gradient, against the median `dist.all_reduce` of
the same tensor timed in the same processes, rounds interleaved so load on the machine hits
both alike. Ranks run one intra-op thread each, on loopback, rendezvous by a file store.
Issue 16's goals at 9.4M elements (one Linear(3072, 3072) weight), W = 2: sign <= 0.35x and
int8 <= 0.6x the fp32 all-reduce.

    python -m bench.reduce_path [--numel 9437184] [--world-sizes 2,4] [--routes sign,int8,...]
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


def run(numel: int, world_size: int, routes: tuple[str, ...], repeats: int) -> dict:
    per_rank = run_function_ranks(_ranks, world_size, numel, routes, repeats)
    slowest = {name: max(r[name] for r in per_rank) for name in per_rank[0]}
    fp32 = slowest["fp32"]
    return {"numel": numel, "world_size": world_size, "fp32_ms": 1e3 * fp32,
            "routes": {name: {"ms": 1e3 * slowest[name], "ratio": slowest[name] / fp32}
                       for name in routes}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=3072 * 3072)
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--routes", default=",".join(ROUTES))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    routes = tuple(r for r in args.routes.split(",") if r)
    results = [run(args.numel, int(w), routes, args.repeats) for w in args.world_sizes.split(",")]
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for res in results:
        print(f"W={res['world_size']} numel={res['numel']:,}: fp32 all_reduce {res['fp32_ms']:.1f} ms"
              + "".join(f" | {name} {v['ms']:.1f} ms ({v['ratio']:.2f}x)"
                        for name, v in res["routes"].items()), flush=True)


if __name__ == "__main__":
    main()
