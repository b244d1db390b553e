"""What a ramp's element clip adds to a step, at a real model size.

A ramp to a full-precision wire (a phase's `sign` -> fp32, the measured gate's fp32 probe
steps) clips each element of a parameter's update to k x its mean |update|
(`StepDecision.apply_`, docs/health.md "The gate's switches ramp"). That runs on the step's
critical path, and the measured gate times its fp32 probe steps with it, so its cost is
both a cost to the run and a bias against fp32 in a close call.

On issue 16's model (5 x Linear(3072, 3072), 47.2M parameters, one intra-op thread), each
round times, interleaved: `clip` (every parameter clipped as a ramped step does, the code in
use), `clip-abs` (the first formula: ``abs().mean()`` and ``clamp_`` with tensor ends),
`clip-bf16` (the code in use on the same updates in bfloat16, a bf16 bucket's),
`norms` (the update norms a guarded step reads anyway), `copy` (one read and write pass over
the update: the memory reference) and `compute` (the model's forward, backward and SGD step
on a batch of 8: the step's floor). Ratios are medians over rounds of the same round's
figures.

    python -m bench.ramp_cost [--rounds 9] [--width 3072] [--layers 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from nfabric_cli.runtime.controller import StepDecision
from nfabric_cli.runtime.state import _norms

RATIOS = (("clip", "clip-abs"), ("clip", "copy"), ("clip", "compute"), ("clip-abs", "compute"),
          ("clip-bf16", "compute"), ("norms", "compute"))


def _timed(fn) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(width: int = 3072, layers: int = 5, rounds: int = 9) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, width), torch.randn(8, width)
    updates = [torch.randn_like(p) for p in model.parameters()]
    halves = [u.bfloat16() for u in updates]  # a bf16 bucket's updates
    spare = [torch.empty_like(u) for u in updates]
    decision = StepDecision(False, {}, {"s": 3.0})

    def clip() -> None:
        for u in updates:
            decision.apply_("s", u, True)

    def clip_bf16() -> None:
        for u in halves:
            decision.apply_("s", u, True)

    def clip_abs() -> None:
        for u in updates:
            bound = u.abs().mean() * 3.0
            u.clamp_(min=-bound, max=bound)

    def norms() -> None:  # as the hook takes them, in one host read
        _norms(updates).tolist()

    def copy() -> None:
        for s, u in zip(spare, updates, strict=True):
            s.copy_(u)

    def compute() -> None:
        opt.zero_grad(set_to_none=False)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    arms = {"clip": clip, "clip-abs": clip_abs, "clip-bf16": clip_bf16, "norms": norms,
            "copy": copy, "compute": compute}
    for fn in arms.values():  # warm: allocations, the first backward
        fn()
    times: dict[str, list[float]] = {a: [] for a in arms}
    for r in range(rounds):
        order = list(arms)[r % len(arms):] + list(arms)[: r % len(arms)]
        for a in order:
            times[a].append(_timed(arms[a]))
    ratios = {f"{a}/{b}": [x / y for x, y in zip(times[a], times[b], strict=True)] for a, b in RATIOS}
    return {"parameters": sum(p.numel() for p in model.parameters()), "rounds": rounds,
            "ms": {a: 1e3 * statistics.median(t) for a, t in times.items()},
            "ratios": {k: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                       for k, v in ratios.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--width", type=int, default=3072)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    res = run(args.width, args.layers, args.rounds)
    if args.json:
        print(json.dumps(res, indent=2))
        return
    print(f"{res['parameters'] / 1e6:.1f}M parameters, {res['rounds']} rounds, one thread; "
          "median ms: " + ", ".join(f"{a} {v:.1f}" for a, v in res["ms"].items()))
    for k, v in res["ratios"].items():
        print(f"  {k:18s} {v['median']:.3f} [{v['min']:.3f}, {v['max']:.3f}]")


if __name__ == "__main__":
    main()
