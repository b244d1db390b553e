"""The fabric hook in real multi-process DDP runs over gloo."""

from __future__ import annotations

import os
import threading
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from nfabric_cli import attach
from nfabric_cli.benchmarks.runtime import hold_everything
from nfabric_cli.binding import compile_profile, static_profile
from nfabric_cli.routes import RouteSpec, make_route
from nfabric_cli.runtime.attach import attach_with
from nfabric_cli.runtime.inject import parse_injections
from tests.distutil import agreed, run_ranks
from tests.runtime.models import batch, make_model, train_steps


def _bindings(model, default: str, rules=None, world_size: int = 2, phases=None, **kw):
    profile = static_profile(model, default, rules or [], phases=phases, **kw)
    return compile_profile(profile, model, world_size=world_size, bucket_cap_mb=None)


def _train(ddp, steps: int, state=None, rank: int = 0) -> None:
    train_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), state, rank, 0, steps)


def _parity_worker(rank: int, world: int) -> list[bool]:
    return [
        _parity_one(rank, world, views, direct)
        for views in (False, True)
        for direct in (True, False)
    ]


def _parity_one(rank: int, world: int, views: bool, direct: bool) -> bool:
    plain = DDP(make_model(), bucket_cap_mb=0.001, gradient_as_bucket_view=views)
    fabric_model = make_model()
    fabric = DDP(fabric_model, bucket_cap_mb=0.001, gradient_as_bucket_view=views)
    bindings = _bindings(fabric_model, "fp32", world_size=world)
    # direct: allreduce_hook's path for all-fp32 phases; else the worker path with statistics
    state = attach_with(fabric, bindings, total_steps=5, direct_fp32=direct)
    _train(plain, 5, rank=rank)
    _train(fabric, 5, state, rank=rank)
    state.close()
    return all(torch.equal(a, b) for a, b in zip(plain.parameters(), fabric.parameters(), strict=True))


@pytest.mark.parametrize("world", [2, 4])
def test_all_fp32_profile_is_bit_identical_to_plain_ddp(world: int) -> None:
    # Several buckets (tiny cap), several steps, across DDP's bucket rebuild after step one,
    # with gradient_as_bucket_view off and on, through both fp32 paths of the hook.
    assert run_ranks(_parity_worker, world) == [[True] * 4] * world


def _scenarios(rank: int, world: int) -> dict:
    """Every 2-rank scenario in one spawn: process start-up dominates these tests."""
    return {
        "mixed": _mixed_worker(rank, world),
        "mixed-pipelined": _mixed_worker(rank, world, cap_mb=0.0005),
        "held": _mixed_worker(rank, world, cap_mb=0.0005, held=True),
        "nan": _nan_worker(rank, world),
        "spike": _spike_worker(rank, world),
        "unused": _unused_worker(rank, world),
        "gate": _gate_worker(rank, world),
        "failures": [_failure_worker(rank, world, which)
                     for which in ("first", "last", "close")],
    }


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_scenarios, 2)


def _mixed_worker(rank: int, world: int, cap_mb: float = 25, held: bool = False) -> dict:
    """One step's reduced gradients on a mixed profile, and every rank's local gradients.
    cap_mb 25: one bucket holding every parameter; tiny: a bucket per parameter or two, so
    buckets pipeline (several exchanges in flight), measured after DDP's bucket rebuild.
    `held`: the monitor holds the whole model on fp32 (pinned) for the measured step."""
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=cap_mb)
    rules = [("head.*", "fp32"), ("body.0.*", "int8")]
    state = attach(ddp, _bindings(model, "sign", rules, world_size=world), total_steps=3)
    if cap_mb < 1:  # a first step, so DDP rebuilds its buckets before the one measured
        F.cross_entropy(ddp(batch(1, rank)[0]), batch(1, rank)[1]).backward()
    if held:  # every step from here takes the monitor's fallback path
        hold_everything(state)
    x, y = batch(0, rank)
    loss = F.cross_entropy(ddp.module(x), y)  # local grads without DDP, for the reference
    local = torch.autograd.grad(loss, list(model.parameters()))
    ddp.zero_grad()
    submit, reduce_bucket, done, threads = state.submit, state._reduce_bucket, [], []

    def recording(*args):  # noqa: ANN002, ANN202 - the measured step's buckets
        fut = submit(*args)
        done.append(fut.done())  # whether the bucket's result was ready when DDP got it
        return fut

    def on_thread(*args):  # noqa: ANN002, ANN202 - which thread reduces each bucket
        threads.append(threading.current_thread().name)
        return reduce_bucket(*args)

    state.submit, state._reduce_bucket = recording, on_thread
    F.cross_entropy(ddp(x), y).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    gathered = []
    for g in local:
        parts = [torch.empty_like(g) for _ in range(world)]
        dist.all_gather(parts, g.contiguous())
        gathered.append(parts)
    state.close()
    return {"got": got, "local": dict(zip([n for n, _ in model.named_parameters()], gathered, strict=True)),
            "bytes": state.bytes_per_route(), "fraction": state.meter.fraction(),
            "buckets": len(done), "done": done, "threads": threads}


