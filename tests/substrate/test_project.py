"""Projection inputs: shape tables and DDP's steady-state bucket sizes; projection numbers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from nfabric_cli.errors import InputError
from nfabric_cli.substrate.cost import predict_fp32, predict_route
from nfabric_cli.substrate.model import Substrate
from nfabric_cli.substrate.project import (
    ARMS,
    builtin_shapes,
    ddp_bucket_numels,
    model_shapes,
    project,
)


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(300, 1000), nn.ReLU(), nn.Linear(1000, 2000), nn.ReLU(), nn.Linear(2000, 10)
    )


def test_bucket_sizes_match_real_ddp(tmp_path):
    # the rebuilt layout: [4.bias, 4.weight, 2.bias, 2.weight] closes past 1 MiB, then the rest
    ours = ddp_bucket_numels(model_shapes(_mlp()), bucket_cap_mb=4)
    assert ours == [2_022_010, 301_000]
    # a real one-rank gloo DDP in this process (spawning a rank costs seconds)
    assert not dist.is_initialized()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(_mlp(), bucket_cap_mb=4)
        for _ in range(3):  # DDP rebuilds its buckets after the first backward
            ddp(torch.randn(4, 300)).sum().backward()
        real = ddp._get_ddp_logging_data()["rebuilt_bucket_sizes"]
    finally:
        dist.destroy_process_group()
    assert real == ", ".join(str(4 * n) for n in ours)


def test_pythia_shapes():
    shapes = builtin_shapes("pythia-1b")
    assert sum(torch.Size(s).numel() for _, s in shapes) == 1_011_781_632
    assert shapes[0] == ("gpt_neox.embed_in.weight", (50304, 2048))
    assert shapes[-1] == ("embed_out.weight", (50304, 2048))
    assert len(shapes) == 1 + 16 * 12 + 2 + 1  # embed_in, 12 per layer, final LN, embed_out
    buckets = ddp_bucket_numels(shapes)
    assert sum(buckets) == 1_011_781_632
    assert buckets[0] == 50304 * 2048  # embed_out alone overflows the 1 MiB first bucket
    with pytest.raises(InputError, match="unknown shape 'gpt2'"):
        builtin_shapes("gpt2")
    with pytest.raises(InputError, match="no trainable parameters"):
        ddp_bucket_numels([])


def test_projection_rows_are_sums_over_buckets():
    s = Substrate(link_gbps=100.0, latency_us=5.0)
    shapes = [("a", (3_000_000,)), ("b", (1000,))]
    proj = project(shapes, s, world_sizes=(8, 300), links_gbps=(10.0,))
    buckets = ddp_bucket_numels(shapes)
    assert proj.buckets == buckets and proj.params == 3_001_000
    at10 = s.with_link(10.0)
    row = proj.rows[0]
    assert (row.world_size, row.link_gbps) == (8, 10.0)
    assert row.fp32_ring_s == pytest.approx(sum(predict_fp32(n, 8, at10) for n in buckets))
    assert row.sign_central_s == pytest.approx(
        sum(predict_route(ARMS["sign_central"], n, 8, at10) for n in buckets)
    )
    over = proj.rows[1]  # 300 ranks: past the sign route's exact vote-count limit (255)
    assert over.sign_sharded_s is None and over.sign_central_s is None
    assert not over.central_saturated
