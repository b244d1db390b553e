"""Robustness of the health monitor: does it ever make a run worse, and does it rescue faults?

For each workload's committed reference profile (`profiles/<workload>/`, newest version), over
seeds x run lengths (the length the profile was calibrated at, 2x, 4x) x world sizes, side by side on
the same batches:

- `fp32`: every parameter on fp32 (the reference), with the health monitor's detectors running
  passively (nothing is compressed, nothing is wrong: every trip signal is a false trip);
- `static`: the profile's routes with no monitor; `profile`: the same routes with it;
- `static+spike` / `profile+spike`: a `spike` fault (rank 1's gradients x1e3) at 40 % of the
  run; `static+nan` / `profile+nan`: a `nan` fault there (`--faults none`: neither).

Runs are simulated data-parallel workers (`calibration/simulate.py`), which the test suite
holds bit-identical to real DDP with the fabric hook (monitor, update guard and injected faults
included: `tests/calibration/test_simulate.py`), so the matrix is affordable on 2 cores.

Printed per cell: each arm's metric and traffic, profile - static and profile - fp32. Summary:
runs where the monitor made things worse than no monitor (more than 0.5 accuracy points or 0.01
nats, clean and faulted pairs), faults rescued (static+fault outside the profile's tolerance of
fp32, profile+fault inside), faults not rescued, and the passive false-trip rate of the fp32
arms (goal <= 1 % of steps), the largest gradient-norm blow-up (x its median) in arms with no
fault injected, and the cells where the profile ends within its tolerance of fp32 (issue 15:
the worst seed must, at the calibrated length and 2x). With `--noise [N]`, each cell also
trains fp32 N times from weights one ulp apart (`bench/noise_floor.py`, a different element
each time; N = 1 by default): the farthest of them from fp32 is the cell's run-to-run noise
(one such run is a thin estimate: at 4x it read 0.00 in three cells of twelve), and a worse
pair is also counted as beyond that noise or not (any perturbation, a trip or a hold among
them, moves a chaotic run that far). It also trains `static` N times from those nudged
weights (`static+ulp`...): how far the monitor-less low-bit run lands from itself is the null
for a profile-static pair (a hold or a trip perturbs *that* trajectory, and low-bit runs may
be more or less chaotic than fp32's), so a worse pair is counted beyond static's noise too.
A worse *faulted* pair is also counted as `absorbed` where the monitored run with the fault
ends no more than that margin below the clean profile arm (level with it or above): the fault
cost the monitored run nothing, and the unmonitored run with the fault ended above the clean
profile's end (the kind every worse pair of transformer.v12 at 4x is: docs/health.md).
`--json` prints the cells and summary as JSON on stdout, and each cell's lines on stderr as it
finishes (a matrix runs for tens of minutes).

    python -m bench.robustness [--workloads vision,transformer,lm] [--seeds 0,1,2]
                               [--lengths 1,2,4] [--world-sizes 2,4] [--noise [N]]
                               [--faults spike,nan|none] [--profiles DIR]
                               [--health KEY=VALUE ...] [--json]

`--health` sets one of the profiles' health thresholds (`profile/thresholds.py`) for every
arm, to measure a rule before a recalibration writes it into the profiles.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import torch

from bench.noise_floor import nudged_builds
from nfabric_cli.binding import compile_profile, on_route
from nfabric_cli.calibration.simulate import simulate_run
from nfabric_cli.errors import InputError
from nfabric_cli.profile.operating import OperatingProfile
from nfabric_cli.profile.store import read_profile, resolve_profile
from nfabric_cli.profile.thresholds import HealthThresholds
from nfabric_cli.runtime.health import BLOWUP
from nfabric_cli.runtime.inject import Injection
from nfabric_cli.validation.run import default_steps
from nfabric_cli.workloads.base import find_unused
from nfabric_cli.workloads.registry import get_workload

PROFILES = Path(__file__).resolve().parents[1] / "profiles"
#: The injected faults, at 40 % of the run on rank 1.
FAULTS = ("spike", "nan")
#: Worse than no monitor: by more than this (accuracy points as fractions; nats for val_loss).
WORSE = {True: 0.005, False: 0.01}
#: `--noise`: fp32 trained from weights one ulp apart (`bench/noise_floor.py`); how far it ends
#: from fp32 is the cell's run-to-run noise, which any perturbation (a trip, a hold) may cost.
#: With `--noise N` the further runs are NOISE + "1", ... (another element nudged each time).
NOISE = "fp32+ulp"
#: `--noise`: the profile's routes without the monitor, from the same nudged weights.
STATIC_NOISE = "static+ulp"
#: The nulls a worse pair is judged against: its verdict -> (the spread's key, the one-ulp
#: arms, the arm they are nudged copies of).
NULLS = {"worse_beyond_noise": ("noise", NOISE, "fp32"),
         "worse_beyond_static_noise": ("static_noise", STATIC_NOISE, "static")}


def noise_arms(n: int, base: str = NOISE) -> list[str]:
    """The names of `n` one-ulp arms of `base`; the k-th nudges element k."""
    return [base + (str(k) if k else "") for k in range(n)]


def _spread(m: dict[str, float], base: str, of: str) -> float | None:
    """How far the one-ulp arms named `base`... land from arm `of` at most (None: none)."""
    gaps = [abs(v - m[of]) for a, v in m.items() if a.startswith(base)]
    return max(gaps) if gaps else None


def reference_profile(workload: Any, profiles: Path = PROFILES) -> OperatingProfile:
    """The newest profile of `workload` under `profiles`/<its name>/, as `calibrate --out
    profiles` writes it."""
    return read_profile(resolve_profile(profiles / workload.name))


def reference_steps(name: str, profiles: Path = PROFILES) -> int:
    """The length the workload's reference profile was calibrated at, as `validate` defaults
    to (`validation.run.default_steps`)."""
    workload = get_workload(name)
    meta = reference_profile(workload, profiles).meta
    return default_steps("profile", meta, workload.default_steps)


def run_cell(name: str, seed: int, steps: int, world: int, noise: int = 0,
             faults: tuple[str, ...] = FAULTS, profiles: Path = PROFILES,
             health: dict[str, Any] | None = None) -> dict:
    workload = get_workload(name)
    profile = reference_profile(workload, profiles)
    if health:  # the profile's thresholds, these changed (every arm reads them)
        profile.meta["health"] = {**profile.meta.get("health", {}), **health}
    target = profile.meta["target"]
    model = workload.build_model(seed)
    unused = find_unused(workload)  # DDP's buckets as the workload trains
    bindings = compile_profile(profile, model, world_size=world, total_steps=steps,
                               find_unused_parameters=unused)
    reference = compile_profile(on_route(profile, "fp32"), model, world_size=world,
                                total_steps=steps, find_unused_parameters=unused)
    at = int(0.4 * steps)
    # fp32: the detectors judge every step (`passive`) and act on nothing: plain fp32 DDP
    arms = {"fp32": (reference, "passive", ()), "static": (bindings, False, ()),
            "profile": (bindings, True, ())}
    for kind in faults:
        inj = (Injection(kind, at, 1),)
        arms[f"static+{kind}"] = (bindings, False, inj)
        arms[f"profile+{kind}"] = (bindings, True, inj)
    cell: dict = {"workload": name, "seed": seed, "steps": steps, "world_size": world,
                  "higher_is_better": bool(target["higher_is_better"]),
                  "tolerance": float(target["tolerance"]), "arms": {}}
    nudges = {}
    for base, routes in ((NOISE, reference), (STATIC_NOISE, bindings)):
        # the cell's run-to-run noise: fp32, and the routes without the monitor, from
        # weights one ulp apart
        for k, arm in enumerate(noise_arms(int(noise), base)):
            nudges[arm] = k
            arms[arm] = (routes, False, ())
    for arm, (b, monitor, inj) in arms.items():
        t0 = time.perf_counter()
        with nudged_builds(workload, nudges[arm]) if arm in nudges else contextlib.nullcontext():
            res = simulate_run(workload, b, world, steps, seed, checkpoints=(steps,),
                               monitor=bool(monitor), injections=inj,
                               passive=monitor == "passive")
        trips = [e for e in res.events if e["to"] == "fp32"]
        cell["arms"][arm] = {
            "metric": res.metric, "traffic": res.traffic_fraction, "trips": len(trips),
            "held_steps": sum(1 for e in res.events if e["to"] == "held"),
            "max_blowup": max_blowup(res.detections),
            "false_trip_steps": len({s for s, _, _ in res.detections}) if arm == "fp32" else None,
            "seconds": time.perf_counter() - t0,
        }
    return cell


_BLOWUP = re.compile(re.escape(BLOWUP) + r" ([0-9.]+)x median")


def max_blowup(detections: list[tuple[int, str, str]]) -> float | None:
    """The largest gradient-norm blow-up ratio the detectors judged in a run (None: none)."""
    ratios = [float(m.group(1)) for _, _, why in detections if (m := _BLOWUP.search(why))]
    return max(ratios, default=None)


def better(cell: dict, a: float, b: float) -> float:
    """a - b, positive when a is better."""
    return (a - b) if cell["higher_is_better"] else (b - a)


def _within(cell: dict, gap: float) -> bool:
    """A gap to fp32 (`better(cell, metric, fp32)`) within the profile's tolerance."""
    return gap >= -cell["tolerance"]


