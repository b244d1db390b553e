"""Cluster-scale projection: gradient-communication time per step at 8..1024 ranks, 10..400 Gbit/s.

Input is a model's parameter shapes only (a built-in workload, a `MODULE:FN` model, or a
built-in shape table such as Pythia-1B), so a billion-parameter model is projected without
allocating it: DDP's own bucket assignment runs on meta tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from nfabric_cli.errors import InputError
from nfabric_cli.routes.spec import FP32, RouteSpec
from nfabric_cli.substrate.cost import MAX_SEARCH_WORLD, first_true, max_world_size, route_cost
from nfabric_cli.substrate.model import Substrate

WORLD_SIZES: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512, 1024)
LINKS_GBPS: tuple[float, ...] = (10.0, 25.0, 50.0, 100.0, 200.0, 400.0)
#: The three arms of the projection: label -> route (None: DDP's fp32 ring all-reduce).
ARMS: dict[str, RouteSpec] = {
    "fp32_ring": FP32,
    "sign_sharded": RouteSpec("sign", reducer="sharded"),
    "sign_central": RouteSpec("sign", reducer="central"),
}


def gpt_neox_shapes(
    hidden: int, layers: int, vocab: int, intermediate: int
) -> list[tuple[str, tuple[int, ...]]]:
    """Trainable parameters of a Hugging Face `GPTNeoXForCausalLM` (untied embeddings), in order."""
    shapes: list[tuple[str, tuple[int, ...]]] = [("gpt_neox.embed_in.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"gpt_neox.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "input_layernorm.bias", (hidden,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
            (p + "post_attention_layernorm.bias", (hidden,)),
            (p + "attention.query_key_value.weight", (3 * hidden, hidden)),
            (p + "attention.query_key_value.bias", (3 * hidden,)),
            (p + "attention.dense.weight", (hidden, hidden)),
            (p + "attention.dense.bias", (hidden,)),
            (p + "mlp.dense_h_to_4h.weight", (intermediate, hidden)),
            (p + "mlp.dense_h_to_4h.bias", (intermediate,)),
            (p + "mlp.dense_4h_to_h.weight", (hidden, intermediate)),
            (p + "mlp.dense_4h_to_h.bias", (hidden,)),
        ]
    shapes += [
        ("gpt_neox.final_layer_norm.weight", (hidden,)),
        ("gpt_neox.final_layer_norm.bias", (hidden,)),
        ("embed_out.weight", (vocab, hidden)),
    ]
    return shapes


#: Built-in shape tables (`--shape NAME`). Pythia-1B: GPT-NeoX, 1,011,781,632 parameters.
SHAPES = {
    "pythia-1b": lambda: gpt_neox_shapes(hidden=2048, layers=16, vocab=50304, intermediate=8192),
    "pythia-160m": lambda: gpt_neox_shapes(hidden=768, layers=12, vocab=50304, intermediate=3072),
}


def builtin_shapes(name: str) -> list[tuple[str, tuple[int, ...]]]:
    if name not in SHAPES:
        raise InputError(f"unknown shape {name!r} (choose from {', '.join(SHAPES)})")
    return SHAPES[name]()


def model_shapes(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """Trainable parameters of `model` in registration order (tied weights once)."""
    return [(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad]


def ddp_bucket_numels(
    shapes: list[tuple[str, tuple[int, ...]]], bucket_cap_mb: float = 25.0
) -> list[int]:
    """Elements per DDP gradient bucket in steady state (fp32 grads).

    DDP rebuilds its buckets after the first backward in gradient-ready order, which for a
    feed-forward model is reverse registration order, with the first bucket capped at
    `dist._DEFAULT_FIRST_BUCKET_BYTES` (1 MiB) and the rest at `bucket_cap_mb`; this runs the
    same assignment function on meta tensors.
    """
    if not shapes:
        raise InputError("the model has no trainable parameters")
    tensors = [torch.empty(shape, device="meta") for _, shape in reversed(shapes)]
    limits = [dist._DEFAULT_FIRST_BUCKET_BYTES, int(bucket_cap_mb * 1024 * 1024)]
    buckets, _ = dist._compute_bucket_assignment_by_size(tensors, limits, [False] * len(tensors))
    return [sum(tensors[i].numel() for i in bucket) for bucket in buckets]


def step_seconds(
    spec: RouteSpec, buckets: list[int], world_size: int, s: Substrate
) -> float | None:
    """Predicted gradient-communication seconds per step: every bucket on `spec`, in series.

    None where the route cannot aggregate `world_size` ranks exactly (its `max_world_size`).
    """
    if world_size > max_world_size(spec):
        return None
    return sum(route_cost(spec, n, world_size, s).total_s for n in buckets)


@dataclass(frozen=True)
class ProjectionRow:
    world_size: int
    link_gbps: float
    fp32_ring_s: float
    sign_sharded_s: float | None  # None: beyond the route's world-size limit
    sign_central_s: float | None

    @property
    def central_saturated(self) -> bool:
        """The central reducer no longer beats the fp32 ring at this point."""
        return self.sign_central_s is not None and self.sign_central_s >= self.fp32_ring_s


@dataclass(frozen=True)
class Projection:
    params: int
    buckets: list[int]
    rows: list[ProjectionRow]
    saturation: dict[float, int | None]  # link Gbit/s -> first W where sign-central loses
    route_limit: int  # largest world size the sign route aggregates
    substrate: Substrate


def project(
    shapes: list[tuple[str, tuple[int, ...]]],
    substrate: Substrate,
    world_sizes: tuple[int, ...] = WORLD_SIZES,
    links_gbps: tuple[float, ...] = LINKS_GBPS,
    bucket_cap_mb: float = 25.0,
) -> Projection:
    """Predicted per-step gradient-communication time of each arm over the grid."""
    buckets = ddp_bucket_numels(shapes, bucket_cap_mb)
    base = replace(substrate, topology=None)  # each arm names its own reducer
    rows: list[ProjectionRow] = []
    saturation: dict[float, int | None] = {}
    limit = max_world_size(ARMS["sign_central"])
    for link in links_gbps:
        s = base.with_link(link)
        for w in world_sizes:
            t = {arm: step_seconds(spec, buckets, w, s) for arm, spec in ARMS.items()}
            rows.append(ProjectionRow(w, link, t["fp32_ring"], t["sign_sharded"],
                                      t["sign_central"]))

        def loses(w: int, s: Substrate = s) -> bool:
            central = step_seconds(ARMS["sign_central"], buckets, w, s)
            return central is not None and central >= step_seconds(FP32, buckets, w, s)

        saturation[link] = first_true(loses, 2, min(limit, MAX_SEARCH_WORLD))
    return Projection(sum(buckets), buckets, rows, saturation, limit, substrate)


def assumptions(s: Substrate) -> list[str]:
    """The model's assumptions, printed beside every projection."""
    endpoint = "a rank's link" if s.endpoint_gbps is None else f"{s.endpoint_gbps:g} Gbit/s"
    kinds = ", ".join(f"{k} {v:g} us" for k, v in s.latency_us_by_kind.items())
    return [
        f"alpha-beta model, alpha = {s.alpha * 1e6:g} us per hop, one full-duplex link per rank"
        + (f"; per round, overlapping the transfer: {kinds} (fitted at "
           f"{s.world_size or '?'} ranks, extrapolated)" if kinds else ""),
        "fp32: DDP ring all-reduce per bucket (no tree, no hierarchy); buckets as DDP assigns them",
        "sign-sharded: all-to-all of 1-bit codes then all-gather of the 1-bit result",
        f"sign-central: fan-in to one endpoint of capacity {endpoint}, W-1 copies sent back",
        (
            f"codec: sign {s.codec_call_s('sign') * 1e6:g} us per call, encode "
            f"{s.encode_bytes_per_s('sign') / 1e9:g}, reduce "
            f"{s.reduce_bytes_per_s('sign') / 1e9:g}, decode "
            f"{s.decode_bytes_per_s('sign') / 1e9:g} GB/s of fp32 (the central endpoint "
            "combines all W contributions)"
            if s.include_codec
            else "codec: not counted (--no-codec: encode/reduce/decode offloaded at line rate)"
        ),
        "buckets communicate one after another, no overlap with backward compute",
        "saturation: smallest world size where sign-central is no faster than the fp32 ring",
        f"sign aggregates exactly up to {max_world_size(ARMS['sign_central'])} ranks "
        "(vote counts); larger world sizes show n/a",
    ]
