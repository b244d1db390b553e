"""`nfabric profile init|show`, `compile-profile`, `diff-profile`: outputs, exit codes, and
every bad input as exit 2 with one line and no traceback."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from nfabric_cli.app import app
from nfabric_cli.binding import model_fingerprint, read_bindings
from nfabric_cli.profile import OperatingProfile, read_profile, write_profile
from nfabric_cli.profile.parquet import write_table
from nfabric_cli.profile.store import profile_table
from tests.binding import models

MLP = "tests.binding.models:mlp"
RULES = ("--set", "3.*=fp32", "--set", "type:LayerNorm=bf16", "--phases", "0.1,0.8")
runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def init(out, *extra, model=MLP, route="sign"):
    """`profile init --model MODEL --route ROUTE *extra --out OUT`."""
    return run("profile", "init", "--model", model, "--route", route, *extra, "--out", out)


def bad_input(result, *fragments: str) -> None:
    """Exit 2, exactly one line on stderr containing every fragment, no traceback."""
    assert result.exit_code == 2, (result.stdout, result.stderr)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.stderr + result.stdout
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture()
def prof(tmp_path):
    out = tmp_path / "mlp.v1.parquet"
    r = init(out, *RULES, "--error-feedback")
    assert r.exit_code == 0, r.stderr
    return out


def test_init_writes_rules_in_order(prof):
    p = read_profile(prof)
    assert [(r.region, r.route, r.error_feedback) for r in p.rules("main")] == [
        ("3.*", "fp32", False),
        ("type:LayerNorm", "bf16", True),
        ("*", "sign", True),
    ]
    assert [ph.name for ph in p.phases()] == ["warmup", "main", "final"]
    assert p.meta["workload"] == MLP
    assert p.meta["model_fingerprint"] == model_fingerprint(models.mlp())


def test_show_json_and_table(prof, tmp_path):
    r = run("profile", "show", tmp_path, "--json")  # a directory: its newest version
    assert r.exit_code == 0
    data = json.loads(r.stdout)
    assert data["path"] == str(prof) and len(data["rows"]) == 9
    assert data["rows"][0] == {
        **{"region": "3.*", "phase": "warmup", "phase_start": 0.0, "phase_end": 0.1},
        **{"priority": 0, "route": "fp32", "tau": None, "chunk": None, "error_feedback": False},
        **{"reducer": "sharded", "traffic_fraction": None, "metric_delta": None, "trials": None},
        **{"rounding": None, "mode": None, "zeros": None},
    }
    human = run("profile", "show", prof)
    assert human.exit_code == 0 and "type:LayerNorm" in human.stdout and MLP in human.stdout


def test_compile_json_and_bindings_file(prof, tmp_path):
    out = tmp_path / "bind.parquet"
    r = run(
        "compile-profile", prof, "--model", MLP, "--world-size", "4", "--total-steps", "100",
        "--out", out, "--json",
    )  # fmt: skip
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["params"] == 6 and data["numel"] == 1730 and data["buckets"] == 1
    main = data["phases"][1]
    assert main["phase"] == "main"
    assert main["routes"] == {
        "bf16+ef": {"params": 2, "numel": 80},
        "fp32": {"params": 2, "numel": 410},
        "sign/sharded+ef": {"params": 2, "numel": 1240},
    }
    b = read_bindings(out)
    assert main["bytes_per_step"] == b.bytes_per_step("main")[0]
    assert main["traffic_fraction"] == pytest.approx(b.traffic_fraction("main"))
    assert 0 < main["traffic_fraction"] < 1
    verdicts = data["bucket_plan"][0]["verdicts"]
    assert verdicts == {"warmup": "admit", "main": "admit", "final": "admit"}
    assert b.total_steps == 100 and b.phase_at(85).name == "final"
    human = run("compile-profile", prof, "--model", MLP)
    assert human.exit_code == 0
    assert "6 parameters (1,730 elements) in 1 DDP bucket(s)" in human.stdout


def test_compile_with_builtin_workload_traces_ready_order(tmp_path):
    out = tmp_path / "v.parquet"
    assert (
        run("profile", "init", "--workload", "vision", "--route", "sign", "--out", out).exit_code
        == 0
    )
    r = run("compile-profile", out, "--workload", "vision", "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["bucket_order"] == "traced"


def test_plugin_from_current_directory(tmp_path, monkeypatch):
    (tmp_path / "cwd_plugin_net.py").write_text(
        "import torch.nn as nn\n"
        "def build():\n"
        "    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))\n"
    )
    monkeypatch.chdir(tmp_path)
    r = init("p.parquet", "--set", "1.*=fp32", "--json", model="cwd_plugin_net:build")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["rows"] == 2


def test_diff_exit_codes_and_formats(prof, tmp_path):
    other = tmp_path / "other.parquet"
    rules = ("--set", "3.*=fp32", "--set", "type:LayerNorm=fp32", "--phases", "0.1,0.8")
    assert init(other, *rules, "--error-feedback").exit_code == 0
    same = run("diff-profile", prof, prof)
    assert same.exit_code == 0 and "profiles are equal" in same.stdout
    r = run("diff-profile", prof, other, "--json")
    assert r.exit_code == 1
    data = json.loads(r.stdout)
    assert data["equal"] is False
    route_changes = [c for c in data["changes"] if c["field"] == "route"]
    assert [(c["phase"], c["a"], c["b"]) for c in route_changes] == [
        ("warmup", "bf16", "fp32"),
        ("main", "bf16", "fp32"),
        ("final", "bf16", "fp32"),
    ]
    assert [m["key"] for m in data["provenance"]] == ["provenance.rules"]
    assert r.stderr.strip() == (
        "failed: profiles differ: 6 row change(s), 0 metadata change(s), 1 provenance change(s)"
    )
    md = run("diff-profile", prof, other, "--md", "--ignore-provenance")
    assert md.exit_code == 1 and "| `type:LayerNorm` | main | route | bf16 | fp32 |" in md.stdout
    human = run("diff-profile", prof, other)
    assert human.exit_code == 1 and "type:LayerNorm" in human.stdout


def test_diff_ignores_provenance_only_when_asked(prof, tmp_path):
    p = read_profile(prof)
    p.meta["provenance"] = {**p.meta["provenance"], "git_revision": "elsewhere"}
    write_profile(p, tmp_path / "moved.parquet")
    assert run("diff-profile", prof, tmp_path / "moved.parquet").exit_code == 1
    r = run("diff-profile", prof, tmp_path / "moved.parquet", "--ignore-provenance")
    assert r.exit_code == 0 and "provenance differs, ignored" in r.stdout


# -- bad input: exit 2, one line --------------------------------------------------------------
def test_missing_truncated_and_non_parquet(prof, tmp_path):
    bad_input(run("profile", "show", tmp_path / "nope.parquet"), "nope.parquet: no such file")
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(prof.read_bytes()[:300])
    bad_input(run("profile", "show", cut), "cut.parquet: not a readable Parquet file")
    text = tmp_path / "text.parquet"
    text.write_text("hello")
    bad_input(run("diff-profile", prof, text), "text.parquet: not a readable Parquet file")
    bad_input(run("compile-profile", tmp_path / "nope.parquet", "--model", MLP), "no such file")
    (tmp_path / "empty").mkdir()
    bad_input(run("profile", "show", tmp_path / "empty"), "no <workload>.v<N>.parquet profile")


def test_newer_schema_major(prof, tmp_path):
    p = read_profile(prof)
    meta = {**p.meta, "schema_version": "2.1.0"}
    write_table(tmp_path / "new.parquet", profile_table(p), "profile", meta)
    newer = "schema version 2.1.0 is newer"
    bad_input(run("profile", "show", tmp_path / "new.parquet"), newer, "(1.1.0)")
    bad_input(run("diff-profile", prof, tmp_path / "new.parquet"), newer)


def test_unknown_route(tmp_path):
    out = tmp_path / "p.parquet"
    bad_input(init(out, route="fp8"), "unknown route 'fp8'")
    bad_input(init(out, "--set", "3.*=int2"), "unknown route 'int2'")
    bad_input(init(out, "--set", "3.*"), "expected SELECTOR=ROUTE")
    assert not out.exists()


def test_profile_for_another_model(prof):
    bad_input(
        run("compile-profile", prof, "--model", "tests.binding.models:nested"),
        "profile was made for another model",
        model_fingerprint(models.nested()),
    )


def test_selector_matching_nothing(tmp_path):
    out = tmp_path / "p.parquet"
    bad_input(
        init(out, "--set", "head.*=fp32"), "selector 'head.*' (all) matches no trainable parameter"
    )
    assert not out.exists()


def test_unknown_workload_and_bad_plugins(tmp_path):
    out = tmp_path / "p.parquet"
    plugin = "tests.binding.models:"
    unknown = run("profile", "init", "--workload", "nope", "--route", "sign", "--out", out)
    bad_input(unknown, "unknown workload 'nope'")
    bad_input(init(out, model="no_such_module_xyz:f"), "cannot import module 'no_such_module_xyz'")
    bad_input(init(out, model=plugin + "not_a_module"), "expected a torch.nn.Module")
    bad_input(init(out, model=plugin + "missing"), "has no attribute 'missing'")
    neither = run("profile", "init", "--route", "sign", "--out", out)
    bad_input(neither, "exactly one of --workload")
    both = run("compile-profile", out, "--workload", "vision", "--model", MLP)
    bad_input(both, "exactly one of --workload")


def test_other_bad_options(prof, tmp_path):
    out = tmp_path / "p.parquet"
    bad_input(init(out, "--phases", "0.9,0.2"), "--phases '0.9,0.2'")
    bad_input(init(out, "--reducer", "ring"), "unknown reducer 'ring'")
    bad_input(init(out, "--tau", "1.5", route="ternary"), "tau must be in [0, 1)")
    bad_input(init(out, "--tau", "5", route="int8"), "tau must be in [0, 1), got 5.0")
    unused = init(out, "--tau", "0.3", route="int8")
    assert unused.exit_code == 0 and "--tau applies to ternary rows, and no rule is" in unused.stderr
    compile_ = ("compile-profile", prof, "--model", MLP)
    bad_input(run(*compile_, "--world-size", "0"), "world size must be")
    bad_input(run(*compile_, "--bucket-cap-mb", "0"), "bucket cap must be a finite number > 0")
    bad_input(run(*compile_, "--bucket-cap-mb", "inf"), "got inf")
    bad_input(run("diff-profile", prof, prof, "--json", "--md"), "choose one of --json or --md")


def test_an_out_that_is_not_a_file_of_that_kind_is_refused_before_any_work(prof, tmp_path):
    """`compile-profile P --out P` replaced the profile with its bindings (exit 0); a
    directory or a path under a file was an internal error (exit 1), calibrate's only after
    it had trained."""
    before = prof.read_bytes()
    compile_ = ("compile-profile", prof, "--model", MLP, "--out")
    bad_input(run(*compile_, prof), f"--out {prof}: exists and is a profile file; refusing")
    assert prof.read_bytes() == before
    (tmp_path / "notes.txt").write_text("mine")
    bad_input(run(*compile_, tmp_path / "notes.txt"), "exists and is not an nfabric file")
    bad_input(run(*compile_, tmp_path), "is a directory, not a bindings file to write")
    bad_input(init(tmp_path / "notes.txt" / "p.parquet"), "cannot write it (", "notes.txt is a file)")
    assert run(*compile_, tmp_path / "b.parquet").exit_code == 0
    assert run(*compile_, tmp_path / "b.parquet").exit_code == 0  # its own kind: replaced
    bad_input(init(tmp_path / "b.parquet"), "exists and is a bindings file; refusing")
    bad_input(run("calibrate", "vision", "--out", prof), f"--out {prof}: is a file")


def test_init_replaces_a_calibrated_profile_only_with_force(tmp_path):
    """A calibrated profile holds hours of search and confirmation: `profile init` does not
    write over it unless told to, and writes over a hand-written one as before."""
    import shutil

    from tests.profile.test_reference_profiles import ROOT

    calibrated = tmp_path / "vision.v13.parquet"
    shutil.copy(ROOT / "profiles" / "vision" / "vision.v13.parquet", calibrated)
    before = calibrated.read_bytes()
    bad_input(init(calibrated), f"--out {calibrated}: exists and is a calibrated profile; "
              "refusing to replace it with a hand-written one (--force to do so)")
    assert calibrated.read_bytes() == before
    assert init(calibrated, "--force").exit_code == 0
    assert calibrated.read_bytes() != before
    assert init(calibrated).exit_code == 0  # now a hand-written one: replaced as before


def test_a_rule_that_claims_nothing_is_refused_at_init_and_warned_at_compile(tmp_path):
    """`--set '*.weight=fp32' --set '0.weight=int4'`: every weight is fp32's first, so the
    int4 rule did nothing, silently (its selector matched, so it was not "dead")."""
    shadow = ("--set", "*.weight=fp32", "--set", "0.weight=int4")
    bad_input(init(tmp_path / "s.parquet", *shadow, route="int8"),
              "--set '0.weight' claims no parameter", "claimed first by '*.weight'")
    ok = init(tmp_path / "s.parquet", *shadow[2:], *shadow[:2], route="int8")
    assert ok.exit_code == 0, ok.stderr
    prof = read_profile(tmp_path / "s.parquet")  # written by hand: a compile only warns
    rows = [r for r in prof.rows if r.region != "*"]
    rows = [r if r.region != "*.weight" else replace(r, priority=0) for r in rows]
    rows = [r if r.region != "0.weight" else replace(r, priority=1) for r in rows]
    star = [r for r in prof.rows if r.region == "*"]
    write_profile(OperatingProfile(rows + star, prof.meta), tmp_path / "w.parquet")
    res = run("compile-profile", tmp_path / "w.parquet", "--model", MLP)
    assert res.exit_code == 0
    assert "warning: rule '0.weight' claims no parameter in all" in res.stderr


def test_an_internal_error_exits_3_apart_from_a_verdict() -> None:
    """1 is a verdict (failed, different) for CI; a bug must not read as one."""
    import typer

    from nfabric_cli.binding.fingerprint import model_fingerprint
    from nfabric_cli.cli.common import handle_errors

    @handle_errors
    def broken() -> None:
        model_fingerprint(None)  # a bug in nfabric's own code (an AttributeError there)

    with pytest.raises(typer.Exit) as exc:
        broken()
    assert exc.value.exit_code == 3

    @handle_errors
    def plugin() -> None:  # the user's own code (this file is not nfabric's) raising: exit 2
        raise RuntimeError("a plugin's bug")

    with pytest.raises(typer.Exit) as exc:
        plugin()
    assert exc.value.exit_code == 2


def test_compile_with_substrate_file(tmp_path):
    out = tmp_path / "p.parquet"
    assert init(out, route="sign").exit_code == 0
    (tmp_path / "slow.toml").write_text(
        "link_gbps = 0.01\nlatency_us = 1.0\ninclude_codec = false\n"
    )
    (tmp_path / "fast.toml").write_text("link_gbps = 400.0\nlatency_us = 50.0\n")
    verdicts = []
    for name in ("slow", "fast"):
        r = run("compile-profile", out, "--model", MLP, "--world-size", "8",
                "--substrate", tmp_path / f"{name}.toml", "--json")  # fmt: skip
        assert r.exit_code == 0, r.stderr
        (bucket,) = json.loads(r.stdout)["bucket_plan"]
        verdicts.append(bucket["verdicts"]["all"])
    assert verdicts == ["admit", "fallback"]  # 1,730 elements: only a slow link pays
    bad_input(
        run("compile-profile", out, "--model", MLP, "--substrate", tmp_path / "none.toml"),
        "no such file",
    )


def test_grouped_spellings_run_the_same_commands(prof, tmp_path):
    top = run("compile-profile", prof, "--model", MLP, "--world-size", "4", "--json")
    grouped = run("profile", "compile", prof, "--model", MLP, "--world-size", "4", "--json")
    assert top.exit_code == grouped.exit_code == 0, grouped.output
    assert json.loads(grouped.stdout) == json.loads(top.stdout)
    same = run("profile", "diff", prof, prof, "--json")
    assert same.exit_code == 0 and json.loads(same.stdout)["equal"] is True


def test_compile_profile_warns_when_the_run_leaves_the_proven_range():
    # the committed vision profile is proven at 300-600 steps on 2, 4 and 8 ranks
    outside = run("compile-profile", "profiles/vision", "--workload", "vision",
                  "--world-size", "3", "--total-steps", "900", "--json")
    assert outside.exit_code == 0, outside.stderr
    err = " ".join(outside.stderr.split())
    assert err.startswith("warning: the profile was proven on ")
    assert "outside that range here: 900 steps, world size 3 (a result there" in err
    inside = run("compile-profile", "profiles/vision", "--workload", "vision",
                 "--world-size", "2", "--total-steps", "600", "--json")
    assert inside.exit_code == 0 and "warning" not in inside.stderr
