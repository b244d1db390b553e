"""The public surface: explicit, lazy, visible; PyTorch's register_comm_hook idiom works."""

from __future__ import annotations

import subprocess
import sys
import warnings

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import nfabric_cli
from nfabric_cli.binding import compile_profile, static_profile
from tests.distutil import run_ranks
from tests.runtime.models import make_model, train_steps


def test_all_names_are_listed_visible_and_resolve() -> None:
    assert nfabric_cli.__all__ == [
        "__version__", "attach", "FabricState", "fabric_hook", "compile_profile", "Bindings",
        "read_profile", "write_profile", "OperatingProfile", "Substrate", "InputError",
        "CheckFailed", "exit_rank", "AccumulationWarning"]
    assert set(nfabric_cli.__all__) <= set(dir(nfabric_cli))
    for name in nfabric_cli.__all__:
        assert getattr(nfabric_cli, name) is not None
    try:
        nfabric_cli.nonexistent  # noqa: B018
    except AttributeError as exc:
        assert "has no attribute 'nonexistent'" in str(exc)
    else:
        raise AssertionError("an unknown name resolved")


def test_importing_the_package_does_not_import_torch_distributed() -> None:
    code = "import sys, nfabric_cli; print('torch.distributed' in sys.modules, sorted(dir(nfabric_cli))[:3])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("False")


def test_attach_keeps_test_knobs_out_of_its_signature() -> None:
    import inspect

    params = set(inspect.signature(nfabric_cli.attach).parameters)
    assert not params & {"injections", "direct_fp32"}
    assert set(inspect.signature(nfabric_cli.FabricState.create).parameters) >= {
        "ddp_model", "source", "total_steps"}


def _idioms(rank: int, world: int) -> bool:
    """attach() and register_comm_hook(FabricState.create(...), fabric_hook) train alike, and
    both warn (on rank 0 only) when the run is longer than the profile was proven for, and
    when the bindings were compiled for another world size (here the second's, for 4)."""
    results = []
    for idiom in ("attach", "register"):
        model = make_model()
        ddp = DDP(model, bucket_cap_mb=0.001)
        compiled = world if idiom == "attach" else 4
        bindings = compile_profile(static_profile(model, "sign", [("head.*", "fp32")]), model,
                                   world_size=compiled, bucket_cap_mb=None)
        bindings.meta["proven"] = {"seeds": [0], "steps": [2, 3], "world_size": world}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if idiom == "attach":
                state = nfabric_cli.attach(ddp, bindings, total_steps=4)
            else:
                state = nfabric_cli.FabricState.create(ddp, bindings, total_steps=4)
                ddp.register_comm_hook(state, nfabric_cli.fabric_hook)
        said = [str(w.message) for w in caught if "proven" in str(w.message)
                or "compiled for" in str(w.message)]
        expected = (["nfabric: the profile was proven on seed 0 at 2, 3 steps, world size "
                     f"{world}; outside that range here: 4 steps (a result there is not "
                     "covered by calibration)"] if rank == 0 else [])
        if rank == 0 and compiled != world:
            expected.append(f"nfabric: these bindings were compiled for 4 ranks and run on "
                            f"{world}: their modelled bytes are those of 4 ranks (the capacity "
                            f"gate prices {world}) (compile-profile --world-size {world} keeps a "
                            "file of this run's own)")
        if said != expected:
            return False
        train_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), state, rank, 0, 4)
        state.close()
        results.append(([p.detach().clone() for p in ddp.parameters()], state.bytes_per_route()))
    (a, bytes_a), (b, bytes_b) = results
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True)) and bytes_a == bytes_b \
        and bytes_a["sign/sharded"] > 0


def test_register_comm_hook_with_fabric_state_create_equals_attach_and_both_warn_outside_proven(
) -> None:
    assert run_ranks(_idioms, 2) == [True, True]
