"""bench.noise_floor: its perturbations are invisible changes, and the summary is right."""

from __future__ import annotations

import math

import pytest
import torch

from bench.noise_floor import layouts_differ, nudge_one_ulp, nudged_builds, summarise
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
    again = [p.detach().clone() for p in model.parameters()]
    nudge_one_ulp(model, index=2)  # another element: another run one ulp apart
    assert [j for j in range(again[0].numel()) if again[0].view(-1)[j] != model[0].weight.view(-1)[j]] == [2]


def test_order_needs_a_cap_that_changes_the_buckets() -> None:
    model = get_workload("glyphs").build_model(0)  # 4 MB: DDP's default splits it at 1 MB
    assert layouts_differ(model, 25.0)
    assert not layouts_differ(torch.nn.Linear(8, 8), 25.0)  # one bucket either way


def test_summary_counts_seeds_beyond_tolerance() -> None:
    rows = [{"delta": d} for d in (0.0, -0.057, 0.01, 0.03)]
    s = summarise(rows, 0.02)
    assert s["worst_abs"] == pytest.approx(0.057) and s["seeds_beyond_tolerance"] == 2
    assert s["mean_abs"] == pytest.approx(0.02425)


def test_nudged_builds_perturb_inside_the_block_only() -> None:
    w = get_workload("vision")
    plain = w.build_model(2)
    with nudged_builds(w):
        nudged = w.build_model(2)
    again = w.build_model(2)
    diffs = [int((a != b).sum()) for a, b in zip(plain.parameters(), nudged.parameters(), strict=True)]
    assert sum(diffs) == 1 and diffs[0] == 1
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), again.parameters(), strict=True))


def test_robustness_counts_a_worse_pair_beyond_its_cells_noise_only() -> None:
    from bench.robustness import NOISE, STATIC_NOISE, judge, noise_arms

    def cell(noise_metric: float) -> dict:
        metrics = {"fp32": 0.9778, "static": 0.9861, "profile": 0.9806,  # profile 0.56 worse
                   "static+spike": 0.98, "profile+spike": 0.98,
                   "static+nan": 0.98, "profile+nan": 0.98, NOISE: noise_metric}
        return {"higher_is_better": True, "tolerance": 0.02,
                "arms": {a: {"metric": m} for a, m in metrics.items()}}

    within = judge(cell(0.9861))  # fp32 one ulp apart moved 0.83 points: the gap is noise
    assert within["worse"] == ["profile"] and within["worse_beyond_noise"] == []
    beyond = judge(cell(0.9806))  # noise 0.28 points: the 0.56-point gap is beyond it
    assert beyond["worse_beyond_noise"] == ["profile"]
    no_noise = judge({**cell(0.0), "arms": {k: v for k, v in cell(0.0)["arms"].items() if k != NOISE}})
    assert no_noise["worse"] == ["profile"] and no_noise["worse_beyond_noise"] == []
    # several one-ulp runs (--noise 3): the farthest from fp32 is the noise
    many = cell(0.9806)
    many["arms"].update({a: {"metric": m} for a, m in zip(noise_arms(3)[1:], (0.9861, 0.9778),
                                                           strict=True)})
    assert noise_arms(3) == [NOISE, NOISE + "1", NOISE + "2"]
    verdict = judge(many)
    assert verdict["noise"] == pytest.approx(0.9861 - 0.9778)
    assert verdict["worse"] == ["profile"] and verdict["worse_beyond_noise"] == []
    # static from the nudged weights: the pair's own null, judged apart from fp32's
    assert verdict["static_noise"] is None and verdict["worse_beyond_static_noise"] == []
    own = cell(0.9861)  # within fp32's noise ...
    own["arms"].update({STATIC_NOISE: {"metric": 0.9833}, STATIC_NOISE + "1": {"metric": 0.9889}})
    assert noise_arms(2, STATIC_NOISE) == [STATIC_NOISE, STATIC_NOISE + "1"]
    verdict = judge(own)  # ... but static moves only 0.28 points from one ulp
    assert verdict["static_noise"] == pytest.approx(0.0028, abs=1e-9)
    assert verdict["worse_beyond_noise"] == [] and verdict["worse_beyond_static_noise"] == ["profile"]


