"""compile_profile: every trainable parameter gets exactly one route per phase, or it fails
naming what is wrong; traffic and verdicts are modelled per DDP bucket."""

from __future__ import annotations

import pytest

from nfabric_cli.binding import compile_profile, model_fingerprint, static_profile
from nfabric_cli.binding.compile import NO_SUBSTRATE_REASON, compile_for_workload
from nfabric_cli.errors import InputError
from nfabric_cli.profile import OperatingProfile, ProfileRow, parse_phases
from nfabric_cli.routes import make_route
from nfabric_cli.routes.groups import spec_numels
from nfabric_cli.routes.spec import RouteSpec
from tests.binding import models


def rules(*pairs: tuple[str, str], phases: str | None = None, **meta) -> OperatingProfile:
    """A profile with `pairs` (selector, route) in priority order in every phase."""
    rows = [
        ProfileRow(sel, ph.name, ph.start, ph.end, prio, route)
        for ph in parse_phases(phases)
        for prio, (sel, route) in enumerate(pairs)
    ]
    return OperatingProfile(rows, meta)


def routes_of(bindings, phase: str = "all") -> dict[str, str]:
    return {n: b.routes[phase].name for n, b in bindings.params.items()}


def test_first_match_wins_in_priority_order():
    model = models.mlp()
    b = compile_profile(
        rules(("3.weight", "fp32"), ("3.*", "int8"), ("*.bias", "bf16"), ("*", "sign")), model
    )
    assert routes_of(b) == {
        "0.weight": "sign",
        "0.bias": "bf16",
        "1.weight": "sign",
        "1.bias": "bf16",
        "3.weight": "fp32",
        "3.bias": "int8",
    }
    assert b.params["3.bias"].regions["all"] == "3.*"
    # The same rules in another order: the general rule shadows the specific one.
    b2 = compile_profile(rules(("*.bias", "bf16"), ("3.*", "int8"), ("*", "sign")), model)
    assert routes_of(b2)["3.bias"] == "bf16" and routes_of(b2)["3.weight"] == "int8"


def test_tied_weights_bound_once_under_first_name():
    model = models.tied()
    b = compile_profile(rules(("head.*", "fp32"), ("*", "sign")), model)
    assert list(b.params) == ["embed.weight", "body.weight", "body.bias"]
    tied = b.params["embed.weight"]
    assert tied.aliases == ("embed.weight", "head.weight")
    assert tied.routes["all"].name == "fp32"  # matched through its alias head.weight
    assert b.route_for("head.weight", "all").name == "fp32"
    assert sum(len(bk.params) for bk in b.buckets) == 3
    assert b.buckets[0].numel == 50 * 16 + 16 * 16 + 16


def test_frozen_parameters_get_no_route_and_cannot_be_selected():
    model = models.frozen()
    b = compile_profile(rules(("*", "sign")), model)
    assert list(b.params) == ["head.weight", "head.bias"]
    with pytest.raises(InputError, match="no binding for parameter 'backbone.weight'"):
        b.route_for("backbone.weight", "all")
    with pytest.raises(InputError, match=r"selector 'backbone\.\*' \(all\) matches no trainable"):
        compile_profile(rules(("backbone.*", "fp32"), ("*", "sign")), model)


def test_unused_branch_is_still_routed_and_bucketed():
    b = compile_profile(
        rules(("spare.*", "fp32"), ("*", "ternary")), models.unused(), find_unused_parameters=True
    )
    assert routes_of(b)["spare.weight"] == "fp32" and routes_of(b)["used.weight"] == "ternary"
    assert {n for bk in b.buckets for n in bk.params} == set(b.params)


def test_nested_globs_and_module_types_with_subclasses():
    model = models.nested()
    b = compile_profile(
        rules(
            ("type:LayerNorm", "fp32"),
            ("blocks.*.mlp.*", "int4"),
            ("blocks.1.*", "bf16"),
            ("*", "sign"),
        ),
        model,
    )
    r = routes_of(b)
    assert r["blocks.0.norm.weight"] == r["blocks.1.norm.bias"] == "fp32"  # MyNorm(LayerNorm)
    assert r["blocks.0.mlp.0.weight"] == r["blocks.1.mlp.2.bias"] == "int4"
    assert r["blocks.1.attn.weight"] == "bf16" and r["blocks.0.attn.weight"] == "sign"
    assert r["head.weight"] == "sign"
    assert (
        compile_profile(rules(("type:*Norm", "fp32"), ("*", "sign")), model)
        .params["blocks.0.norm.weight"]
        .routes["all"]
        .name
        == "fp32"
    )


