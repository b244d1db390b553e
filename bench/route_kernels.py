"""Route codecs, native kernels vs the torch path, each against a read pass in the same run.

Prints encode/decode GB/s of fp32 input per low-bit route and the ratio to `x.sum()` over the
same buffer (one thread), for the native kernels and for NFABRIC_NO_NATIVE=1. Issue 2's goal:
sign and int8 encoders at >= 50 % of the read pass.
Usage: python -m bench.route_kernels [--size N] [--repeats R] [--json]
"""

from __future__ import annotations

import argparse
import json

from nfabric_cli.benchmarks.routes import bench_routes

ROUTES = ("int8", "int4", "ternary", "sign")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1 << 24)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    runs = {
        "native": bench_routes(args.size, args.repeats, ROUTES, native=True),
        "torch": bench_routes(args.size, max(1, args.repeats // 2), ROUTES, native=False),
    }
    if args.json:
        print(json.dumps(runs, indent=2))
        return
    for label, run in runs.items():
        print(f"{label}: {run['kernels']}; read pass {run['read_gbps']:.2f} GB/s, "
              f"{args.size:,} fp32 elements, 1 thread")
        print(f"  {'route':8} {'encode GB/s':>12} {'vs read':>8} {'decode GB/s':>12} {'vs read':>8}"
              f" {'reduce decode':>14} {'vs read':>8}")
        for name, r in run["routes"].items():
            reduce = (f" {r['reduce_decode_gbps']:14.2f} {r['reduce_decode_vs_read']:8.0%}"
                      if "reduce_decode_gbps" in r else "")
            print(f"  {name:8} {r['encode_gbps']:12.2f} {r['encode_vs_read']:8.0%} "
                  f"{r['decode_gbps']:12.2f} {r['decode_vs_read']:8.0%}{reduce}")
    goal = all(runs["native"]["routes"][n]["encode_vs_read"] >= 0.5 for n in ("sign", "int8"))
    print(f"goal (sign and int8 encode >= 50% of read): {'met' if goal else 'NOT met'}")


if __name__ == "__main__":
    main()