def judge(cell: dict) -> dict:
    """The cell's verdicts: monitor worse than none (per pair), faults rescued or not."""
    m = {arm: v["metric"] for arm, v in cell["arms"].items()}
    worse = WORSE[cell["higher_is_better"]]
    nulls = {verdict: _spread(m, arms, of) for verdict, (_, arms, of) in NULLS.items()}
    out = {"worse": [], **{verdict: [] for verdict in NULLS}, "absorbed": [], "rescued": [],
           "not_rescued": [],
           **{NULLS[verdict][0]: null for verdict, null in nulls.items()},
           "pairs": 0, "vs_fp32": better(cell, m["profile"], m["fp32"])}
    out["within"] = _within(cell, out["vs_fp32"])
    for suffix in ("", *(f"+{k}" for k in FAULTS if f"profile+{k}" in m)):
        out["pairs"] += 1
        gap = better(cell, m["profile" + suffix], m["static" + suffix])
        if gap < -worse:
            out["worse"].append("profile" + suffix)
            for verdict, null in nulls.items():
                if null is not None and -gap > null:
                    out[verdict].append("profile" + suffix)
            if suffix and better(cell, m["profile" + suffix], m["profile"]) >= -worse:
                out["absorbed"].append("profile" + suffix)
        if suffix:
            static_ok = _within(cell, better(cell, m["static" + suffix], m["fp32"]))
            profile_ok = _within(cell, better(cell, m["profile" + suffix], m["fp32"]))
            if not static_ok:
                out["rescued" if profile_ok else "not_rescued"].append(suffix[1:])
    return out