def test_unrouted_parameters_are_named_with_count():
    with pytest.raises(InputError) as err:
        compile_profile(rules(("0.*", "fp32")), models.mlp())
    msg = str(err.value)
    assert "4 parameter(s) left unrouted in phase 'all'" in msg
    assert "1.weight, 1.bias, 3.weight, 3.bias" in msg


def test_dead_selectors_are_all_named():
    with pytest.raises(
        InputError, match=r"selector 'nope\.\*' \(all\), 'type:Conv2d' \(all\) matches"
    ):
        compile_profile(
            rules(("nope.*", "fp32"), ("type:Conv2d", "int8"), ("*", "sign")), models.mlp()
        )


def test_fingerprint_mismatch_names_both_models():
    prof = rules(("*", "sign"), model_fingerprint=model_fingerprint(models.tied()), workload="tied")
    assert compile_profile(prof, models.tied()).fingerprint == model_fingerprint(models.tied())
    with pytest.raises(InputError) as err:
        compile_profile(prof, models.mlp())
    msg = str(err.value)
    assert "profile was made for another model (tied, fingerprint" in msg
    assert model_fingerprint(models.mlp()) in msg and "6 trainable parameters" in msg


def test_fingerprint_depends_on_names_shapes_dtypes_only():
    a, b = models.mlp(), models.mlp()
    b[0].weight.data.normal_()
    assert model_fingerprint(a) == model_fingerprint(b)
    assert model_fingerprint(a.double()) != model_fingerprint(b)
    assert len(model_fingerprint(a)) == 16


def test_phases_route_separately_and_phase_at():
    rows = [
        ProfileRow("*", "warmup", 0.0, 0.1, 0, "fp32"),
        ProfileRow("3.*", "main", 0.1, 0.8, 0, "fp32"),
        ProfileRow("*", "main", 0.1, 0.8, 1, "sign"),
        ProfileRow("*", "final", 0.8, 1.0, 0, "bf16"),
    ]
    b = compile_profile(OperatingProfile(rows, {}), models.mlp(), total_steps=100)
    assert [p.name for p in b.phases] == ["warmup", "main", "final"]
    assert b.route_for("0.weight", "warmup").name == "fp32"
    assert b.route_for("0.weight", "main").name == "sign"
    assert b.route_for("3.weight", "main").name == "fp32"
    assert b.route_for("0.weight", "final").name == "bf16"
    assert [b.phase_at(s).name for s in (0, 9, 10, 79, 80, 99, 100)] == [
        "warmup",
        "warmup",
        "main",
        "main",
        "final",
        "final",
        "final",
    ]
    assert b.phase_at(5, total_steps=10).name == "main"
    assert b.traffic_fraction("warmup") == 1.0


