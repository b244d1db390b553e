"""Error feedback: per-parameter residuals, kept per group as one flat tensor, reset on a route
change; the group calls give the per-parameter values bit for bit."""

from __future__ import annotations

import pytest
import torch

from nfabric_cli.routes import ErrorFeedback, make_route
from nfabric_cli.routes.spec import RouteSpec

NUMELS = {"a": 300, "b": 7, "c": 1024}
SIGN = make_route(RouteSpec("sign", error_feedback=True))


def _grads(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(k, generator=gen) for n, k in NUMELS.items()}


def _per_param(ef: ErrorFeedback, names: list[str], label: str, grads: dict) -> torch.Tensor:
    parts = [ef.compensate(n, label, grads[n]) for n in names]
    flat = torch.cat(parts)
    sent = SIGN.roundtrip(flat, tuple(p.numel() for p in parts))
    off = 0
    for n, p in zip(names, parts, strict=True):
        ef.update(n, p, sent[off : off + p.numel()])
        off += p.numel()
    return flat


def _flat(ef: ErrorFeedback, names: list[str], label: str, grads: dict) -> torch.Tensor:
    flat = ef.compensate_flat(names, label, [grads[n] for n in names])
    segs = tuple(NUMELS[n] for n in names)
    ef.update_flat(names, flat, SIGN.roundtrip(flat, segs), segs)
    return flat


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_calls_equal_per_parameter_calls_across_regrouping_and_route_changes(
        dtype: torch.dtype) -> None:
    """Steps 0-2 one group; step 3 the group splits (b leaves); step 4 'a' changes route
    (its residual restarts); step 5 the group re-forms. Same compensated values every step,
    for bf16 gradients too (their float32 residual is added in float32 on both paths: the
    group path once added it into a bf16 copy and rounded most of it away)."""
    schedule = [
        [(["a", "b", "c"], "sign")]] * 3 + [
        [(["a", "c"], "sign"), (["b"], "sign")],
        [(["a"], "int8"), (["b", "c"], "sign")],
        [(["a", "b", "c"], "sign")],
    ]  # fmt: skip
    one, many = ErrorFeedback(), ErrorFeedback()
    for step, groups in enumerate(schedule):
        grads = {n: g.to(dtype) for n, g in _grads(step).items()}
        for names, label in groups:
            assert torch.equal(_per_param(one, names, label, grads),
                               _flat(many, names, label, grads)), (step, names)
        for n in NUMELS:
            assert torch.equal(one.residual(n), many.residual(n)), (step, n)


def test_residual_is_what_the_roundtrip_lost_and_a_route_change_drops_it() -> None:
    ef = ErrorFeedback()
    grads = _grads(0)
    flat = _flat(ef, ["a", "c"], "sign", grads)
    assert torch.equal(flat, torch.cat([grads["a"], grads["c"]]))  # nothing to add yet
    lost = flat - SIGN.roundtrip(flat, (300, 1024))
    assert torch.equal(ef.residual("a"), lost[:300]) and torch.equal(ef.residual("c"), lost[300:])
    again = ef.compensate_flat(["a", "c"], "sign", [grads["a"], grads["c"]])
    assert torch.equal(again, flat + lost)
    assert torch.equal(ef.compensate_flat(["a"], "int8", [grads["a"]]), grads["a"])  # reset
    assert ef.residual("a") is None and torch.equal(ef.residual("c"), lost[300:])
    ef.reset()
    assert len(ef) == 0


def test_a_bf16_gradient_keeps_its_whole_residual_on_the_group_path() -> None:
    """256 in bf16 plus a residual of 0.75: 256.75 in float32 (bf16 would round it to 256)."""
    ef = ErrorFeedback()
    g = torch.full((4,), 256.0, dtype=torch.bfloat16)
    first = ef.compensate_flat(["a"], "sign", [g])
    ef.update_flat(["a"], first, first.float() - 0.75, (4,))  # the roundtrip lost 0.75 each
    out = ef.compensate_flat(["a"], "sign", [g])
    assert out.dtype == torch.float32 and torch.equal(out, torch.full((4,), 256.75))
