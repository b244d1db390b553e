"""`ValidateConfig` checks, endpoint parsing, tolerance and PowerSGD defaults (no processes)."""

from __future__ import annotations

import pytest

from nfabric_cli.errors import InputError
from nfabric_cli.validation.config import (
    ValidateConfig,
    parse_endpoint,
    parse_list,
    resolve_tolerance,
)


def cfg(**kw) -> ValidateConfig:
    return ValidateConfig(**{"source": "p.parquet", "workload": "vision", "steps": 10, **kw})


def test_arms_run_fp32_first_then_ours_then_baselines():
    c = cfg(arms=["profile", "static"], baselines=["powersgd", "fp16"])
    assert c.all_arms() == ["fp32", "static", "profile", "fp16", "powersgd"]
    # fp32 is the reference: it runs even when not asked for
    assert cfg(arms=["profile"]).all_arms() == ["fp32", "profile"]


@pytest.mark.parametrize(
    ("kw", "fragment"),
    [
        ({"world_size": 0}, "--world-size must be >= 1"),
        ({"seed": -1}, "--seed must be in [0, 2**63 - 1], got -1"),
        ({"seed": 2**63}, "--seed must be in [0, 2**63 - 1], got 9223372036854775808"),
        ({"arms": []}, "--arms names no arm (choose from fp32, static, profile)"),
        ({"launcher": "torchrun", "world_size": 2, "nproc_per_node": 3},
         "--world-size 2 is not --nnodes 1 x --nproc-per-node 3: give one or the other"),
        ({"steps": 0}, "--steps must be >= 1"),
        ({"arms": ["fp32", "dynamic"]}, "unknown arm 'dynamic'"),
        ({"baselines": ["fp8"]}, "unknown baseline 'fp8'"),
        ({"launcher": "mpirun"}, "unknown launcher"),
        ({"inject": ["boom@3"]}, "bad injection"),
        ({"inject": ["kill@3:2"]}, "names rank 2, but world size is 2"),
        ({"tolerance": -0.1}, "--tolerance"),
        ({"timeout_s": 0}, "--timeout"),
        ({"link_mbit": 0.0}, "--link-mbit"),
        ({"gate": "timed"}, "--gate: model or measure"),
        ({"nnodes": 2}, "need --launcher torchrun"),
        ({"launcher": "torchrun", "nnodes": 2}, "needs --rdzv-endpoint"),
        (
            {"launcher": "torchrun", "world_size": 3, "nnodes": 2, "rdzv_endpoint": "h:1"},
            "multiple",
        ),
        ({"launcher": "torchrun", "rdzv_endpoint": "nohost"}, "bad --rdzv-endpoint"),
        (
            {"launcher": "torchrun", "nnodes": 2, "node_rank": 2, "rdzv_endpoint": "h:1"},
            "--node-rank",
        ),
        (
            {"launcher": "torchrun", "nnodes": 2, "rdzv_endpoint": "h:1", "link_mbit": 10.0},
            "needs --nnodes 1",
        ),
    ],
)
def test_bad_config_is_one_input_error(kw, fragment):
    with pytest.raises(InputError) as err:
        cfg(**kw).check()
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_torchrun_world_size_from_nodes():
    c = cfg(launcher="torchrun", world_size=4, nnodes=2, rdzv_endpoint="10.0.0.1:29400").check()
    assert c.nproc_per_node == 2
    c = cfg(launcher="torchrun", nproc_per_node=3, nnodes=2, rdzv_endpoint="[::1]:29400").check()
    assert c.world_size == 6
    c = cfg(launcher="torchrun", world_size=6, nproc_per_node=3, nnodes=2,
            rdzv_endpoint="[::1]:29400").check()
    assert c.nproc_per_node == 3
    assert cfg().check().world_size == 2


@pytest.mark.parametrize(
    ("text", "expected"),
    [("127.0.0.1:29400", ("127.0.0.1", 29400)), ("node-0.cluster:1", ("node-0.cluster", 1)),
     ("[fe80::1]:65535", ("fe80::1", 65535))],
)  # fmt: skip
def test_parse_endpoint(text, expected):
    assert parse_endpoint(text) == expected


@pytest.mark.parametrize(
    "text", ["host", ":29400", "host:", "host:0", "host:65536", "a b:1", "h:p"]
)
def test_malformed_endpoint(text):
    with pytest.raises(InputError, match="bad --rdzv-endpoint"):
        parse_endpoint(text)


def test_parse_list():
    assert parse_list(" fp32, Static ,", "--arms") == ["fp32", "static"]
    assert parse_list("", "--arms") == []
    with pytest.raises(InputError, match="names 'fp16' twice"):
        parse_list("fp16,fp16", "--baselines")


def test_tolerance_precedence():
    assert resolve_tolerance(0.2, {"tolerance": 0.03}, True) == 0.2
    assert resolve_tolerance(None, {"tolerance": 0.03}, True) == 0.03
    assert resolve_tolerance(None, None, True) == 0.01  # accuracy-like: one point
    assert resolve_tolerance(None, {"tolerance": None}, False) == 0.05  # loss-like


def test_powersgd_starts_after_ten_percent_and_at_least_two():
    assert cfg(steps=600).powersgd_start_iter() == 60
    assert cfg(steps=5).powersgd_start_iter() == 2


def test_config_round_trips(tmp_path):
    c = cfg(baselines=["fp16"], inject=["nan@2"], link_mbit=20.0)
    assert ValidateConfig.load(c.save(tmp_path / "c.json")) == c