def _failure_worker(rank: int, world: int, which: str) -> str:
    """A bucket's reduction raises (the first, on the worker, or the last, on DDP's thread), or
    closing the step after it does: backward raises it on every rank instead of hanging."""
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.0005)
    state = attach(ddp, _bindings(model, "sign", world_size=world), total_steps=3)
    _train(ddp, 1, state, rank)  # DDP rebuilds its buckets: several from here on
    reduce_bucket, seen = state._reduce_bucket, []

    def failing(*args):  # noqa: ANN002, ANN202
        seen.append(args[3])
        if (which == "first" and len(seen) == 1) or (which == "last" and args[3]):
            raise RuntimeError(f"{which} bucket broke")
        return reduce_bucket(*args)

    def failing_close(step: int) -> None:  # after the step's last reduce, before DDP resumes
        raise RuntimeError("closing the step broke")

    advance = state.controller.advance
    if which == "close":
        state.controller.advance = failing_close
    else:
        state._reduce_bucket = failing
    x, y = batch(1, rank)
    # a regression here is a backward that never returns: end the rank, so the test fails
    watchdog = threading.Timer(60.0, os._exit, args=(3,))
    watchdog.daemon = True
    watchdog.start()
    try:
        try:
            F.cross_entropy(ddp(x), y).backward()
        except RuntimeError as exc:
            failed = f"{len(seen)} buckets: {exc}"
        else:
            return "no error"
        if which == "close":  # (the monitor judged the step its close then failed to count)
            return failed
        # a run that catches it and trains on: the next step starts as a step (its first
        # bucket decides the step's path), not as the rest of the failed one
        left_open, at = state._step_started is not None, state.step
        state._reduce_bucket, state.controller.advance = reduce_bucket, advance
        ddp.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        return f"{failed}; left open {left_open}; then steps {at} -> {state.step}"
    finally:
        watchdog.cancel()
        state.close()


def test_a_failing_bucket_surfaces_in_backward_on_every_rank(two_ranks: list[dict]) -> None:
    for r in two_ranks:
        first, last, close = r["failures"]
        assert "first bucket broke" in first
        assert "last bucket broke" in last
        assert int(last.split()[0]) >= 3  # the buckets before it ran on the worker
        # caught, the run trains on: a failed last bucket's step is over and not counted
        # (the next is step 1 again); a failed first bucket's step was closed by its last
        assert first.endswith("left open False; then steps 2 -> 3")
        assert last.endswith("left open False; then steps 1 -> 2")
        assert "closing the step broke" in close  # every bucket's future failed, none left


def _check_mixed(out: list[dict]) -> None:
    world = len(out)
    for name, parts in out[0]["local"].items():
        flat = [p.reshape(-1) for p in parts]
        if name.startswith("head."):
            spec = RouteSpec("fp32")
        elif name.startswith("body.0."):
            spec = RouteSpec("int8")
        else:
            spec = RouteSpec("sign")
        expected = make_route(spec).simulate(flat).view_as(parts[0])
        for rank in range(world):
            assert torch.equal(out[rank]["got"][name], expected), (name, rank)


def test_mixed_bucket_keeps_each_parameters_semantics(two_ranks: list[dict]) -> None:
    out = [r["mixed"] for r in two_ranks]
    _check_mixed(out)  # fp32: the exact mean at two ranks, whatever the order
    labels = set(out[0]["bytes"])
    assert {"fp32", "int8/sharded", "sign/sharded", "control"} <= labels
    assert out[0]["fraction"] < 0.5