def show(cell: dict, out: TextIO | None = None) -> None:
    """Print one cell's arms and verdict (stdout; stderr under --json: progress, not the result)."""
    out = out or sys.stdout
    a, v = cell["arms"], judge(cell)
    head = f"{cell['workload']:11s} seed {cell['seed']} {cell['steps']:5d} steps W={cell['world_size']}"
    parts = [f"{arm} {x['metric']:.4f} ({x['traffic']:.1%}"
             + (f", {x['trips']} trips" if x["trips"] else "") + ")" for arm, x in a.items()]
    print(head + " | " + "  ".join(parts), file=out, flush=True)
    ft = a["fp32"]["false_trip_steps"] / cell["steps"]
    print(f"{'':11s} profile-static {better(cell, a['profile']['metric'], a['static']['metric']):+.4f}"
          f"  profile-fp32 {v['vs_fp32']:+.4f}"
          f"  (+ is better)  passive false trips {ft:.2%}"
          + (f"  noise {v['noise']:.4f}" if v["noise"] is not None else "")
          + (f", static's {v['static_noise']:.4f}" if v["static_noise"] is not None else "")
          + (f"  WORSE: {', '.join(v['worse'])}" if v["worse"] else "")
          + _beyond(v)
          + ("" if v["within"] else "  OUTSIDE tolerance of fp32")
          + (f"  rescued: {', '.join(v['rescued'])}" if v["rescued"] else "")
          + (f"  NOT rescued: {', '.join(v['not_rescued'])}" if v["not_rescued"] else ""),
          file=out, flush=True)


def _beyond(v: dict) -> str:
    """' (beyond noise: ...; beyond static's: ...; fault absorbed: ...)' after a cell's worse
    pairs."""
    said = []
    if v["noise"] is not None:
        said.append(f"beyond noise: {', '.join(v['worse_beyond_noise']) or 'none'}")
        if v["static_noise"] is not None:
            said.append(f"beyond static's: {', '.join(v['worse_beyond_static_noise']) or 'none'}")
    if v["absorbed"]:
        said.append(f"fault absorbed: {', '.join(v['absorbed'])}")
    return f" ({'; '.join(said)})" if v["worse"] and said else ""


