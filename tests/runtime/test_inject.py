"""Fault injection specs: parsing, errors, and what nan/spike/kill do to which rank and step."""

from __future__ import annotations

import math

import pytest
import torch

from nfabric_cli.errors import InputError
from nfabric_cli.runtime.inject import (
    Injection,
    apply_injection,
    check_ranks,
    parse_injections,
    should_kill,
)


def test_parse_valid_specs():
    assert parse_injections(["nan@5", "spike@3:1", " KILL@0:0 "]) == [
        Injection("nan", 5, None),
        Injection("spike", 3, 1),
        Injection("kill", 0, 0),
    ]
    assert parse_injections([]) == []
    assert str(Injection("spike", 3, 1)) == "spike@3:1" and str(Injection("nan", 2)) == "nan@2"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("boom@3", "bad injection 'boom@3': unknown kind 'boom' (nan, spike or kill)"),
        ("nan@-1", "bad injection 'nan@-1': step must be >= 0"),
        ("nan@3:x", "bad injection 'nan@3:x': rank must be an integer >= 0"),
        ("nan@3:-1", "bad injection 'nan@3:-1': rank must be an integer >= 0"),
        ("nan@3:", "bad injection 'nan@3:': rank must be an integer >= 0"),
        ("nan", "bad injection 'nan': expected KIND@STEP[:RANK] with KIND nan, spike or kill"),
        ("nan@", "bad injection 'nan@': expected KIND@STEP[:RANK]"),
        ("@3", "bad injection '@3': expected KIND@STEP[:RANK]"),
        ("nan@1.5", "bad injection 'nan@1.5': expected KIND@STEP[:RANK]"),
    ],
)
def test_parse_errors_are_one_line(spec, message):
    with pytest.raises(InputError) as info:
        parse_injections(["nan@1", spec])
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_injection_record_validates_itself():
    with pytest.raises(InputError, match="unknown injection kind 'oops'"):
        Injection("oops", 1)
    with pytest.raises(InputError, match="rank must be >= 0"):
        Injection("nan", 1, -2)


def test_check_ranks_against_world_size():
    check_ranks(parse_injections(["nan@1:1", "kill@2"]), world_size=2)
    with pytest.raises(InputError, match="injection nan@1:2 names rank 2, but world size is 2"):
        check_ranks(parse_injections(["nan@1:2"]), world_size=2)


def test_nan_fills_whole_gradients_only_on_the_named_rank_and_step():
    injections = parse_injections(["nan@5:1"])
    for step, rank in [(4, 1), (5, 0), (6, 1)]:
        grads = [torch.ones(3), torch.full((2, 2), 2.0)]
        apply_injection(injections, step, rank, grads)
        assert torch.equal(grads[0], torch.ones(3))
        assert torch.equal(grads[1], torch.full((2, 2), 2.0))
    grads = [torch.ones(3), None, torch.full((2, 2), 2.0)]
    apply_injection(injections, 5, 1, grads)
    assert torch.isnan(grads[0]).all() and torch.isnan(grads[2]).all() and grads[1] is None


def test_spike_multiplies_by_1e3_on_every_rank_without_rank():
    injections = parse_injections(["spike@2", "kill@2"])
    for rank in (0, 3):
        g = torch.tensor([0.5, -2.0, 0.0])
        apply_injection(injections, 2, rank, [g])
        assert g.tolist() == [500.0, -2000.0, 0.0]
    g = torch.tensor([0.5])
    apply_injection(parse_injections(["spike@2", "spike@2"]), 2, 0, [g])
    assert g.item() == 500000.0
    g = torch.tensor([1.0])
    apply_injection(parse_injections(["nan@2", "spike@2"]), 2, 0, [g])
    assert math.isnan(g.item())


def test_should_kill_matches_step_and_rank():
    injections = parse_injections(["kill@7:1", "nan@3"])
    assert should_kill(injections, 7, 1)
    assert not should_kill(injections, 7, 0)
    assert not should_kill(injections, 6, 1)
    assert not should_kill(injections, 3, 0)  # nan is not a kill
    everyone = parse_injections(["kill@0"])
    assert should_kill(everyone, 0, 0) and should_kill(everyone, 0, 5)