def test_a_step_the_monitor_holds_whole_goes_out_on_ddps_thread_exactly(two_ranks) -> None:
    # Nothing of the step low-bit: every bucket's all-reduce issued on DDP's thread as it
    # arrives, as plain DDP issues it, all landing with the last; the exact fp32 mean.
    out = [r["held"] for r in two_ranks]
    for name, parts in out[0]["local"].items():
        expected = make_route(RouteSpec("fp32")).simulate(
            [p.reshape(-1) for p in parts]).view_as(parts[0])
        for rank in range(len(out)):
            assert torch.equal(out[rank]["got"][name], expected), (name, rank)
    for r in out:
        n = r["buckets"]
        assert n >= 3
        assert r["threads"] == ["MainThread"] * n
        assert r["done"] == [False] * (n - 1) + [True]


def test_pipelined_buckets_reduce_exactly(two_ranks: list[dict]) -> None:
    # a bucket per parameter or two: each bucket's exchange overlaps the next one's
    out = [r["mixed-pipelined"] for r in two_ranks]
    assert out[0]["buckets"] >= 3
    _check_mixed(out)
    for r in out:  # earlier buckets on the worker, the last on DDP's thread, its result ready
        n = r["buckets"]
        assert r["done"] == [False] * (n - 1) + [True]
        assert [t.startswith("nfabric") for t in r["threads"]] == [True] * (n - 1) + [False]
        assert r["threads"][-1] == "MainThread"
    three = run_ranks(_mixed_worker, 3, 0.0005)  # sharded exchanges (all-to-all, all-gather)
    assert three[0]["buckets"] >= 3
    for name in [n for n in three[0]["local"] if n.startswith("head.")]:
        del three[0]["local"][name]  # fp32 at three ranks sums in gloo's ring order
    _check_mixed(three)


def _nan_worker(rank: int, world: int) -> dict:
    model = make_model()
    ddp = DDP(model)
    injections = parse_injections(["nan@2:1", "nan@3:0"])  # a lone one, then a repeat
    state = attach_with(ddp, _bindings(model, "sign", world_size=world), total_steps=6,
                        injections=injections)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    before = None
    for step in range(6):
        x, y = batch(step, rank)
        loss = F.cross_entropy(ddp(x), y)
        state.observe(loss)
        opt.zero_grad()
        loss.backward()
        if step == 2:
            before = [p.detach().clone() for p in model.parameters()]
            grads_zero = all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())
        opt.step()
        if step == 2:
            unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    state.close()
    finite = all(torch.isfinite(p).all() for p in model.parameters())
    return {"events": state.events, "skipped": state.skipped_steps, "finite": finite,
            "grads_zero": grads_zero, "unchanged": unchanged,
            "routes": state.effective_routes()}


def test_injected_nan_neutralises_step_and_a_repeat_falls_back_on_every_rank(
        two_ranks: list[dict]) -> None:
    out = [r["nan"] for r in two_ranks]
    for r in out:
        assert r["skipped"] == [2, 3]
        assert r["finite"] and r["grads_zero"] and r["unchanged"]
        steps = [(e["step"], e["scope"], e["to"]) for e in r["events"]]
        # the lone NaN at 2 is only neutralised; the second within the window falls back
        assert steps == [(2, "all", "skipped"), (3, "all", "fp32"), (3, "all", "skipped")]
        assert set(r["routes"].values()) == {"fp32"}  # still cooling down at step 6
    assert agreed(out[0]["events"]) == agreed(out[1]["events"])


def _spike_worker(rank: int, world: int) -> list:
    model = make_model()
    ddp = DDP(model)
    state = attach(ddp, _bindings(model, "int8", world_size=world), total_steps=30)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(12):
        x, y = batch(step, rank)
        loss = F.cross_entropy(ddp(x), y)
        # Only rank 0 reports a loss spike at step 8: the mean over ranks still trips, and
        # both ranks must switch at the same step.
        state.observe(loss * (20.0 if (rank == 0 and step == 8) else 1.0))
        opt.zero_grad()
        loss.backward()
        opt.step()
    state.close()
    return agreed(state.events)


def test_ranks_switch_at_the_same_step_from_different_local_losses(two_ranks: list[dict]) -> None:
    events = [r["spike"] for r in two_ranks]
    assert events[0] == events[1]
    assert [(e["step"], e["scope"], e["to"]) for e in events[0]][:1] == [(8, "all", "fp32")]
    assert "loss spike" in events[0][0]["reason"]


