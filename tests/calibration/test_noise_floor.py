"""bench.noise_floor: its perturbations are invisible changes, and the summary is right."""

from __future__ import annotations

import math

import pytest
import torch

from bench.noise_floor import layouts_differ, nudge_one_ulp, summarise
from nfabric_cli.workloads.registry import get_workload


def test_ulp_nudge_moves_one_element_by_one_ulp() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    before = [p.detach().clone() for p in model.parameters()]
    nudge_one_ulp(model)
    after = list(model.parameters())
    changed = [(i, j) for i, (b, a) in enumerate(zip(before, after, strict=True))
               for j in range(b.numel()) if b.view(-1)[j] != a.view(-1)[j]]
    assert changed == [(0, 0)]
    old, new = before[0].view(-1)[0].item(), after[0].view(-1)[0].item()
    assert new > old and new == torch.nextafter(torch.tensor(old), torch.tensor(math.inf)).item()


def test_order_needs_a_cap_that_changes_the_buckets() -> None:
    model = get_workload("glyphs").build_model(0)  # 4 MB: DDP's default splits it at 1 MB
    assert layouts_differ(model, 25.0)
    assert not layouts_differ(torch.nn.Linear(8, 8), 25.0)  # one bucket either way


def test_summary_counts_seeds_beyond_tolerance() -> None:
    rows = [{"delta": d} for d in (0.0, -0.057, 0.01, 0.03)]
    s = summarise(rows, 0.02)
    assert s["worst_abs"] == pytest.approx(0.057) and s["seeds_beyond_tolerance"] == 2
    assert s["mean_abs"] == pytest.approx(0.02425)
