"""Clean exit: run a short 2-rank sign-route training N times and count abnormal exits.

Hooks that issue several asynchronous collectives can abort a process at interpreter exit
(collective callbacks still running on backend threads while the process group is torn
down). The fabric hook runs its collectives on one worker thread that `attach` joins at exit,
and `state.close()` is idempotent. Usage: python -m bench.teardown [RUNS]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

SCRIPT = textwrap.dedent(
    """
    import os, sys, tempfile, torch, torch.distributed as dist, torch.multiprocessing as mp
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    def worker(rank, tmp, close):
        from nfabric_cli import attach
        from nfabric_cli.binding import compile_profile, static_profile
        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=dist.FileStore(tmp + "/s", 2), rank=rank, world_size=2)
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
        ddp = DDP(m, bucket_cap_mb=0.001)
        state = attach(ddp, compile_profile(static_profile(m, "sign", [("2.*", "int8")]), m, world_size=2), total_steps=5)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(5):
            loss = ddp(torch.randn(8, 32)).pow(2).mean()
            state.observe(loss)
            opt.zero_grad(); loss.backward(); opt.step()
        if close:  # half the runs exit without closing anything explicitly
            state.close()
            dist.destroy_process_group()

    if __name__ == "__main__":
        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(worker, args=(tmp, sys.argv[1] == "1"), nprocs=2, start_method="spawn")
    """
)


def main(runs: int = 30) -> None:
    crashes = 0
    fd, script = tempfile.mkstemp(suffix=".py")  # spawn needs an importable __main__ file
    with os.fdopen(fd, "w") as fh:
        fh.write(SCRIPT)
    hangs = 0
    for i in range(runs):
        try:
            proc = subprocess.run(
                [sys.executable, script, str(i % 2)], capture_output=True, text=True, timeout=180
            )
        except subprocess.TimeoutExpired as exc:
            hangs += 1
            print(f"run {i}: hung for {exc.timeout} s\n{(exc.stderr or b'')[-2000:]!r}")
            continue
        bad = proc.returncode != 0 or "terminate called" in proc.stderr or "Abort" in proc.stderr
        if bad:
            crashes += 1
            print(f"run {i}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    os.unlink(script)
    print(f"teardown: {crashes} abnormal exits and {hangs} hangs in {runs} runs (goal 0)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 30)