#: 10 Mbit/s, 3 ms fixed per sign reduce: TinyNet's 1,664 sign elements pay as one reduce
#: (3.78 ms vs fp32 5.77 ms) but not as the two the hook issues for two regions (6.83 ms).
CALL_LOSES = {"link_gbps": 0.01, "latency_us": 10.0, "codec_call_us": {"sign": 6000.0},
              "encode_gbps": {"sign": 5.0}, "reduce_gbps": {"sign": 0.5},
              "decode_gbps": {"sign": 0.15}}


def _gate_bindings(model, world: int):  # noqa: ANN001, ANN202
    """One bucket: head on fp32, body.0 and the rest on sign as two regions, side by side in
    the bucket (one sign reduce, each region's agreement apart). The substrate goes in the profile: the runtime gate reads the bindings' metadata."""
    profile = static_profile(model, "sign", [("head.*", "fp32"), ("body.0.*", "sign")])
    profile.meta["substrate"] = CALL_LOSES
    return compile_profile(profile, model, world_size=world, bucket_cap_mb=25)


def _gate_worker(rank: int, world: int) -> dict:
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=25)
    plain = DDP(make_model(), bucket_cap_mb=25)
    bindings = _gate_bindings(model, world)
    state = attach(ddp, bindings, total_steps=4)
    _train(ddp, 4, state, rank)
    _train(plain, 4, rank=rank)
    state.close()
    frame = state.traffic_frame()
    return {"decided": {(frozenset(names), phase): v
                        for (names, phase), v in state.gate.decided().items()},
            "bytes": state.bytes_per_route(),
            "control_steps": sorted(set(frame[frame.route == "control"].step)),
            "plain": all(torch.equal(a, b) for a, b in
                         zip(plain.parameters(), ddp.parameters(), strict=True))}


def test_runtime_gate_prices_two_sign_regions_as_compile_profile_does(
    two_ranks: list[dict],
) -> None:
    from nfabric_cli.routes.groups import spec_numels
    from nfabric_cli.substrate.cost import bucket_verdict
    from nfabric_cli.substrate.model import Substrate

    bindings = _gate_bindings(make_model(), 2)
    (bucket,) = bindings.buckets
    groups = bindings.bucket_groups(0, "all")
    assert [(g.spec.name, g.numel, g.regions) for g in groups] == [
        ("fp32", 132, ("head.*",) * 2), ("sign", 1664, ("*",) * 4 + ("body.0.*",) * 2)]
    assert spec_numels(groups) == [(groups[0].spec, 132), (groups[1].spec, 1664)]
    want = bucket_verdict(Substrate.from_dict(CALL_LOSES), spec_numels(groups), 2)
    assert (bucket.verdicts["all"], bucket.reasons["all"]) == ("fallback", want.reason)
    assert want.reason.startswith("codec call overhead: codec 6.06 ms (6 ms fixed per call)")
    for r in two_ranks:
        ((key, v),) = r["gate"]["decided"].items()
        assert key == (frozenset(bucket.params), "all")
        assert (v.admit, v.reason) == (False, bucket.reasons["all"])
        assert (v.fp32_time_s, v.lowbit_time_s) == (want.fp32_time_s, want.lowbit_time_s)
        assert set(r["gate"]["bytes"]) == {"fp32", "control"}  # refused: the bucket went fp32
        # once refused, a step is sent as plain DDP sends it: no statistics round after the
        # first step, and the same parameters bit for bit
        assert r["gate"]["control_steps"] == [0]
        assert r["gate"]["plain"]


def _unused_worker(rank: int, world: int) -> bool:
    model = make_model(unused_branch=True)
    ddp = DDP(model, find_unused_parameters=True, gradient_as_bucket_view=True)
    group = dist.new_group(ranks=list(range(world)))  # a process group other than WORLD
    ddp_sub = DDP(make_model(unused_branch=True), process_group=group, find_unused_parameters=True)
    s1 = attach(ddp, _bindings(model, "sign", [("head.*", "fp32")], world_size=world), total_steps=4)
    s2 = attach(ddp_sub, _bindings(ddp_sub.module, "int4", world_size=world), total_steps=4)
    _train(ddp, 4, s1, rank)
    _train(ddp_sub, 4, s2, rank)
    s1.close()
    s2.close()
    params = list(ddp.parameters()) + list(ddp_sub.parameters())
    return all(torch.isfinite(p).all() for p in params) and s1.step == 4 and s2.step == 4


