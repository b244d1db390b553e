"""A profile matches the model as users hold it: wrapped, compiled, renamed, cast to bf16."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from nfabric_cli.binding import compile_profile, static_profile
from nfabric_cli.errors import InputError
from tests.runtime.models import make_model


class Holder(nn.Module):
    """What a LightningModule (or any training wrapper) looks like: the network as `net`."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net


def _profile(model: nn.Module, recorded: bool = True):
    profile = static_profile(model, "sign", [("head.*", "fp32")])
    if not recorded:  # a profile from before parameters were recorded: the hash alone
        profile.meta["provenance"] = {k: v for k, v in profile.meta["provenance"].items()
                                      if k != "model_params"}
    return profile


def _routes(bindings) -> dict[str, str]:
    return {n: b.routes["all"].name for n, b in bindings.params.items()}


@pytest.mark.parametrize("recorded", [True, False], ids=["listed", "hash-only"])
def test_wrapper_prefixes_and_compile_are_not_differences(recorded: bool) -> None:
    model = make_model()
    profile = _profile(model, recorded)
    plain = _routes(compile_profile(profile, model))
    assert plain["head.weight"] == "fp32" and plain["body.0.weight"] == "sign"
    for wrapped, prefix in ((Holder(model), "net."), (Holder(Holder(model)), "net.net."),
                            (torch.compile(model), "_orig_mod."),
                            (Holder(torch.compile(model)), "net._orig_mod.")):
        bindings = compile_profile(profile, wrapped)
        routes = _routes(bindings)
        assert routes == {prefix + n: r for n, r in plain.items()}  # the user's names, same routes
        notes = " ".join(bindings.meta["model_match"]["notes"])
        assert ("_orig_mod." in notes) == ("_orig_mod." in prefix)
        stripped = prefix.replace("_orig_mod.", "")
        assert bindings.meta["model_match"]["stripped"] == stripped
    # a selector in the user's own names keeps working beside the profile's
    user = static_profile(Holder(model), "sign", [("net.head.*", "fp32")])
    assert _routes(compile_profile(user, Holder(model)))["net.head.weight"] == "fp32"


def test_a_profile_made_from_the_wrapper_fits_the_bare_network() -> None:
    model = make_model()
    profile = static_profile(Holder(model), "sign", [("net.head.*", "fp32")])
    bindings = compile_profile(profile, model)
    assert _routes(bindings)["head.weight"] == "fp32"
    assert bindings.meta["model_match"]["added"] == "net."


@pytest.mark.parametrize("recorded", [True, False], ids=["listed", "hash-only"])
def test_a_bf16_model_takes_an_fp32_profile_with_a_note(recorded: bool) -> None:
    model = make_model()
    profile = _profile(model, recorded)
    cast = copy.deepcopy(model).to(torch.bfloat16)
    bindings = compile_profile(profile, Holder(cast))
    assert {b.dtype for b in bindings.params.values()} == {"bfloat16"}  # the real dtype
    assert bindings.meta["model_match"]["dtype"] == "model bfloat16, profile float32"
    assert _routes(bindings)["net.head.weight"] == "fp32"


def test_a_real_mismatch_says_what_differs() -> None:
    model = make_model()
    profile = _profile(model)
    other = make_model()
    other.head = nn.Linear(32, 7)
    with pytest.raises(InputError) as exc:
        compile_profile(profile, Holder(other))
    msg = str(exc.value)
    assert msg.startswith("profile was made for another model")
    assert "shapes differ for net.head.weight, net.head.bias" in msg
    assert "net.head.weight [7, 32] vs profile [4, 32]" in msg
    extra = make_model(unused_branch=True)
    with pytest.raises(InputError, match=r"10 trainable parameters vs the profile's 8; only in "
                                         r"the model: unused.bias, unused.weight"):
        compile_profile(profile, extra)
    with pytest.raises(InputError, match=r"even without wrapper prefixes and with any float "
                                         r"dtype \(the profile does not list its parameters"):
        compile_profile(_profile(model, recorded=False), extra)