def test_modelled_bytes_group_routes_per_bucket():
    model = (
        models.mlp()
    )  # one bucket: 3.bias 10, 3.weight 400, 1.bias 40, 1.weight 40, 0.bias 40, 0.weight 1200
    b = compile_profile(rules(("3.*", "fp32"), ("*", "sign")), model, world_size=4)
    (bucket,) = b.buckets
    assert bucket.params == ["3.bias", "3.weight", "1.bias", "1.weight", "0.bias", "0.weight"]
    # fp32 all-reduce of 410 elements on 4 ranks (ring): 2*(W-1)/W*n bytes each way.
    fp32 = 2 * (2 * 3 * 410 * 4 // 4)
    sign = make_route(RouteSpec("sign")).wire_bytes(1320, 4, segments=(40, 40, 40, 1200)).total
    assert bucket.wire_bytes["all"] == fp32 + sign
    assert bucket.fp32_bytes == 2 * (2 * 3 * 1730 * 4 // 4)
    assert b.bytes_per_step("all") == (fp32 + sign, bucket.fp32_bytes)
    assert b.traffic_fraction("all") == pytest.approx((fp32 + sign) / bucket.fp32_bytes)
    # All-fp32 is exactly 1; one rank moves nothing, so its fraction is modelled at two.
    assert compile_profile(rules(("*", "fp32")), model).traffic_fraction("all") == 1.0
    one = compile_profile(rules(("*", "sign")), model, world_size=1)
    assert one.bytes_per_step("all") == (0, 0)
    assert one.traffic_fraction("all") == compile_profile(
        rules(("*", "sign")), model, world_size=2
    ).traffic_fraction("all")


def test_bucket_groups_are_the_hooks_reduces_and_price_bytes_and_verdicts():
    # One bucket: 3.bias 10, 3.weight 400, 1.bias 40, 1.weight 40, 0.bias 40, 0.weight 1200.
    # One group per route across regions; sign is reduced where it lies: one reduce per run
    # of consecutive parameters (0.bias on bf16 splits it), each region's agreement apart.
    model = models.mlp()
    prof = rules(("3.*", "bf16"), ("1.*", "sign"), ("*.bias", "bf16"), ("*", "sign"))
    b = compile_profile(prof, model, world_size=4)
    groups = b.bucket_groups(0, "all")
    assert [(g.spec.name, g.index, g.segments, g.regions) for g in groups] == [
        ("bf16", (0, 1, 4), (10, 400, 40), ("3.*", "3.*", "*.bias")),
        ("sign", (2, 3, 5), (40, 40, 1200), ("1.*", "1.*", "*")),
    ]
    assert groups[1].reduces() == [(0, 1), (2,)]
    sign = make_route(RouteSpec("sign"))
    two = sign.wire_bytes(80, 4, segments=(40, 40)).total + sign.wire_bytes(1200, 4).total
    assert two > sign.wire_bytes(1280, 4, segments=(40, 40, 1200)).total  # padded twice
    bf16 = make_route(RouteSpec("bf16")).wire_bytes(450, 4).total
    assert b.buckets[0].wire_bytes["all"] == bf16 + two
    # Two sign regions side by side are one reduce, padded once.
    joined = compile_profile(rules(("3.*", "bf16"), ("1.*", "sign"), ("*", "sign")), model,
                             world_size=4)
    (_, signs) = joined.bucket_groups(0, "all")
    assert (signs.regions, signs.reduces()) == (("1.*", "1.*", "*", "*"), [(0, 1, 2, 3)])
    assert joined.buckets[0].wire_bytes["all"] == (
        make_route(RouteSpec("bf16")).wire_bytes(410, 4).total
        + sign.wire_bytes(1320, 4, segments=(40, 40, 40, 1200)).total)
    # The verdict prices the same three reduces: on 20 Mbit/s with 2 ms fixed per sign reduce,
    # one sign reduce of 1280 elements would pay (2.39 ms vs fp32 4.21 ms), two do not (4.01).
    from nfabric_cli.substrate.cost import bucket_verdict
    from nfabric_cli.substrate.model import Substrate

    sub = {"link_gbps": 0.02, "latency_us": 10.0, "codec_call_us": {"sign": 2000.0, "bf16": 0.0}}
    b = compile_profile(prof, model, world_size=4, substrate=sub)
    pairs = [(RouteSpec("bf16"), 450), (RouteSpec("sign"), 80), (RouteSpec("sign"), 1200)]
    assert spec_numels(b.bucket_groups(0, "all")) == pairs
    merged = {RouteSpec("bf16"): 450, RouteSpec("sign"): 1280}
    v = bucket_verdict(Substrate.from_dict(sub), pairs, 4)
    assert (b.buckets[0].verdicts["all"], b.buckets[0].reasons["all"]) == (v.verdict, v.reason)
    assert v.verdict == "fallback"
    assert bucket_verdict(Substrate.from_dict(sub), merged, 4).verdict == "admit"


def test_verdicts_without_and_with_substrate():
    model = models.split()
    b = compile_profile(rules(("*", "sign")), model, bucket_cap_mb=0.25)
    assert [bk.verdicts["all"] for bk in b.buckets] == ["admit"] * 3
    assert {bk.reasons["all"] for bk in b.buckets} == {NO_SUBSTRATE_REASON}
    slow = {"link_gbps": 0.1, "latency_us": 1.0, "include_codec": False}
    b = compile_profile(
        rules(("*", "sign")), model, world_size=8, bucket_cap_mb=0.25, substrate=slow
    )
    assert b.buckets[1].verdicts["all"] == "admit"  # 600k elements over a 0.1 Gbit/s link
    fast = {"link_gbps": 400.0, "latency_us": 50.0}
    b = compile_profile(
        rules(("*", "sign")), model, world_size=8, bucket_cap_mb=0.25, substrate=fast
    )
    assert b.buckets[2].verdicts["all"] == "fallback"  # 900 elements: latency-bound
    # The profile's own substrate is used when none is passed.
    prof = rules(("*", "sign"), substrate=slow)
    assert (
        compile_profile(prof, model, world_size=8, bucket_cap_mb=0.25).buckets[1].verdicts["all"]
        == "admit"
    )


def test_a_passed_substrate_is_what_the_runtime_gate_prices():
    """compile_profile(substrate=X) stores X in the bindings, so the hook's gate (which reads the
    bindings' metadata) takes the verdicts compile-profile printed, not the profile's own."""
    from nfabric_cli.routes.groups import spec_numels
    from nfabric_cli.runtime.gate import CapacityGate

    model = models.split()
    slow = {"link_gbps": 0.1, "latency_us": 1.0, "include_codec": False}
    fast = {"link_gbps": 400.0, "latency_us": 50.0}
    b = compile_profile(rules(("*", "sign"), substrate=slow), model, world_size=8,
                        bucket_cap_mb=0.25, substrate=fast)
    assert b.meta["substrate"]["link_gbps"] == 400.0
    gate = CapacityGate(b.meta["substrate"], 8)
    for i, bucket in enumerate(b.buckets):
        groups = spec_numels(b.bucket_groups(i, "all"))
        verdict = gate.verdict((tuple(bucket.params), "all"), groups)
        assert ("admit" if verdict.admit else "fallback") == bucket.verdicts["all"]
    assert b.buckets[2].verdicts["all"] == "fallback"


def test_bad_world_size_and_steps():
    with pytest.raises(InputError, match="world size must be a positive integer"):
        compile_profile(rules(("*", "sign")), models.mlp(), world_size=0)

    class Unread:  # a workload whose data must not be read for a world size of 0
        def train_batch(self, *args: object) -> None:
            raise AssertionError("read data for an impossible world size")

    with pytest.raises(InputError, match="world size must be a positive integer, got -1"):
        compile_for_workload(rules(("*", "sign")), models.mlp(), Unread(), world_size=-1)
    for bad in (0, -5, 2.5, "10", True):
        with pytest.raises(InputError, match=f"total steps must be a whole number >= 1, got {bad!r}"):
            compile_profile(rules(("*", "sign")), models.mlp(), total_steps=bad)
    b = compile_profile(rules(("*", "sign")), models.mlp())
    assert b.world_size == 2
    with pytest.raises(InputError, match="total steps unknown"):
        b.phase_at(3)


def test_static_profile_rules_options_and_validation():
    model = models.mlp()
    prof = static_profile(
        model,
        "ternary",
        [("3.*", "fp32"), ("type:LayerNorm", "bf16")],
        parse_phases("0.5"),
        workload="mlp",
        tau=0.3,
        error_feedback=True,
        reducer="central",
    )
    assert [(r.phase, r.priority, r.region, r.route) for r in prof.sorted_rows()] == [
        ("warmup", 0, "3.*", "fp32"),
        ("warmup", 1, "type:LayerNorm", "bf16"),
        ("warmup", 2, "*", "ternary"),
        ("main", 0, "3.*", "fp32"),
        ("main", 1, "type:LayerNorm", "bf16"),
        ("main", 2, "*", "ternary"),
    ]
    fp32, bf16, tern = prof.rules("main")
    assert (fp32.tau, fp32.error_feedback, fp32.reducer) == (None, False, "sharded")
    assert (bf16.tau, bf16.error_feedback, bf16.reducer) == (None, True, "central")
    assert tern.spec() == RouteSpec("ternary", tau=0.3, error_feedback=True, reducer="central")
    assert prof.meta["workload"] == "mlp"
    assert prof.meta["model_fingerprint"] == model_fingerprint(model)
    assert prof.meta["provenance"]["rules"] == ["3.*=fp32", "type:LayerNorm=bf16", "*=ternary"]
    with pytest.raises(InputError, match="matches no trainable parameter"):
        static_profile(model, "sign", [("head.*", "fp32")])
    with pytest.raises(InputError, match="duplicates the default rule"):
        static_profile(model, "sign", [("*", "fp32")])
    with pytest.raises(InputError, match="unknown route 'fp8'"):
        static_profile(model, "fp8")