def test_unused_parameters_and_non_world_group(two_ranks: list[dict]) -> None:
    assert [r["unused"] for r in two_ranks] == [True, True]


def _disjoint_worker(rank: int, world: int) -> dict:
    """Two DDP replicas side by side, ranks {0, 1} and {2, 3} (as beside pipeline stages):
    every rank creates both groups, then attaches to its own replica alone."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    model = make_model()
    ddp = DDP(model, process_group=groups[rank // 2])
    state = attach(ddp, static_profile(model, "sign"), total_steps=3)
    _train(ddp, 3, state, rank)
    state.close()
    return {"ranks": dist.get_process_group_ranks(state.comm.group), "step": state.step,
            "params": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.slow
def test_replicas_on_disjoint_groups_each_attach_on_their_own_ranks() -> None:
    """attach's dedicated group was made by a world-wide `new_group` that only the replica's
    own ranks entered: the two replicas' rendezvous hung (now it would fail at 120 s)."""
    r = run_ranks(_disjoint_worker, 4, timeout=120)
    assert [x["ranks"] for x in r] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert all(x["step"] == 3 for x in r)
    same = [all(torch.equal(a, b) for a, b in zip(r[i]["params"], r[j]["params"], strict=True))
            for i, j in ((0, 1), (2, 3), (0, 2))]
    assert same == [True, True, False]  # each replica agrees with itself; their data differ


class _ToBf16(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16)


def _refused_worker(rank: int, world: int, cases: list[str], where: str) -> list[str]:
    """Each case on a DDP model of its own: what attach said."""
    from nfabric_cli.errors import InputError

    said = []
    for case in cases:
        def net(classes: int = 2, sparse: bool = case == "sparse") -> torch.nn.Module:
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Embedding(50, 8, sparse=sparse),
                                       torch.nn.Linear(8, classes))

        model = net()
        if case in ("static graph, two dtypes", "static graph set after attach",
                    "static graph, trained before attach"):
            model[1].to(torch.bfloat16)
            model.insert(1, _ToBf16())
        # one dtype, two buckets on its first step (one per parameter): the same hang
        caps = {"bucket_cap_mb_list": [1e-4] * 3} if case == "static graph, two buckets" else {}
        ddp = DDP(model, static_graph=case.startswith("static graph,"), **caps)
        if case == "static graph, trained before attach":  # past its delayed first step
            F.cross_entropy(ddp(torch.arange(8)).float(), torch.arange(8) % 2).backward()
        source, kw = _bindings(model, "sign"), {"total_steps": 2}
        if case in ("zero steps", "fractional steps"):
            kw["total_steps"] = 0 if case == "zero steps" else 2.5
        elif case == "no source":
            source = 5
        elif case == "substrate name":
            kw["substrate"] = "fast"
        elif case == "other model":
            source = _bindings(net(3), "sign")
        elif case == "trace file":
            kw["trace_dir"] = where
        try:
            state = attach(ddp, source, **kw)
            if case == "twice":
                attach(ddp, _bindings(model, "sign"), total_steps=2)
            if case == "static graph set after attach":  # checked again at the first bucket
                ddp._set_static_graph()
                F.cross_entropy(ddp(torch.arange(8)).float(), torch.arange(8) % 2).backward()
            if case in ("static graph, one dtype", "static graph, trained before attach"):
                # one dtype: its first step's one bucket is the last
                for step in range(2):
                    idx = torch.randint(0, 50, (8,), generator=torch.Generator().manual_seed(step))
                    F.cross_entropy(ddp(idx), idx % 2).backward()
                said.append(f"trained {state.step} steps, {sorted(state.bytes_per_route())}")
                state.close()
                continue
            state.close()
            said.append("attached")
        except InputError as exc:
            said.append(str(exc))
    return said


