"""The optional HuggingFace extra: tiny models from configs, offline, bindable by selectors."""

from __future__ import annotations

import pytest
import torch

from nfabric_cli.binding import compile_profile, static_profile
from nfabric_cli.workloads import hf
from nfabric_cli.workloads.registry import load_model

transformers = pytest.importorskip("transformers", reason="optional extra nfabric_cli[hf]")


@pytest.mark.parametrize(
    "name,head,norm",
    [
        ("tiny_bert", "classifier.*", "type:LayerNorm"),
        ("tiny_distilbert", "classifier.*", "type:LayerNorm"),
        ("tiny_gpt_neox", "lm_head.*", "type:LayerNorm"),
    ],
)
def test_tiny_hf_models_bind_with_real_names(name: str, head: str, norm: str) -> None:
    model = load_model(f"nfabric_cli.workloads.hf:{name}")
    profile = static_profile(model, "sign", [(head, "fp32"), (norm, "fp32")])
    bindings = compile_profile(profile, model, world_size=4)
    routes = {n: b.routes["all"].name for n, b in bindings.params.items()}
    assert all(routes[n] == "fp32" for n in routes if n.startswith(head.rstrip(".*")))
    assert sum(r == "sign" for r in routes.values()) > len(routes) / 2
    assert bindings.traffic_fraction("all") < 0.5


def test_gpt_neox_has_pythia_names_and_runs() -> None:
    model = hf.tiny_gpt_neox()
    names = [n for n, _ in model.named_parameters()]
    assert "gpt_neox.layers.0.attention.query_key_value.weight" in names
    assert "lm_head.weight" in names  # untied output layer
    out = model(input_ids=torch.randint(0, 1000, (2, 16)))
    assert out.logits.shape == (2, 16, 1000)