def summary(cells: list[dict]) -> dict:
    verdicts = [judge(c) for c in cells]
    steps = sum(c["steps"] for c in cells)
    false = sum(c["arms"]["fp32"]["false_trip_steps"] for c in cells)
    worst = max((c["arms"]["fp32"]["false_trip_steps"] / c["steps"] for c in cells), default=0.0)
    return {
        "cells": len(cells),
        "pairs": sum(v["pairs"] for v in verdicts),
        "worse": sum(len(v["worse"]) for v in verdicts),
        **{verdict: (sum(len(v[verdict]) for v in verdicts)
                     if all(arms in c["arms"] for c in cells) else None)
           for verdict, (_, arms, _) in NULLS.items()},
        # worse faulted pairs whose monitored run ended level with the clean profile arm or above
        "worse_absorbed": sum(len(v["absorbed"]) for v in verdicts),
        "faults": sum(v["pairs"] - 1 for v in verdicts),
        "within_tolerance": sum(v["within"] for v in verdicts),
        # per workload: accuracy and val_loss differences are not one scale
        "worst_vs_fp32": {w: min(v["vs_fp32"] for c, v in zip(cells, verdicts, strict=True)
                                 if c["workload"] == w)
                          for w in dict.fromkeys(c["workload"] for c in cells)},
        "faults_needing_rescue": sum(len(v["rescued"]) + len(v["not_rescued"]) for v in verdicts),
        "rescued": sum(len(v["rescued"]) for v in verdicts),
        # how large the runs' own blow-ups get (arms with nothing injected): what separates
        # them from an injected fault, if anything does
        "max_blowup_without_fault": max((a["max_blowup"] for c in cells
                                         for arm, a in c["arms"].items()
                                         if a.get("max_blowup") is not None
                                         and not arm.endswith(tuple(f"+{k}" for k in FAULTS))),
                                        default=None),
        "false_trip_rate": false / steps if steps else 0.0,
        "false_trip_rate_worst_run": worst,
    }


def parse_health(items: list[str], parser: argparse.ArgumentParser) -> dict[str, Any]:
    """`--health KEY=VALUE` items as thresholds (numbers), checked as a profile's are."""
    health: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep:
            parser.error(f"--health {item}: KEY=VALUE")
        try:  # JSON's numbers: 1 an int, 1.0 or 1e-3 a float (the thresholds check the kind)
            health[key.strip()] = json.loads(text)
        except ValueError:
            parser.error(f"--health {item}: VALUE must be a number")
    try:
        HealthThresholds.from_dict(health)
    except InputError as e:
        parser.error(f"--health: {e}")
    return health


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="vision,transformer,lm")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--lengths", default="1,2,4", help="multiples of the calibrated length")
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--noise", type=int, nargs="?", const=1, default=0, metavar="N",
                        help="also run fp32 and static N times each (default 1) from "
                             "weights one ulp apart: each cell's noise is the farthest of "
                             "them from fp32 (from static: the pairs' own null)")
    parser.add_argument("--faults", default=",".join(FAULTS),
                        help="faults injected, each in its own static and profile arm; "
                             "'none': the clean arms only")
    parser.add_argument("--profiles", type=Path, default=PROFILES, metavar="DIR",
                        help="where each workload's profile is, as DIR/<name>/<name>.vN.parquet "
                             "(calibrate --out DIR); default the committed ones")
    parser.add_argument("--health", action="append", default=[], metavar="KEY=VALUE",
                        help="set one of the profiles' health thresholds (repeatable)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    health = parse_health(args.health, parser)
    faults = () if args.faults == "none" else tuple(f for f in args.faults.split(",") if f)
    if args.noise < 0:
        parser.error("--noise: a count >= 0")
    if set(faults) - set(FAULTS):
        parser.error(f"--faults: from {', '.join(FAULTS)}, or none")
    torch.set_num_threads(1)
    cells = []
    for name in args.workloads.split(","):
        base = reference_steps(name, args.profiles)
        for mult in (int(x) for x in args.lengths.split(",")):
            for world in (int(x) for x in args.world_sizes.split(",")):
                for seed in (int(x) for x in args.seeds.split(",")):
                    cell = run_cell(name, seed, base * mult, world, args.noise, faults,
                                    args.profiles, health)
                    cells.append(cell)
                    show(cell, sys.stderr if args.json else sys.stdout)
    total = summary(cells)
    if args.json:
        print(json.dumps({"cells": cells, "summary": total}, indent=2))
    else:
        print(f"\nsummary over {total['cells']} cells: monitor worse than no monitor in "
              f"{total['worse']} of {total['pairs']} paired runs (goal 0"
              + ("" if total["worse_beyond_noise"] is None else
                 f"; {total['worse_beyond_noise']} beyond their cell's noise")
              + ("" if total["worse_beyond_static_noise"] is None else
                 f", {total['worse_beyond_static_noise']} beyond static's own")
              + f"; {total['worse_absorbed']} with the fault absorbed"
              + "); faults rescued "
              f"{total['rescued']} of {total['faults_needing_rescue']} that static lost "
              f"({total['faults']} injected); largest blow-up with no fault "
              f"{total['max_blowup_without_fault']}x median; passive false trips "
              f"{total['false_trip_rate']:.2%} of fp32 steps, worst run "
              f"{total['false_trip_rate_worst_run']:.2%} (goal <= 1 %)"
              f"; profile within tolerance of fp32 in {total['within_tolerance']} of "
              f"{total['cells']} cells, worst " + ", ".join(
                  f"{w} {v:+.4f}" for w, v in total["worst_vs_fp32"].items()))
    return total


if __name__ == "__main__":
    main()
