"""Checkpoint and resume of the fabric state: a resumed run is bit-identical to an
uninterrupted one (2 real gloo ranks, error feedback, stochastic rounding, three phases)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from nfabric_cli import attach
from nfabric_cli.binding import compile_profile
from nfabric_cli.errors import InputError
from nfabric_cli.profile.operating import OperatingProfile, ProfileRow
from tests.distutil import run_ranks
from tests.runtime.models import make_model, train_steps

TOTAL = 40
PHASES = [("warmup", 0.0, 0.1, {"head.*": "fp32", "*": "fp32"}),
          ("main", 0.1, 0.6, {"head.*": "int8", "*": "sign"}),
          ("late", 0.6, 1.0, {"head.*": "int8", "*": "ternary"})]


def _profile(model) -> OperatingProfile:
    rows = []
    for name, start, end, routes in PHASES:
        for priority, (selector, route) in enumerate(routes.items()):
            low = route != "fp32"
            rows.append(ProfileRow(selector, name, start, end, priority, route,
                                   tau=0.5 if route == "ternary" else None, error_feedback=low,
                                   rounding="stochastic" if route == "int8" else None))
    from nfabric_cli.binding.fingerprint import model_fingerprint

    return OperatingProfile(rows, {"model_fingerprint": model_fingerprint(model)}).validate()


def _setup(rank: int, world: int = 2):
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.001)
    bindings = compile_profile(_profile(model), model, world_size=world, bucket_cap_mb=None)
    state = attach(ddp, bindings, total_steps=TOTAL, seed=3)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    return ddp, state, opt


def _steps(ddp, state, opt, rank: int, start: int, stop: int) -> None:
    train_steps(ddp, opt, state, rank, start, stop)


def _whole(rank: int, world: int) -> dict:
    ddp, state, opt = _setup(rank)
    _steps(ddp, state, opt, rank, 0, TOTAL)
    state.close()
    return {"params": [p.detach().clone() for p in ddp.parameters()], "step": state.step,
            "phase": state.phase.name, "bytes": state.traffic_frame(),
            "events": state.events, "residuals": len(state.ef)}


def _first_half(rank: int, world: int, path: str, how: str) -> dict:
    ddp, state, opt = _setup(rank)
    _steps(ddp, state, opt, rank, 0, TOTAL // 2)
    fabric = (state.state_dict(dst=1) if how == "gather-to-writer"
              else state.state_dict(all_ranks=how == "gather-to-all"))
    writer = 1 if how == "gather-to-writer" else 0
    if how != "per-rank":  # a framework that writes from one rank only
        if rank == writer:
            torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(),
                        "fabric": fabric}, path)
    else:
        torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(),
                    "fabric": fabric}, f"{path}.{rank}")
    with warnings.catch_warnings(record=True):
        state.close()
    return {"residuals": len(state.ef), "ranks": sorted(fabric["ranks"])}


def _second_half(rank: int, world: int, path: str) -> dict:
    ddp, state, opt = _setup(rank)
    ckpt = torch.load(path if os.path.exists(path) else f"{path}.{rank}", weights_only=False)
    ddp.module.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    state.load_state_dict(ckpt["fabric"])
    assert state.step == TOTAL // 2 and state.phase.name == "main"
    _steps(ddp, state, opt, rank, TOTAL // 2, TOTAL)
    state.close()
    return {"params": [p.detach().clone() for p in ddp.parameters()], "step": state.step,
            "phase": state.phase.name, "bytes": state.traffic_frame(),
            "events": state.events, "residuals": len(state.ef)}


@pytest.fixture(scope="module")
def whole() -> list[dict]:
    """The uninterrupted run, trained once for every way of writing the checkpoint."""
    return run_ranks(_whole, 2)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["gather-to-all", "gather-to-writer", "per-rank"])
def test_resume_is_bit_identical_to_an_uninterrupted_run(
    tmp_path: Path, how: str, whole: list[dict]
) -> None:
    path = str(tmp_path / "ckpt.pt")
    first = run_ranks(_first_half, 2, path, how)
    assert all(r["residuals"] > 0 for r in first)  # error feedback was carrying residuals
    # whose residuals each rank held: every rank's, only the writer (rank 1) every rank's, or
    # each its own
    assert [r["ranks"] for r in first] == {"gather-to-all": [[0, 1], [0, 1]],
                                           "gather-to-writer": [[0], [0, 1]],
                                           "per-rank": [[0], [1]]}[how]
    resumed = run_ranks(_second_half, 2, path)  # new processes: nothing survives but the files
    for a, b in zip(whole, resumed, strict=True):
        assert a["step"] == b["step"] == TOTAL and a["phase"] == b["phase"] == "late"
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))
        assert a["events"] == b["events"]
        # byte counters continue; only the resumed process's first step differs a little:
        # a new DDP instance buckets its first step in registration order, then rebuilds
        # (plain DDP does the same on resume), and the fabric meters the buckets it is given
        first = TOTAL // 2
        same = [f[f.step != first].reset_index(drop=True) for f in (a["bytes"], b["bytes"])]
        assert same[0].equals(same[1])
        moved = [f[f.step == first]["total"].sum() for f in (a["bytes"], b["bytes"])]
        assert abs(moved[0] - moved[1]) <= 0.05 * moved[0]
        assert a["residuals"] == b["residuals"]


def _refusals(rank: int, world: int, path: str) -> list[str]:
    from nfabric_cli.integrations.common import load_rank_state

    ddp, state, opt = _setup(rank)
    good = state.state_dict()
    out = []
    model = make_model()
    other = DDP(model, bucket_cap_mb=0.001)
    from nfabric_cli.binding import static_profile

    bindings = compile_profile(static_profile(model, "sign"), model, world_size=2,
                               bucket_cap_mb=None)
    another = attach(other, bindings, total_steps=TOTAL)  # the same model, another profile
    for bad in (good, {**good, "version": 99}, {"kind": "something else"},
                {**good, "ranks": {1 - rank: good["ranks"][1 - rank]}}):
        try:
            (another if bad is good else state).load_state_dict(bad)
            out.append("accepted")
        except InputError as exc:
            out.append(str(exc))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state.load_state_dict({**good, "ranks": {1 - rank: good["ranks"][1 - rank]}},
                              strict=False)
        out.append(str(caught[0].message) if caught else "no warning")
        state.load_state_dict({**good, "total_steps": TOTAL // 2})  # a longer run resumed
        out.append(str(caught[-1].message) if len(caught) > 1 else "no warning")
        writers = []
        for dst in (2, "0"):  # a rank outside the group; a rank that is no integer
            try:
                state.state_dict(dst=dst)
                writers.append("gathered")
            except InputError as exc:
                writers.append(str(exc))
        out.append(" | ".join(writers))
        try:  # a framework's checkpoint folder without this rank's file
            load_rank_state(state, path, "X")
            out.append("loaded")
        except InputError as exc:
            out.append(str(exc))
    seen = (state.step, list(state.events), state.bytes_per_route(), state.monitor.state_dict())
    no_ef = {r: {k: v for k, v in part.items() if k != "ef"} for r, part in good["ranks"].items()}
    for bad in ({k: v for k, v in good.items() if k != "step"}, {**good, "ranks": no_ef},
                {**good, "monitor": {}}, {**good, "guard": good["guard"], "held": None},
                {**good, "step": float("inf")}, {**good, "version": "x"}):
        try:
            state.load_state_dict(bad)
            out.append("accepted")
        except InputError as exc:
            out.append(str(exc))
    now = (state.step, list(state.events), state.bytes_per_route(), state.monitor.state_dict())
    out.append("unchanged" if now == seen else f"changed: {seen} -> {now}")
    try:
        state.state_dict(all_ranks=False, dst=0)
        out.append("kept")
    except InputError as exc:
        out.append(str(exc))
    another.close()
    state.close()
    try:  # a closed state drives no step: what it loaded would be lost
        state.load_state_dict(good)
        out.append("accepted")
    except InputError as exc:
        out.append(str(exc))
    return out


@pytest.mark.slow
def test_a_state_from_other_bindings_or_version_is_refused_in_one_line(tmp_path: Path) -> None:
    for rank, out in enumerate(run_ranks(_refusals, 2, str(tmp_path))):
        other, newer, alien, missing, lenient, longer, writer, no_file, *malformed = out
        assert other.startswith("fabric state is from other bindings") and \
            other.endswith("another model or profile")
        assert "the run was 20 steps long and is now 40: phase boundaries" in longer
        assert newer == "fabric state version 99 is newer than this nfabric reads (1): upgrade nfabric"
        assert alien == "not an nfabric fabric state (expected FabricState.state_dict())"
        assert missing.startswith(f"fabric state holds rank(s) [{1 - rank}] only, not rank {rank}")
        assert "this rank starts with no error-feedback residuals" in lenient
        assert writer == ("state_dict(dst=2): dst is a rank of the fabric's group, 0 to 1 | "
                          "state_dict(dst='0'): dst is a rank of the fabric's group, an integer")
        assert no_file == (f"nfabric: X resumes from {tmp_path}, which holds no "
                           f"nfabric_state_{rank}.pt for this rank (saved without nfabric, or on "
                           "another node: each rank reads its own file)")
        # a truncated or malformed state is refused in one line, and nothing of it is loaded
        (no_step, no_ef, bad_monitor, bad_held, inf_step, bad_version, unchanged, contradiction,
         closed) = malformed
        assert no_step == "fabric state is incomplete (no step): nothing was loaded"
        assert no_ef == "fabric state is malformed (KeyError: 'ef'): nothing was loaded"
        assert bad_monitor.startswith("fabric state is malformed (KeyError: ")
        assert bad_held == ("fabric state is malformed (TypeError: 'NoneType' object is not "
                            "iterable): nothing was loaded")
        assert inf_step == ("fabric state is malformed (OverflowError: cannot convert float "
                            "infinity to integer): nothing was loaded")
        assert bad_version == "fabric state is malformed (version 'x'): nothing was loaded"
        assert unchanged == "unchanged"
        assert contradiction.startswith("state_dict(all_ranks=False, dst=0): dst is where")
        assert closed == ("load_state_dict() into a closed nfabric state: load it into the "
                          "state attach() returned for the resumed run")
        assert all("\n" not in m for m in out)


#: Every low-bit bucket refused (a fast link, slow codec calls): after a phase's first step the
#: hook sends its steps as plain DDP's (`StepController.gated_off`).
REFUSES = {"link_gbps": 100.0, "latency_us": 1.0,
           "codec_call_us": {"sign": 6000.0, "int8": 6000.0, "ternary": 6000.0}}
SPIKE_AT = TOTAL // 2  # the resumed run's first step


def _gated(rank: int, world: int, path: str, part: str, keep_priced: bool = True) -> dict:
    """`part` "whole": the run uninterrupted; "first": its first half, then a checkpoint;
    "second": a new process resuming from it. A spike lands on the resumed step."""
    from nfabric_cli.runtime.attach import attach_with
    from nfabric_cli.runtime.inject import Injection

    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.001)
    profile = _profile(model)
    profile.meta["substrate"] = REFUSES
    bindings = compile_profile(profile, model, world_size=2, bucket_cap_mb=None)
    state = attach_with(ddp, bindings, total_steps=TOTAL, seed=3,
                        injections=(Injection("spike", SPIKE_AT, 1),))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    start, stop = {"whole": (0, TOTAL), "first": (0, SPIKE_AT), "second": (SPIKE_AT, TOTAL)}[part]
    if part == "second":
        ckpt = torch.load(f"{path}.{rank}", weights_only=False)
        ddp.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        if not keep_priced:  # a state saved before the priced buckets were kept
            del ckpt["fabric"]["priced"]
        state.load_state_dict(ckpt["fabric"])
    _steps(ddp, state, opt, rank, start, stop)
    if part == "first":
        torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(),
                    "fabric": state.state_dict()}, f"{path}.{rank}")
    with warnings.catch_warnings(record=True):
        state.close()
    frame = state.traffic_frame()
    return {"params": [p.detach().clone() for p in ddp.parameters()],
            "events": [e for e in state.events if e["step"] >= SPIKE_AT],
            # steps with a statistics round: those sent through the worker, not gated off
            "worker_steps": sorted({int(s) for s in frame[frame.route == "control"].step
                                    if s >= SPIKE_AT})}


@pytest.mark.slow
def test_a_run_resumed_in_a_gated_off_phase_sends_its_first_step_as_the_whole_run_did(
    tmp_path: Path,
) -> None:
    """The gate's priced buckets travel in the checkpoint: the resumed step goes out as plain
    DDP's, as in the uninterrupted run (no statistics round; the spike on it passes unheld in
    both), bit for bit. From a state saved before they were kept, the resumed step goes
    through the worker once to be priced again."""
    path = str(tmp_path / "ckpt.pt")
    whole = run_ranks(_gated, 2, path, "whole")
    run_ranks(_gated, 2, path, "first")
    resumed = run_ranks(_gated, 2, path, "second")
    old = run_ranks(_gated, 2, path, "second", False)
    for w, r, o in zip(whole, resumed, old, strict=True):
        assert all(torch.isfinite(p).all() for p in w["params"])
        assert all(torch.equal(a, b) for a, b in zip(w["params"], r["params"], strict=True))
        assert w["events"] == r["events"] and not any(e["to"] == "held" for e in w["events"])
        assert w["worker_steps"] == r["worker_steps"] == [TOTAL * 6 // 10]  # "late" begins
        assert o["worker_steps"] == [SPIKE_AT, TOTAL * 6 // 10]


def _two_models(rank: int, world: int, folder: str) -> list[str]:
    """Two attached models (a GAN's), each saved to its own rank file and restored from it;
    then a damaged file."""
    from nfabric_cli.integrations.common import load_rank_state, save_rank_state

    (ddp_a, a, opt_a), (ddp_b, b, opt_b) = _setup(rank), _setup(rank)
    _steps(ddp_a, a, opt_a, rank, 0, 3)
    _steps(ddp_b, b, opt_b, rank, 0, 5)
    names = [save_rank_state(s, folder, i).name for i, s in enumerate((a, b))]
    saved = [s.state_dict(all_ranks=False)["step"] for s in (a, b)]
    for i, s in enumerate((a, b)):
        load_rank_state(s, folder, "X", i)
    out = [*names, f"steps {a.step} {b.step} (saved {saved})"]
    Path(folder, f"nfabric_state_{rank}.pt").write_bytes(b"not a checkpoint")
    try:
        load_rank_state(a, folder, "X")
    except InputError as exc:
        out.append(str(exc))
    with warnings.catch_warnings(record=True):
        a.close()
        b.close()
    return out


def test_each_attached_model_has_its_own_rank_file(tmp_path: Path) -> None:
    """Accelerate saved every attached model's state to one file, so a second model's state
    replaced the first's, and both resumed from it."""
    for rank, out in enumerate(run_ranks(_two_models, 2, str(tmp_path))):
        first, second, steps, damaged = out
        assert (first, second) == (f"nfabric_state_{rank}.pt", f"nfabric_model1_state_{rank}.pt")
        assert steps == "steps 3 5 (saved [3, 5])"
        assert damaged.startswith(f"nfabric: {tmp_path}/nfabric_state_{rank}.pt is not a "
                                  "readable fabric state (") and "\n" not in damaged


def _late_rank(rank: int, world: int, late: float) -> list:
    """Rank 1 reaches each gathering state_dict `late` seconds after rank 0 (a slow rank, or
    one that never comes: the notice is what rank 0 sees either way), then both on time."""
    import time

    import torch.distributed as dist

    from nfabric_cli.runtime import checkpoint

    ddp, state, opt = _setup(rank)
    _steps(ddp, state, opt, rank, 0, 6)
    out = []
    for how, lag in (({}, late), ({}, 0.0), ({"dst": 0}, late), ({"dst": 0}, 0.0),
                     ({"all_ranks": False}, late)):
        # only rank 0 waits (for rank 1, late); on time, no notice however loaded the machine
        checkpoint.WAIT_NOTICE_S = late / 4 if lag and rank == 0 else 60.0
        dist.barrier()
        if rank == 1:
            time.sleep(lag)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sd = state.state_dict(**how)
        out.append((sorted(sd["ranks"]), [str(w.message) for w in caught]))
    state.close()
    return out


@pytest.mark.slow
def test_a_gathering_state_dict_that_waits_for_the_other_ranks_says_why() -> None:
    """`if rank == 0: state.state_dict()` waits until the process group times out; after
    `WAIT_NOTICE_S` the waiting rank says why and how to save instead, and goes on waiting
    (a rank that is only late completes the gather). Ranks on time, and the per-rank form,
    say nothing."""
    first, second = run_ranks(_late_rank, 2, 2.0)
    notice = ("nfabric: rank 0 has waited 0.5 s in state_dict({}) for the other ranks: it gathers "
              "every rank's part, so every rank must call it (between steps). Called on one rank "
              "only it waits until the process group times out or fails: call "
              "state_dict(dst=0) on every rank and save on rank 0, or save "
              "state_dict(all_ranks=False) on each rank")
    assert first == [([0, 1], [notice.format("all_ranks=True")]), ([0, 1], []),
                     ([0, 1], [notice.format("dst=0")]), ([0, 1], []), ([0], [])]
    # rank 1 came late: nothing to wait for; with dst=0 it gets its own part back
    assert second == [([0, 1], []), ([0, 1], []), ([1], []), ([1], []), ([1], [])]


def _saved_at_two(rank: int, world: int, folder: str) -> dict:
    from nfabric_cli.integrations.common import save_rank_state

    ddp, state, opt = _setup(rank)
    _steps(ddp, state, opt, rank, 0, TOTAL // 2)
    gathered = state.state_dict()
    if rank == 0:
        torch.save(gathered, os.path.join(folder, "gathered.pt"))
    save_rank_state(state, folder)
    with warnings.catch_warnings(record=True):
        state.close()
    return {k: gathered[k] for k in SHARED}


SHARED = ("step", "monitor", "guard", "skipped_steps", "priced", "pending_times")


def _resumed_at_three(rank: int, world: int, folder: str) -> dict:
    import torch.distributed as dist

    from nfabric_cli.integrations.common import load_rank_state

    mixed, corrupt = os.path.join(folder, "mixed"), os.path.join(folder, "corrupt")
    if rank == 0:  # rank 1's file from another run, at another step; rank 2's file damaged
        for where in (mixed, corrupt):
            os.mkdir(where)
            for r in (0, 1):
                sd = torch.load(os.path.join(folder, f"nfabric_state_{r}.pt"), weights_only=True)
                if where == mixed and r == 1:
                    sd["step"] = TOTAL // 2 - 8
                torch.save(sd, os.path.join(where, f"nfabric_state_{r}.pt"))
        Path(corrupt, "nfabric_state_2.pt").write_bytes(b"not a checkpoint")
    dist.barrier()
    out: dict = {}
    for how in ("strict", "gathered", "rank files", "mixed", "corrupt"):
        ddp, state, opt = _setup(rank, world)
        saved = torch.load(os.path.join(folder, "gathered.pt"), weights_only=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                if how == "strict":
                    state.load_state_dict(saved)
                elif how == "gathered":
                    state.load_state_dict(saved, strict=False)
                else:  # as the HF Trainer and Accelerate adapters resume (rank 2 has no file)
                    load_rank_state(state, os.path.join(folder, how.replace("rank files", "")),
                                    "X")
            except InputError as exc:
                out[how] = str(exc)
                state.close()
                continue
        resumed, phase = state.state_dict(all_ranks=False), state.phase.name
        _steps(ddp, state, opt, rank, TOTAL // 2, TOTAL // 2 + 4)  # trains on, in step
        out[how] = {"warnings": [str(w.message) for w in caught], "phase": phase,
                    "residuals_at_load": len(resumed["ranks"][rank]["ef"]["residual"]),
                    "shared": {k: resumed[k] for k in SHARED}, "step_after": state.step,
                    "params": [p.detach().clone() for p in ddp.parameters()]}
        state.close()
    return out


@pytest.mark.slow
def test_a_state_saved_at_another_world_size_resumes_without_its_residuals(
        tmp_path: Path) -> None:
    """A job resumed on more (or fewer) ranks: refused with one line under `strict`, resumed
    with `strict=False` (the framework adapters' way): the step, phase and monitor as saved
    (its gradient norms, sums over ranks, rescaled by sqrt(3/2)), no residuals (they were per
    rank), the gate's and guard's measurements this run's own. Rank 2 has no file of its own
    among two ranks' files: it takes the shared part from another's. A folder whose files come
    from two runs is refused on every rank."""
    saved = run_ranks(_saved_at_two, 2, str(tmp_path))[0]
    assert saved["priced"] and saved["pending_times"] and any(saved["guard"]["windows"].values())
    assert any(saved["monitor"]["norm_windows"].values())
    ranks = run_ranks(_resumed_at_three, 3, str(tmp_path))
    note = ("nfabric: fabric state was saved with 2 ranks, this run has 3: error-feedback "
            "residuals are per rank, so every rank starts without them; the step, phase, health "
            "monitor and update guard go on (their norms rescaled), and the capacity gate prices "
            "this run's buckets again")
    factor = 1.5 ** 0.5
    monitor = {**saved["monitor"], **{key: {s: [v * factor for v in values]
                                            for s, values in saved["monitor"][key].items()}
                                      for key in ("norm_windows", "early_norms")}}
    # the guard's windows (mean-gradient norms) at max(1, sqrt(2/3)) = 1: as saved
    expected = {**saved, "monitor": monitor, "priced": {}, "pending_times": []}
    for rank, out in enumerate(ranks):
        assert out["strict"] == ("fabric state was saved with 2 ranks, this run has 3: "
                                 "error-feedback residuals are per rank; load_state_dict(state, "
                                 "strict=False) resumes the rest without them")
        for how in ("gathered", "rank files"):
            got = out[how]
            assert got["warnings"] == [note], (rank, how)
            assert got["shared"] == expected and got["phase"] == "main"
            assert got["residuals_at_load"] == 0 and got["step_after"] == TOTAL // 2 + 4
        for mine, first in zip(out["gathered"]["params"], ranks[0]["gathered"]["params"],
                               strict=True):
            assert torch.equal(mine, first)  # DDP kept the replicas equal: the ranks in step
        # the same state either way (the two paths load the same shared part)
        for a, b in zip(out["gathered"]["params"], out["rank files"]["params"], strict=True):
            assert torch.equal(a, b)
        assert out["mixed"] == (f"nfabric: X resumed the ranks at different steps from "
                                f"{tmp_path}/mixed (rank 0 at 20, rank 1 at 12, rank 2 at 20): "
                                "it holds rank files of more than one run")
        # one rank's damaged file stops every rank (no rank trains on, none hangs)
        damaged = f"{tmp_path}/corrupt/nfabric_state_2.pt is not a readable fabric state ("
        assert out["corrupt"].startswith(f"nfabric: {damaged}" if rank == 2 else
                                         f"nfabric: rank 2 could not resume: {damaged}")