def test_what_attach_cannot_serve_is_refused_in_one_line(tmp_path) -> None:
    """sparse: DDP hands a sparse gradient over in a bucket that cannot be sliced (it failed
    at the first backward, in a torch error about `as_strided` on SparseCPU). twice: DDP takes
    one hook for its lifetime (torch's own error came after a second state was built). The
    others were Python errors, or (a total_steps of 0 with bindings, bindings of another
    model) ran on, the phases squeezed into step 0 or the bytes priced for another model."""
    where = tmp_path / "a file"
    where.write_text("")
    expected = {
        "sparse": "nfabric reduces dense gradients only, and module '0' (Embedding) makes "
                  "sparse ones (sparse=True): build it with sparse=False to attach",
        "twice": "this DDP model already has a communication hook (another, or an nfabric "
                 "state still open): attach once per DDP model, before any other hook, or "
                 "attach again once its nfabric state is closed",
        "zero steps": "total steps must be a whole number >= 1, got 0",
        "fractional steps": "total steps must be a whole number >= 1, got 2.5",
        "no source": "attach takes a profile or bindings (a path, an OperatingProfile or "
                     "Bindings), got int",
        "substrate name": "substrate must be a Substrate or its dict, got 'fast'",
        "other model": "these bindings were compiled for another model (fingerprint ",
        "trace file": f"trace_dir {where}: is a file, not a folder",
        # its first step's buckets all come with index 0, none last: it hung (killed at 60 s)
        "static graph, two dtypes": "DDP(static_graph=True) reduces its first step's 2 "
                                    "buckets with none marked last, and nfabric would wait",
        "static graph, two buckets": "DDP(static_graph=True) reduces its first step's 2 "
                                       "buckets with none marked last",
        "static graph, one dtype": "trained 2 steps, ['control', 'sign/sharded']",
        # `ddp._set_static_graph()` after attach: it hung too; now refused at the first step's
        # first bucket, on every rank (torch refuses the call once training has started)
        "static graph set after attach": "DDP(static_graph=True, set after attach) reduces "
                                         "its first step's 2 buckets with none marked last",
        # past its first step at attach: buckets indexed as usual, it trains (not refused at
        # nfabric's first bucket either: the static graph was not set since attach)
        "static graph, trained before attach": "trained 2 steps, ['control', "
                                               "'sign/sharded']",
    }
    # (a static graph the checks miss hangs: the timeout turns that into a failure)
    for said in run_ranks(_refused_worker, 2, list(expected), str(where), timeout=180):
        for case, line in zip(expected, said, strict=True):
            assert line.startswith(expected[case]) and "\n" not in line, (case, line)


