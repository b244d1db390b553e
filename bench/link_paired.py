"""Step time behind a shaped link, the arms interleaved: ratios a shared host cannot skew.

`bench.validate_link` runs `nfabric validate`, whose arms train one after another, each for a
few seconds. On this shared 2-core host an arm's median step moves by 10-20 % from one such
window to the next (static at 200 Mbit/s: 14.0, 17.6, 19.0 ms in three runs of 60 steps; at
300 steps 13.9, 17.7, 13.9), which is more than the differences issue 16's goals are about.
Here the same arms (`validation/arms.py`: plain DDP, static sign, the profile with its monitor
and gate, PyTorch's PowerSGD and fp16 hooks) train side by side in the same rank processes,
each on its own model: round by round, every arm runs a block of steps in turn (the orders
of a Williams design, `round_orders`), its ranks free-running within the block as in
`validate`. Load that
drifts hits every arm of a round alike, so each round gives one ratio and the rounds give its
spread.

A step's time is the slowest rank's, as in `validate`; an arm's round is the median of its
block; each arm's first step (allocation, DDP's bucket rebuild) is left out. The profile arm
pays for its own probe steps (`--gate measure`, no substrate) where they fall. Printed per
rate: each arm's median step over all its steps, and per ratio the median over rounds with
[min, max] and a distribution-free interval for that median of at least 90 % confidence
(with 5 rounds or more; it says whether a median above a goal is a miss or could be the
host). For profile / min(fp32, static) the min is the arm faster over the whole run (by its
median step), and each round is divided by that arm's block: a min taken round by round picks,
where fp32 and static tie, whichever drew the faster block, and reads high by about half a
round's spread (vision over loopback, session 36: 1.195 per-round min, 1.172 against the faster
arm). The same ratio on the run's medians is printed too, and on the run's total step time,
which alone holds the probe's steps on the slower path (a median leaves them out: at 50
Mbit/s three 128 ms fp32 probe steps put the total at 1.115 where the rounds read 1.077).
The goals are issue 16's: profile <= 1.05 x min(fp32, static) at every rate, and at 20 Mbit/s
profile <= 0.8 x PowerSGD and <= 0.08 x fp32. `--reread F` prints a saved `--json` run's
report again without running it.

`--repeat N` measures each rate N times, each in fresh rank processes, and prints after the
runs the median over them of each ratio's per-round median, with [min, max]: from one
40-round run to the next the same ratio moved by up to 6 % on this host (transformer at
50 Mbit/s: 1.004, then 1.067, session 38; the same profile 1.053, then 1.011, session 39),
more than one run's interval says, so a run is one sample of a goal a few per cent wide. It
then prints every ratio again over all the runs' rounds pooled, with the interval of that
median: k runs of 40 rounds are one sample of 40k rounds from k fresh sets of processes.

An arm may run twice, as `static#2` (any arm, any suffix after `#`): a second, identical arm
on its own model, reported against the first (`static#2/static`). That ratio is the run's own
floor, what two identical arms read apart: 0.988-1.016 at every shaped rate in one transformer
run of 40 rounds (1.039 over loopback), 0.977-1.044 over three runs each at 50 and 100 Mbit/s
(session 39). A profile / min(fp32, static) a few per cent above 1 is judged beside it.

The arm `unprobed` is the profile arm on the model gate: the same routes and monitor, and with
no substrate every bucket as written, nothing timed. `profile/unprobed` is what the measured
gate's probing costs, in the same run. At 50 Mbit/s on transformer.v6 it read 1.008 [0.992,
1.021] over three runs, where measured-gate runs against model-gate runs had put the gate at
3-5 % (session 41, docs/validation.md). `unprobed/static` is what the monitor costs in time:
the same routes, with and without it.

Needs root for the shaped rates (ip netns, tc); without it they are skipped with the reason,
and rate 0 (plain loopback, no namespace) still runs.

    OMP_NUM_THREADS=1 python -m bench.link_paired [--rates 20,50,100,200,500,1000,0]
        [--rounds 10] [--block 20] [--arms fp32,static,profile,powersgd,fp16,unprobed,static#2]
        [--workload vision] [--profile PATH] [--world-size 2] [--gate measure] [--repeat 1]

Without --profile the workload's hand-written one is used, as in `bench.validate_link`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

from bench.validate_link import head_fp32_profile, values_over_runs

DEFAULT_ARMS = ("fp32", "static", "profile", "powersgd", "fp16")
ARMS = (*DEFAULT_ARMS, "unprobed")
MONITOR_SHOWN = 8  # the profile arm's health-monitor events printed per rate


def _rank(rank: int, world: int, cfg: dict) -> dict[str, list[float]]:
    """One rank: every arm on its own DDP model, trained block by block, arms in turn."""
    import torch
    import torch.distributed as dist

    from nfabric_cli.ranks.loop import RankRng, workload_ddp, workload_steps
    from nfabric_cli.validation.arms import ArmContext
    from nfabric_cli.workloads.registry import get_workload

    wl = get_workload(cfg["workload"])
    steps = cfg["rounds"] * cfg["block"]
    ctx = ArmContext(world_size=world, rank=rank, steps=steps, seed=cfg["seed"],
                     source=cfg["profile"], bucket_cap_mb=None,
                     measure_gate=cfg["gate"] == "measure")
    arms = {}
    for name in cfg["arms"]:
        ddp = workload_ddp(wl, cfg["seed"])
        arm = _make_arm(name, ddp, ctx)
        arms[name] = (ddp, arm, *wl.make_optimizer(ddp.parameters(), steps),
                      RankRng(cfg["seed"]))  # each arm's own stream, carried across blocks
    times: dict[str, list[float]] = {name: [] for name in cfg["arms"]}
    names = list(cfg["arms"])
    for r in range(cfg["rounds"]):
        block = range(r * cfg["block"], (r + 1) * cfg["block"])
        for name in round_orders(names, r):
            ddp, arm, opt, sched, rng = arms[name]
            dist.barrier()
            for _, _, seconds in workload_steps(ddp, arm, wl, opt, sched, block, rank, world,
                                                cfg["seed"], rng=rng):
                times[name].append(seconds)
    events = getattr(arms["profile"][1], "events", []) if "profile" in arms else []
    probe = [e for e in events if e.get("from") == "probe"]
    monitor = [e for e in events if e.get("from") != "probe"]
    for _, arm, *_ in arms.values():
        arm.close()
    slowest = torch.tensor([times[n] for n in names], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return {"times": {n: slowest[i].tolist() for i, n in enumerate(names)}, "probe": probe,
            "monitor": monitor}


def base_arm(name: str) -> str:
    """The arm a name runs: `static#2` is a second `static` (the module docstring)."""
    return name.split("#", 1)[0]


def _make_arm(name: str, ddp: Any, ctx: Any) -> Any:
    """`validation.arms`' arm for `name`; `unprobed` is the profile arm on the model gate,
    which without a substrate sends every bucket as written (the module docstring)."""
    from nfabric_cli.validation.arms import make_arm

    base = base_arm(name)
    if base == "unprobed":
        return make_arm("profile", ddp, dataclasses.replace(ctx, measure_gate=False))
    return make_arm(base, ddp, ctx)


def round_orders(names: list[str], r: int) -> list[str]:
    """Round `r`'s arm order: the rows of a Williams design, in turn. Every arm runs in every
    position equally often and directly after every other arm equally often (every n rounds
    for an even number of arms n, every 2n for an odd one).

    Why: an arm's block ran measurably slower or faster depending on which arm ran before it.
    With the order merely rotated each arm always follows the same one, and the transformer
    profile at 50 Mbit/s read 1.112 x static after static, 1.047 x with the two swapped
    (40 rounds each, session 37)."""
    n = len(names)
    first = [0]  # 0, 1, n-1, 2, n-2, ...: successive differences cover every nonzero shift
    for j in range(1, n):
        first.append((j + 1) // 2 if j % 2 else n - j // 2)
    rows = [[(k + shift) % n for k in first] for shift in range(n)]
    if n % 2:  # an odd design needs each row reversed too
        rows += [row[::-1] for row in rows]
    return [names[k] for k in rows[r % len(rows)]]


def _inner(cfg_path: str) -> None:
    """Inside the namespace: run the ranks, print their step times as one JSON line."""
    from bench.link_paired import _rank as rank_fn  # importable by name in the ranks
    from nfabric_cli.ranks.functions import run_function_ranks

    cfg = json.loads(Path(cfg_path).read_text())
    times = run_function_ranks(rank_fn, cfg["world_size"], cfg)[0]
    print("TIMES " + json.dumps(times), flush=True)


def measure(cfg: dict, mbit: float, root: Path) -> dict:
    """Every arm's per-step times (slowest rank) at `mbit` (0: unshaped loopback), and the
    profile arm's measured-gate decisions."""
    from nfabric_cli.ranks.netns import link_wrap
    from nfabric_cli.ranks.sessions import rank_env

    path = root / f"cfg-{mbit:g}.json"
    path.write_text(json.dumps(cfg))
    cmd = [sys.executable, "-m", "bench.link_paired", "--inner", str(path)]
    with link_wrap(mbit) as wrap:
        out = subprocess.run(wrap(cmd), env=rank_env(loopback=True), capture_output=True,
                             text=True)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("TIMES ")]
    if out.returncode or not lines:
        sys.exit(f"ranks failed at {mbit:g} Mbit/s:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("TIMES "):])


def per_round(times: list[float], rounds: int, block: int) -> list[float]:
    """The median step of each round's block (the arm's first step left out)."""
    return [statistics.median(times[max(r * block, 1):(r + 1) * block]) for r in range(rounds)]


def median_interval(values: list[float], level: float = 0.9) -> tuple[float, float, float] | None:
    """A distribution-free confidence interval for the median of `values`, of coverage at
    least `level`: the order statistics [x_(k), x_(n+1-k)] with the largest k for which
    P(Binomial(n, 1/2) < k) stays within (1 - level) / 2. Returns (low, high, the coverage
    it achieves: 1 - 2 P(B < k), above `level` since k is whole), or None when no k qualifies
    (fewer than 5 values at 90 %).

    Why: rounds on this host spread 10-20 %, and the goal (<= 1.05) is a few % wide; the
    interval says whether a median above it is a miss or could be the host."""
    xs, n = sorted(values), len(values)
    tail, below, k, outside = (1 - level) / 2, 0.0, 0, 0.0
    for j in range(n):
        below += math.comb(n, j) / 2**n  # P(B <= j)
        if below > tail:
            break
        k, outside = j + 1, below
    return (xs[k - 1], xs[n - k], 1 - 2 * outside) if k else None


def _title(mbit: float) -> str:
    return f"{mbit:g} Mbit/s" if mbit else "loopback, unshaped"


#: Arm over arm, each round, where both ran: against PowerSGD (the issue's goal), what the
#: measured gate's probing costs (`profile/unprobed`) and what the monitor costs
#: (`unprobed/static`: the same routes, with and without it).
PAIRS = (("profile", "powersgd"), ("profile", "unprobed"), ("unprobed", "static"))

class Ratios(NamedTuple):
    """One run's ratios per round, and what the goal's "min" was read from."""

    per_round: dict[str, list[float]]
    overall: dict[str, float]  # each arm's median step over the run
    total: dict[str, float]  # each arm's total step time (the probe's steps included)
    faster: str | None  # min(fp32, static): the arm faster over the run, if both ran


def round_ratios(measured: dict, rounds: int, block: int) -> Ratios:
    """Every ratio the bench reports, per round, for one run of one rate."""
    times = measured["times"]
    rows = {n: per_round(t, rounds, block) for n, t in times.items()}
    overall = {n: statistics.median(t[1:]) for n, t in times.items()}
    total = {n: math.fsum(t[1:]) for n, t in times.items()}  # what the run took

    def over(num: str, den: list[float]) -> list[float]:
        return [a / b for a, b in zip(rows[num], den, strict=True)]

    ratios: dict[str, list[float]] = {}
    if "fp32" in rows:
        ratios.update({f"{n}/fp32": over(n, rows["fp32"]) for n in rows if n != "fp32"})
    faster = None
    if {"profile", "static", "fp32"} <= rows.keys():
        faster = min(("fp32", "static"), key=overall.__getitem__)  # over the whole run
        ratios["profile/min(fp32,static)"] = over("profile", rows[faster])
    for num, den in PAIRS:
        if {num, den} <= rows.keys():
            ratios[f"{num}/{den}"] = over(num, rows[den])
    for name in rows:  # a second, identical arm: the run's own floor
        base = base_arm(name)
        if base != name and base in rows:
            ratios[f"{name}/{base}"] = over(name, rows[base])
    return Ratios(ratios, overall, total, faster)


def _print_ratio(key: str, vals: list[float], row: dict[str, object]) -> None:
    """Put one ratio's median, range and interval over the rounds `vals` in `row`, and print
    them."""
    med = statistics.median(vals)
    row[key] = round(med, 3)
    row[f"{key} range"] = [round(min(vals), 3), round(max(vals), 3)]
    ci = median_interval(vals)
    if ci is not None:
        row[f"{key} interval"] = [round(ci[0], 3), round(ci[1], 3), round(ci[2], 3)]
    print(f"  {key:<26} median {med:.3f}  [{min(vals):.3f}, {max(vals):.3f}] over rounds"
          + (f"; the median in [{ci[0]:.3f}, {ci[1]:.3f}] at {ci[2]:.1%} confidence"
             if ci else ""))


def report(mbit: float, measured: dict, rounds: int, block: int) -> dict:
    """Print one rate's medians, per-round ratios and gate decisions; return its summary row."""
    ratios, overall, total, faster = round_ratios(measured, rounds, block)
    title = _title(mbit)
    print(f"\n== {title}: {rounds} rounds of {block} steps per arm, arms interleaved")
    print("median step, ms: " + ", ".join(f"{n} {1e3 * v:.1f}" for n, v in overall.items()))
    row: dict[str, object] = {"mbit": mbit}
    for key, vals in ratios.items():
        _print_ratio(key, vals, row)
    if faster is not None:  # the same goal on the run's medians and totals
        on_medians = overall["profile"] / overall[faster]
        on_total = total["profile"] / total[faster]
        row["min(fp32,static)"] = faster
        row["profile/min(fp32,static) of run medians"] = round(on_medians, 3)
        print(f"  {'profile/min(fp32,static)':<26} {on_medians:.3f} on the run's median steps"
              f" (min: {faster}, the faster over the run)")
        # a median leaves out the probe's steps on the slower path: the total holds them
        row["profile/min(fp32,static) of run totals"] = round(on_total, 3)
        print(f"  {'profile/min(fp32,static)':<26} {on_total:.3f} on the run's total step time"
              " (the gate's probe steps included)")
    for event in measured["probe"]:
        print(f"  gate: step {event['step']} -> {event['to']}: {event['reason']}")
    monitor = measured.get("monitor", [])  # (runs saved before it was kept have none)
    row["monitor events"] = len(monitor)
    for event in monitor[:MONITOR_SHOWN]:  # a route the monitor changed costs time too
        print(f"  monitor: step {event['step']} {event['scope']}: {event['from']} -> "
              f"{event['to']}: {event.get('reason', '')[:90]}")
    if len(monitor) > MONITOR_SHOWN:
        print(f"  monitor: ... {len(monitor) - MONITOR_SHOWN} more events (--json keeps them)")
    return row


def over_runs(rows: list[dict]) -> dict:
    """One rate's runs (`report`'s rows) as one row: per ratio, the median over the runs of
    its per-round median, with the runs' own values."""
    out: dict[str, object] = {"mbit": rows[0]["mbit"], "runs": len(rows)}
    for key, values in values_over_runs(rows).items():
        if key != "mbit":
            out[key] = round(statistics.median(values), 3)
            out[f"{key} over runs"] = values
    return out


def pooled(runs: list[dict], rounds: int, block: int) -> dict[str, list[float]]:
    """Per ratio every run has, the per-round ratios of all the runs together (each run's
    min(fp32, static) its own)."""
    each = [round_ratios(measured, rounds, block).per_round for measured in runs]
    return {key: [v for r in each for v in r[key]] for key in each[0]
            if all(key in r for r in each)}


def report_runs(mbit: float, runs: list[dict], rounds: int, block: int) -> dict:
    """Report each run of a rate, then (several runs) the ratios over the runs: the median of
    the runs' per-round medians, and the median of all their rounds pooled, with its interval.

    Why both: runs of 40 rounds read the same ratio up to 4-6 % apart (the module docstring),
    so one run's interval is too narrow for the next run; pooled, k runs are one sample of
    40k rounds, and the interval of its median is the one a goal is judged on."""
    rows = [report(mbit, measured, rounds, block) for measured in runs]
    if len(rows) == 1:
        return rows[0]
    row = over_runs(rows)
    title = _title(mbit)
    print(f"\n== {title}, over {len(rows)} runs (fresh processes): median of the runs' "
          "per-round medians [min, max]")
    for key, values in row.items():
        if key.endswith(" over runs"):
            name = key[: -len(" over runs")]
            print(f"  {name:<26} {row[name]:.3f}  [{min(values):.3f}, {max(values):.3f}]")
    print(f"== {title}, the {len(rows)} runs' {len(rows) * rounds} rounds pooled:")
    for key, vals in pooled(runs, rounds, block).items():
        _print_ratio(f"{key} pooled", vals, row)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner", help=argparse.SUPPRESS)
    parser.add_argument("--rates", default="20,50,100,200,500,1000,0",
                        help="Mbit/s, comma separated; 0: loopback unshaped")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--block", type=int, default=20, help="steps per arm per round")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS))
    parser.add_argument("--workload", default="vision")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", type=Path, default=None)
    parser.add_argument("--gate", default="measure", choices=("model", "measure"))
    parser.add_argument("--json", type=Path, default=None,
                        help="Also write every arm's per-step times, the gate's decisions and the "
                        "monitor's events here.")
    parser.add_argument("--repeat", type=int, default=1,
                        help="Runs per rate, each in fresh processes (default 1).")
    parser.add_argument("--reread", type=Path, default=None,
                        help="Print the report of a run saved with --json, without running.")
    args = parser.parse_args()
    if args.inner:
        _inner(args.inner)
        return
    if args.reread:
        saved = json.loads(args.reread.read_text())
        rounds, block = saved["config"]["rounds"], saved["config"]["block"]
        summary = [report_runs(float(text), runs if isinstance(runs, list) else [runs], rounds,
                               block) for text, runs in saved["rates"].items()]
    else:
        summary = run(args)
    print("\nsummary (median over rounds, [min, max]):")
    for row in summary:
        print(json.dumps(row))


def run(args: argparse.Namespace) -> list[dict]:
    """Measure every rate of `args.rates` and report it; save the raw times to --json."""
    from nfabric_cli.ranks.netns import link_available

    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if base_arm(a) not in ARMS]
    if (unknown or len(set(arms)) < len(arms) or args.rounds < 2 or args.block < 2
            or args.repeat < 1):
        sys.exit(f"bad arguments: arms from {', '.join(ARMS)} (a second one as static#2), each "
                 "once; --rounds and --block >= 2, --repeat >= 1")
    with tempfile.TemporaryDirectory(prefix="nfabric-bench-paired-") as tmp:
        root = Path(tmp)
        profile = args.profile or head_fp32_profile(args.workload, root / "head-fp32.parquet")
        cfg = {"workload": args.workload, "world_size": args.world_size, "seed": args.seed,
               "profile": str(Path(profile).resolve()), "gate": args.gate, "arms": arms,
               "rounds": args.rounds, "block": args.block}
        summary, raw = [], {}
        for text in args.rates.split(","):
            mbit = float(text)
            why = link_available() if mbit else None
            if why:  # not root, or no iproute2: the unshaped rate still runs
                print(f"\n== {mbit:g} Mbit/s skipped: {why}")
                continue
            runs = [measure(cfg, mbit, root) for _ in range(args.repeat)]
            raw[text] = runs[0] if args.repeat == 1 else runs  # (one run: as before)
            summary.append(report_runs(mbit, runs, args.rounds, args.block))
    if args.json:
        args.json.write_text(json.dumps({"config": cfg, "rates": raw, "summary": summary}))
    return summary


if __name__ == "__main__":
    main()
