"""Simulated N-worker trial vs a real N-rank DDP run of the same steps, side by side.

Both train the same workload from the same seed on the same batches with the same profile
(head int8, everything else sign with error feedback, health monitor on). The real run spawns
N gloo ranks (FileStore rendezvous) with the fabric hook; the simulated run is what
`nfabric calibrate` does per trial, once in one process and once with the ranks' gradients
spread over forked processes (one per CPU, the default). Printed: wall time of each, the ratio
sim / real (whole run including process start-up, which a real trial pays, and training loop
only), the compute floor (N ranks' forward and backward passes per step, timed in this run in
one forked process per CPU, all at once: what no simulator that computes every rank's
gradient on this machine can beat; sim/floor compares like with like, one busy process
per CPU on each side, where the real run has N), and the largest
parameter difference between the simulated model and rank 0.

    OMP_NUM_THREADS=1 python -m bench.calibrate_sim_vs_ddp [--workload vision] [--world 4] [--steps 30]
        [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from nfabric_cli.binding import compile_profile
from nfabric_cli.calibration.ranks import default_processes, usable_cpus
from nfabric_cli.calibration.simulate import simulate_run
from nfabric_cli.calibration.space import Config, config_profile
from nfabric_cli.calibration.spec import parse_spec
from nfabric_cli.ranks.functions import run_function_ranks
from nfabric_cli.ranks.loop import train_workload
from nfabric_cli.workloads.registry import get_workload


def bindings_for(workload_name: str, model: torch.nn.Module, world: int, steps: int,
                 head_route: str = "fp32"):
    wl = get_workload(workload_name)
    spec = parse_spec({"world_size": world, "steps": steps, "regions": [
        {"name": "head", "selector": wl.head_selector, "routes": [head_route]},
        {"name": "rest", "selector": "*", "routes": ["sign"]},
    ], "routes": {"error_feedback": True}}, wl.name)
    config = Config(((head_route, "sign"),), (), 0.5, True)
    profile = config_profile(spec, config, {"world_size": world})
    return compile_profile(profile, model, world_size=world, bucket_cap_mb=None, total_steps=steps)


def _rank(rank: int, world: int, workload_name: str, steps: int, seed: int, head: str) -> dict:
    from nfabric_cli import attach

    wl = get_workload(workload_name)
    model = wl.build_model(seed)
    ddp = DDP(model)
    state = attach(ddp, bindings_for(workload_name, model, world, steps, head), total_steps=steps)
    opt, sched = wl.make_optimizer(ddp.parameters(), steps)
    dist.barrier()
    t0 = time.perf_counter()
    train_workload(ddp, state, wl, opt, sched, steps, rank, world, seed)
    loop = time.perf_counter() - t0
    state.close()
    return {"loop": loop, "params": {n: p.detach() for n, p in model.named_parameters()}}


def real_run(
    workload: str, world: int, steps: int, seed: int, head: str
) -> tuple[float, float, dict]:
    t0 = time.perf_counter()
    results = run_function_ranks(_rank, world, workload, steps, seed, head)
    wall = time.perf_counter() - t0
    return wall, max(r["loop"] for r in results), results[0]["params"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="vision")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds of (real, simulated, floor), run back to back; this VM's "
                             "speed drifts by 30 %% over minutes, so each round's ratio compares "
                             "neighbours and the median is reported")
    parser.add_argument("--head-route", default="int8",
                        help="route of the head (the rest is sign+EF); with fp32 and N > 2, "
                             "gloo's all-reduce may sum in another order than the simulator")
    args = parser.parse_args()
    torch.set_num_threads(1)

    wl = get_workload(args.workload)  # loaded once per study, like the real ranks each do
    many = default_processes(args.world)
    counts = sorted({1, many})
    rows: list[dict] = []
    sims = {}
    for _ in range(max(1, args.repeats)):
        row = {}
        row["real_wall"], row["real_loop"], real_params = real_run(
            args.workload, args.world, args.steps, args.seed, args.head_route
        )
        for procs in counts:
            t0 = time.perf_counter()
            model = wl.build_model(args.seed)
            bindings = bindings_for(args.workload, model, args.world, args.steps, args.head_route)
            sim = simulate_run(wl, bindings, args.world, args.steps, args.seed, processes=procs)
            row[procs] = time.perf_counter() - t0
            sims[procs] = sim
        row["floor"] = compute_floor(wl, args.world, args.steps, args.seed)
        rows.append(row)
        print(f"  round: real loop {row['real_loop']:.2f} s (total {row['real_wall']:.2f} s), "
              + ", ".join(f"sim {p} proc {row[p]:.2f} s ({row[p] / row['real_loop']:.2f}x)"
                          for p in counts)
              + f", floor {row['floor']:.2f} s ({row['floor'] / row['real_loop']:.2f}x)")

    med = statistics.median
    real_loop, real_wall = med(r["real_loop"] for r in rows), med(r["real_wall"] for r in rows)
    print(f"workload {args.workload}, N = {args.world}, {args.steps} steps, head "
          f"{args.head_route}, rest sign+EF, cpus {usable_cpus()}, {len(rows)} rounds (medians)")
    print(f"real DDP  (N processes, total) {real_wall:8.2f} s")
    print(f"real DDP  (training loop only) {real_loop:8.2f} s")
    floor_ratio = med(r["floor"] / r["real_loop"] for r in rows)
    print(f"compute floor (N fwd+bwd, parallel) {med(r['floor'] for r in rows):5.2f} s   "
          f"ratio floor/real loop {floor_ratio:.2f}x")
    for procs in counts:
        diff = max(float((p.detach() - real_params[n]).abs().max())
                   for n, p in sims[procs].model.named_parameters())
        print(f"simulated trial, {procs} process(es) {med(r[procs] for r in rows):8.2f} s   "
              f"sim/real total {med(r[procs] / r['real_wall'] for r in rows):.2f}x, "
              f"sim/real loop {med(r[procs] / r['real_loop'] for r in rows):.2f}x, "
              f"sim/floor {med(r[procs] / r['floor'] for r in rows):.2f}x, "
              f"max |param sim - rank0| {diff:.3g}")
    one, last = sims[1], sims[many]
    same = all(torch.equal(p, q)
               for p, q in zip(one.model.parameters(), last.model.parameters(), strict=True))
    print(f"1 process vs {many}: bit-identical parameters: {same}")


def compute_floor(wl, world: int, steps: int, seed: int) -> float:  # noqa: ANN001
    """Wall seconds for `steps` x `world` forward+backward passes spread over one forked process
    per CPU (at most `world`), all running at once: the machine's real parallel throughput,
    which shared or SMT cores keep below CPUs x one core's."""
    import multiprocessing as mproc

    model = wl.build_model(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    batches = [wl.train_batch(s % 10, r, world, seed) for s in range(10) for r in range(world)]
    procs = default_processes(world)

    def work(share: int) -> None:
        torch.set_num_threads(1)
        for i in range(share):
            torch.autograd.grad(wl.loss(model, batches[i % len(batches)]), params)

    work(2)  # warm-up
    shares = [len(range(p, steps * world, procs)) for p in range(procs)]
    ctx = mproc.get_context("fork")
    t0 = time.perf_counter()
    children = [ctx.Process(target=work, args=(n,)) for n in shares]
    for c in children:
        c.start()
    for c in children:
        c.join()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
