"""Cost-model error: predicted vs measured bucket time on shaped links, fit by replay.

One real trace is recorded (2 gloo ranks train a small MLP with `attach(trace_dir=...)`: a
big Linear and a 1,056-element Linear on sign, the rest on fp32). Then, per link rate and
world size, one replay run puts W ranks behind a `tc tbf`-shaped loopback (a fresh network
namespace, every rank's bytes on one link) and measures, side by side: both recorded sign
groups through the real sign reducer, sharded and central, each followed by an fp32
all-reduce of the same size, a codec sweep per reducer (4 sizes of random data, 1,000 to
262,656 elements) and an fp32 size sweep. α and β are fitted from the fp32 all-reduces; the
codec (rates and fixed cost per call) and the per-kind latencies from the codec sweeps only;
the recorded sign groups are predictions:

- `pred` / `meas`: the whole reduce, predicted by the fitted model (random-data sweep in,
  recorded payloads out: the 262,656-element group has the sweep's top size, the 1,056 one
  sits next to its 1,000);
- `old err`: the model before fixed costs, in the same run: the same α-β, one α per hop for
  every collective kind, codec GB/s through the origin from the recorded groups' own stages
  (as `nfabric replay` fitted it before), no fixed cost per call;
- `dflt err`: the fitted link and per-kind latencies with the default codec tables and fixed
  costs (`substrate/model.py`) instead of the replayed ones;
- `gate`: the capacity gate's verdict against the measured fp32 time ("ok" when they agree).

Needs root (ip netns, tc). Prints `uptime` first and last: the host may be shared.

    OMP_NUM_THREADS=1 python -m bench.capacity_model_error [--rates 50,100,400,1000]
        [--worlds 2,4] [--hidden 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

from nfabric_cli.replay.fit import fit_codec
from nfabric_cli.replay.launch import run_ranks
from nfabric_cli.replay.plan import ROLE_SWEEP, ROLE_TRACE, ReplayPlan, build_plan
from nfabric_cli.replay.run import aggregate, check_payloads, fit_report, stage_samples
from nfabric_cli.replay.trace import Trace, load_trace
from nfabric_cli.substrate.cost import route_cost

TOPOLOGIES = ("sharded", "central")


def _record(rank: int, world: int, trace_dir: str, hidden: int) -> int:
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from nfabric_cli import attach
    from nfabric_cli.binding import compile_profile, static_profile

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 32), nn.Tanh(),
                          nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 10))
    ddp = DDP(model, bucket_cap_mb=64)  # one bucket
    # Two sign groups (regions): the big layer and a 1,056-element one; the rest on fp32.
    rules = [("2.*", "fp32"), ("4.*", "sign"), ("6.*", "fp32")]
    bindings = compile_profile(static_profile(model, "sign", rules), model,
                               world_size=world, bucket_cap_mb=64)
    state = attach(ddp, bindings, total_steps=3, trace_dir=trace_dir, gate=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x, y = torch.randn(32, hidden, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    state.close()
    return rank


def record(trace_dir: Path, hidden: int) -> Trace:
    """A real 2-rank trace, reduced to its sign groups (one segment order each is enough)."""
    from tests.distutil import run_ranks as spawn

    spawn(_record, 2, str(trace_dir), hidden)
    trace = load_trace(trace_dir)
    sign: dict[int, object] = {}
    for g in trace.groups:
        if g.spec.name == "sign":
            sign.setdefault(g.numel, g)
    return dataclasses.replace(trace, groups=tuple(sign.values()))


def merged_plan(trace: Trace, w: int, mbit: float, repeats: int) -> ReplayPlan:
    """Both reducers' cases (each with its fp32 twin, and its codec sweep) and one fp32 sweep,
    in one run of the ranks."""
    plans = [build_plan(trace, w, topo, repeats, mbit) for topo in TOPOLOGIES]
    cases = [c for c in plans[0].cases if c.role != ROLE_SWEEP]
    offset = len(cases)
    cases += [dataclasses.replace(c, twin_of=None if c.twin_of is None else c.twin_of + offset)
              for c in plans[1].cases if c.role != ROLE_SWEEP]
    cases += [c for c in plans[0].cases if c.role == ROLE_SWEEP]
    return dataclasses.replace(plans[0], cases=cases, topology=None)


def measure(trace: Trace, w: int, mbit: float, repeats: int) -> list[dict]:
    plan = merged_plan(trace, w, mbit, repeats)
    results = aggregate(plan, run_ranks(plan))
    report = fit_report(trace, plan, results, shared_link=True, out=None)
    sub = report.substrate
    default_codec = dataclasses.replace(sub, encode_gbps={}, reduce_gbps={}, decode_gbps={},
                                        codec_call_us={})
    recorded = [r for r in results if plan.cases[r.index].role == ROLE_TRACE]
    old_codec = fit_codec(stage_samples(plan, recorded), affine=False).rates
    old = dataclasses.replace(sub, codec_call_us={}, latency_us_by_kind={}, **old_codec)
    rows = []
    for g, r in zip(report.groups, recorded, strict=True):
        spec = plan.cases[r.index].route
        cost = route_cost(spec, g["numel"], w, sub)
        rows.append({
            "mbit": mbit, "W": w, "route": g["route"], "numel": g["numel"],
            "fp32_meas_s": g["fp32_measured_s"], "fp32_pred_s": g["fp32_predicted_s"],
            "meas_s": g["measured_s"], "pred_s": g["predicted_s"],
            "old_pred_s": route_cost(spec, g["numel"], w, old).total_s,
            "stages_s": g["stages_s"], "pred_codec_s": cost.codec_s,
            "dflt_codec_s": route_cost(spec, g["numel"], w, default_codec).total_s,
            "verdict": g["verdict"], "measured_verdict": g["measured_verdict"],
            "alpha_us": sub.alpha * 1e6, "fit_mbit": sub.link_bytes_per_s * 8 / 1e6,
            "fit_rms": report.link.rms_rel_error, "call_us": sub.codec_call_us.get("sign"),
            "latency_us_by_kind": sub.latency_us_by_kind,
        })
    return rows


def _err(pred: float, meas: float) -> str:
    return f"{(pred / meas - 1) * 100:+5.0f}%"


def print_rows(rows: list[dict]) -> None:
    print(f"\n{'Mbit/s':>6} {'W':>2} {'fit Mbit/s':>10} {'α us':>5} {'call us':>7} "
          f"{'route':<13} {'numel':>7} {'meas ms':>8} {'pred ms':>8} {'err':>6} {'old err':>7} "
          f"{'dflt err':>8} {'gate':>11} {'fp32 meas':>9} {'fp32 pred':>9} {'fp32 err':>8}")
    for r in rows:
        ok = "ok" if r["verdict"] == r["measured_verdict"] else "WRONG"
        print(f"{r['mbit']:>6g} {r['W']:>2} {r['fit_mbit']:>10.4g} {r['alpha_us']:>5.0f} "
              f"{r['call_us'] or 0:>7.0f} {r['route']:<13} {r['numel']:>7} "
              f"{r['meas_s'] * 1e3:>8.3g} {r['pred_s'] * 1e3:>8.3g} "
              f"{_err(r['pred_s'], r['meas_s']):>6} {_err(r['old_pred_s'], r['meas_s']):>7} "
              f"{_err(r['dflt_codec_s'], r['meas_s']):>8} "
              f"{r['verdict'][:5] + ' ' + ok:>11} {r['fp32_meas_s'] * 1e3:>9.4g} "
              f"{r['fp32_pred_s'] * 1e3:>9.4g} {_err(r['fp32_pred_s'], r['fp32_meas_s']):>8}")
    kinds = {(r["mbit"], r["W"]): r["latency_us_by_kind"] for r in rows}
    for (mbit, w), lat in kinds.items():
        print(f"  {mbit:g} Mbit/s, W={w}: latency per round, us: "
              + ", ".join(f"{k} {v:.0f}" for k, v in lat.items()))

    def within(key: str) -> int:
        return sum(abs(r[key] / r["meas_s"] - 1) <= 0.25 for r in rows)

    fp32 = [abs(r["fp32_pred_s"] / r["fp32_meas_s"] - 1) <= 0.25 for r in rows]
    agree = [r["verdict"] == r["measured_verdict"] for r in rows]
    print(f"\nsign within 25 %: {within('pred_s')}/{len(rows)} (old model, same run: "
          f"{within('old_pred_s')}/{len(rows)}; default codec: {within('dflt_codec_s')}/"
          f"{len(rows)}); median |err| {_median_err(rows, 'pred_s'):.0f} % (old "
          f"{_median_err(rows, 'old_pred_s'):.0f} %); fp32 twins within 25 %: "
          f"{sum(fp32)}/{len(rows)}; gate agrees with measurement: {sum(agree)}/{len(rows)}")


def _median_err(rows: list[dict], key: str) -> float:
    return statistics.median(abs(r[key] / r["meas_s"] - 1) * 100 for r in rows)


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="50,100,400,1000", help="Mbit/s, comma-separated")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--hidden", type=int, default=512, help="body Linear(H, H): H*H+H on sign")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    print("load before:", _uptime())
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="nfabric-bench-") as tmp:
        trace = record(Path(tmp) / "trace", args.hidden)
        print("trace: sign groups of " + ", ".join(
            f"{g.numel:,} elements ({len(g.payloads)} payload samples)" for g in trace.groups))
        for warning in check_payloads(build_plan(trace, 4)):
            print("note:", warning)
        for mbit in (float(x) for x in args.rates.split(",")):
            for w in (int(x) for x in args.worlds.split(",")):
                new = measure(trace, w, mbit, args.repeats)
                print_rows(new)
                print("load:", _uptime())
                rows += new
    print("\n== all")
    print_rows(rows)
    print("load after:", _uptime())
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