def _one_phase_worker(rank: int, world: int) -> list[str]:
    model = make_model()
    ddp = DDP(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = attach(ddp, _bindings(model, "sign"))  # one phase: no total_steps needed
        _train(ddp, 4, state, rank)
        state.close()
    return [str(w.message) for w in caught if "nfabric" in str(w.message)]


def test_a_one_phase_profile_without_total_steps_trains_without_warnings() -> None:
    """Documented as optional for one phase; the state took 1 step for it and warned at step
    2, and again at close, to pass total_steps."""
    assert run_ranks(_one_phase_worker, 2) == [[], []]


def _shared_state_worker(rank: int, world: int) -> str:
    from nfabric_cli.errors import InputError
    from nfabric_cli.runtime.hook import fabric_hook
    from nfabric_cli.runtime.state import FabricState

    first, second = DDP(make_model()), DDP(make_model())
    state = FabricState.create(first, _bindings(first.module, "sign"), total_steps=2)
    first.register_comm_hook(state, fabric_hook)
    second.register_comm_hook(state, fabric_hook)  # (DDP cannot tell)
    x, y = batch(0, rank)
    try:
        F.cross_entropy(second(x), y).backward()
        said = "reduced"
    except InputError as exc:
        said = str(exc)
    state.close()
    return said


def test_one_state_registered_on_two_models_is_refused_at_the_first_bucket() -> None:
    """It failed in a KeyError of a parameter's id at the second model's backward (or, in an
    all-fp32 phase, counted every step twice)."""
    assert run_ranks(_shared_state_worker, 2) == [
        "a DDP model's bucket holds parameters this fabric state was not made for: one state "
        "per DDP model (FabricState.create for each), attached after the last change to which "
        "parameters train"] * 2


def _frozen_after_ddp_worker(rank: int, world: int) -> list[str]:
    from nfabric_cli.errors import InputError
    from nfabric_cli.runtime import attach as attach_module

    said = []
    # frozen before attach: refused there; where DDP's logging data is not there to tell, at
    # the first bucket (a later parameter of it, head, or its first, body.0); frozen after
    # attach it keeps its route and reduces zeros, as in plain DDP
    # (the line's remedy: "rebuilt", frozen mid-run, then a new DDP and a new attach, trains)
    for part, when in (("head", "before"), ("head", "blind"), ("body", "blind"),
                       ("head", "after"), ("body", "thawed"), ("head", "rebuilt")):
        sizes = attach_module._bucket_sizes
        if when == "blind":
            attach_module._bucket_sizes = lambda ddp: None
        model = make_model()
        frozen = list(model.body[0].parameters() if part == "body" else model.head.parameters())
        if when == "thawed":  # trainable only after DDP was built: DDP never reduces it
            for p in frozen:
                p.requires_grad_(False)
            ddp = DDP(model, find_unused_parameters=True)
            for p in frozen:
                p.requires_grad_(True)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                attach(ddp, _bindings(model, "sign"), total_steps=2).close()
            said.append(" | ".join(str(w.message) for w in caught))
            continue
        if when == "rebuilt":
            ddp = DDP(model)
            state = attach(ddp, _bindings(model, "sign"), total_steps=2)
            x, y = batch(0, rank)
            F.cross_entropy(ddp(x), y).backward()
            state.close()
            for p in frozen:
                p.requires_grad_(False)
        # (the remedy is a plain DDP; the cases above keep the frozen one in its buckets)
        ddp = DDP(model) if when == "rebuilt" else DDP(model, find_unused_parameters=True)
        state = None
        try:
            if when == "after":
                state = attach(ddp, _bindings(model, "sign"), total_steps=2)
            for p in frozen:
                p.requires_grad_(False)  # after DDP was built: DDP keeps it in its bucket
            if state is None:
                state = attach(ddp, _bindings(model, "sign"), total_steps=2)
            x, y = batch(0, rank)
            F.cross_entropy(ddp(x), y).backward()
            said.append("reduced")
        except InputError as exc:
            said.append(str(exc))
        attach_module._bucket_sizes = sizes
        if state is not None:
            state.close()
    return said


def test_a_parameter_frozen_after_ddp_was_built_is_refused_in_one_line() -> None:
    """DDP fixes its buckets when built, so a layer frozen after it stays in them; attach binds
    trainable parameters only. Frozen before attach it is refused there (DDP's buckets hold
    more bytes than the trainable parameters), or at its first low-bit bucket. It
    failed in a KeyError of a parameter's id inside backward (where the frozen one was not the
    bucket's first), or in the line for a state registered on another model, which told the
    user to attach after the change they had just made. One made trainable after DDP was built
    (never reduced, in plain DDP too) is warned about at attach."""
    from nfabric_cli.runtime.state import FROZEN_AFTER_DDP

    assert FROZEN_AFTER_DDP.startswith("a DDP model's bucket holds a parameter frozen "
                                       "(requires_grad=False) after DDP was built")
    thawed = ("nfabric: the model has trainable parameters DDP's buckets do not hold (made "
              "trainable after DDP was built?): DDP never reduces them, so their replicas drift "
              "apart, as in plain DDP; set requires_grad before wrapping the model in DDP")
    assert run_ranks(_frozen_after_ddp_worker, 2) == [
        [FROZEN_AFTER_DDP] * 3 + ["reduced", thawed, "reduced"]] * 2


def _again_worker(rank: int, world: int) -> list:
    from nfabric_cli.errors import InputError

    model = make_model()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    states, refused = [], ""
    for run in range(3):  # three runs on one DDP wrapper, as the HF Trainer's train() calls
        state = attach(ddp, _bindings(model, "sign"), total_steps=2)
        if run == 1:
            try:  # while a state is open, no other takes its place
                attach(ddp, _bindings(model, "sign"), total_steps=2)
            except InputError as exc:
                refused = str(exc)
        train_steps(ddp, opt, state, rank, 2 * run, 2 * run + 2)
        state.close()
        states.append(state)
        if run == 0:
            first = dict(states[0].bytes_per_route())
    return [[s.step for s in states], [s.closed for s in states],
            states[0].bytes_per_route() == first, sum(first.values()), refused]


def test_a_closed_states_model_takes_attach_again() -> None:
    """DDP keeps its first hook for life: the closed state passes its buckets on to the one
    attached after it, which counts its own steps and bytes; the closed one reads as it was."""
    for steps, closed, first_unchanged, first_bytes, refused in run_ranks(_again_worker, 2):
        assert steps == [2, 2, 2] and closed == [True, True, True]
        assert first_unchanged and first_bytes > 0  # later runs' bytes are not the first's
        assert refused.startswith("this DDP model already has a communication hook (another, "
                                  "or an nfabric state still open)")