def test_robustness_tells_a_fault_the_monitor_absorbed_from_one_it_let_through() -> None:
    from bench.robustness import judge, summary

    def cell(profile_spike: float) -> dict:
        metrics = {"fp32": 0.9722, "static": 0.9667, "profile": 0.9667,
                   "static+spike": 0.9750,  # the fault moved the unmonitored run up 0.83
                   "profile+spike": profile_spike}
        return {"workload": "transformer", "higher_is_better": True, "tolerance": 0.02,
                "steps": 1200, "arms": {a: {"metric": m, "false_trip_steps": 0}
                                        for a, m in metrics.items()}}

    level = judge(cell(0.9694))  # 0.56 under static+spike, 0.28 over its own clean end
    assert level["worse"] == ["profile+spike"] and level["absorbed"] == ["profile+spike"]
    edge = judge(cell(0.9667 - 0.004))  # 0.4 points under the clean profile: still level
    assert edge["absorbed"] == ["profile+spike"]
    hurt = judge(cell(0.9667 - 0.0056))  # 0.56 under its own clean end: the fault got through
    assert hurt["worse"] == ["profile+spike"] and hurt["absorbed"] == []
    better_than_static = judge(cell(0.9778))  # not worse: nothing to absorb
    assert better_than_static["worse"] == [] and better_than_static["absorbed"] == []
    clean_worse = cell(0.9750)
    clean_worse["arms"]["static"]["metric"] = 0.9778  # the clean pair is worse: never absorbed
    assert judge(clean_worse)["worse"] == ["profile"] and judge(clean_worse)["absorbed"] == []
    total = summary([cell(0.9694), cell(0.9611), cell(0.9778)])
    assert (total["worse"], total["worse_absorbed"]) == (2, 1)
    # lower is better (lm, nats; margin 0.01): 0.02 over static+spike, 0.005 over its clean end
    lm = {"workload": "lm", "higher_is_better": False, "tolerance": 0.05, "steps": 600,
          "arms": {a: {"metric": m} for a, m in {"fp32": 1.70, "static": 1.73, "profile": 1.73,
                                                   "static+spike": 1.715,
                                                   "profile+spike": 1.735}.items()}}
    assert judge(lm)["worse"] == ["profile+spike"] and judge(lm)["absorbed"] == ["profile+spike"]
    lm["arms"]["profile+spike"]["metric"] = 1.745  # 0.015 nats over its clean end: let through
    assert judge(lm)["worse"] == ["profile+spike"] and judge(lm)["absorbed"] == []


def test_robustness_judges_clean_only_cells_and_the_tolerance_of_fp32() -> None:
    from bench.robustness import judge, max_blowup, summary

    def cell(profile: float, faults: bool) -> dict:
        metrics = {"fp32": 0.98, "static": 0.97, "profile": profile}
        if faults:
            metrics.update({"static+spike": 0.2, "profile+spike": 0.975,
                            "static+nan": 0.97, "profile+nan": 0.97})
        return {"higher_is_better": True, "tolerance": 0.02, "steps": 100,
                "arms": {a: {"metric": m, "false_trip_steps": 0} for a, m in metrics.items()}}

    clean = judge(cell(0.961, faults=False))  # 1.9 points under fp32: within 2
    assert clean["pairs"] == 1 and clean["within"] and clean["rescued"] == []
    outside = judge(cell(0.959, faults=False))
    assert not outside["within"] and outside["worse"] == ["profile"]  # 1.1 points under static
    full = judge(cell(0.97, faults=True))
    assert full["pairs"] == 3 and full["rescued"] == ["spike"] and full["not_rescued"] == []
    cells = [cell(0.961, faults=False), cell(0.959, faults=False), cell(0.97, faults=True)]
    for c in cells:
        c["workload"] = "vision"
    cells[0]["arms"]["fp32"]["max_blowup"] = max_blowup(
        [(3, "*", "grad-norm blow-up 12.5x median"), (4, "all", "loss spike 3.1x median"),
         (9, "head.*", "grad-norm blow-up 31.0x median")])
    cells[2]["arms"]["profile+spike"]["max_blowup"] = 900.0  # injected: not counted
    total = summary(cells)
    assert (total["pairs"], total["faults"], total["within_tolerance"]) == (5, 2, 2)
    assert total["max_blowup_without_fault"] == 31.0
    assert max_blowup([(1, "all", "loss spike 3.1x median")]) is None
    assert abs(total["worst_vs_fp32"]["vision"] - (0.959 - 0.98)) < 1e-12
