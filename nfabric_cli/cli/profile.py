"""`nfabric profile init|show`, `nfabric compile-profile`, `nfabric diff-profile`."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from nfabric_cli.cli.common import check_out, console, err_console, handle_errors, print_json
from nfabric_cli.errors import CheckFailed, InputError

profile_app = typer.Typer(
    help="Operating profiles: write a hand-made one, show one.", no_args_is_help=True
)

_WORKLOAD = typer.Option(
    None, "--workload", help="Built-in workload (vision, transformer, lm, glyphs) or MODULE:FN."
)
_MODEL = typer.Option(
    None, "--model", help="MODULE:FN returning an nn.Module (cwd is on the path)."
)
_JSON = typer.Option(False, "--json", help="Machine-readable output.")


def register(app: typer.Typer) -> None:
    """`profile init|show|compile|diff`, and the top-level `compile-profile` / `diff-profile`
    (the spellings docs and CI jobs use) for the same two commands."""
    profile_app.command("compile")(compile_profile_cmd)
    profile_app.command("diff")(diff_profile_cmd)
    app.add_typer(profile_app, name="profile")
    app.command("compile-profile")(compile_profile_cmd)
    app.command("diff-profile")(diff_profile_cmd)


def load_model_from(workload: str | None, model: str | None) -> tuple[Any, Any, str]:
    """(model, workload object or None, label) from exactly one of --workload / --model."""
    check_one_model_option(workload, model)
    from nfabric_cli.workloads.registry import get_workload, load_model

    if workload is not None:
        wl = get_workload(workload)
        return wl.build_model(0), wl, getattr(wl, "name", workload)
    assert model is not None
    return load_model(model), None, model


def check_one_model_option(workload: str | None, model: str | None) -> None:
    if (workload is None) == (model is None):
        raise InputError("give exactly one of --workload W or --model MODULE:FN")


@profile_app.command("init")
@handle_errors
def init_cmd(
    out: Path = typer.Option(..., "--out", help="Profile file to write."),
    route: str = typer.Option(..., "--route", help="Default route for every other parameter."),
    rules: list[str] = typer.Option(
        [], "--set", help="SELECTOR=ROUTE, repeatable; first match wins ('head.*=fp32')."
    ),
    workload: str | None = _WORKLOAD,
    model: str | None = _MODEL,
    phases: str | None = typer.Option(None, "--phases", help="Phase boundaries, e.g. 0.1,0.8."),
    tau: float | None = typer.Option(None, "--tau", help="Ternary gate for ternary rows."),
    error_feedback: bool = typer.Option(
        False, "--error-feedback", help="Error feedback on low-bit rows."
    ),
    reducer: str = typer.Option("sharded", "--reducer", help="sharded or central, low-bit rows."),
    world_size: int | None = typer.Option(None, "--world-size", help="Ranks the profile is for."),
    force: bool = typer.Option(
        False, "--force", help="Replace a calibrated profile at --out (refused without it)."
    ),
    json_out: bool = _JSON,
) -> None:
    """Write a hand-written (static) profile: rules in order, then the default route."""
    from nfabric_cli.binding import parse_rule, static_profile
    from nfabric_cli.profile import parse_phases, write_profile
    from nfabric_cli.profile.store import is_calibrated

    check_out(out, "profile")
    if out.exists() and not force and is_calibrated(out):
        raise InputError(f"--out {out}: exists and is a calibrated profile; refusing to "
                         "replace it with a hand-written one (--force to do so)")
    parsed = [parse_rule(r) for r in rules]
    phase_list = parse_phases(phases)
    net, wl, label = load_model_from(workload, model)
    extra = {"data_fingerprint": wl.data_fingerprint()} if wl is not None else {}
    prof = static_profile(
        net, route, parsed, phase_list, label, tau, error_feedback, reducer, world_size, extra
    )
    write_profile(prof, out)
    if tau is not None and all(r.route != "ternary" for r in prof.rows):
        err_console.print("[yellow]warning[/]: --tau applies to ternary rows, and no rule is "
                          "ternary: it was not written", highlight=False, soft_wrap=True)
    if json_out:
        print_json({"path": str(out), "rows": len(prof.rows), "meta": prof.meta})
        return
    console.print(f"wrote {out}: {len(prof.rows)} rows, {len(phase_list)} phase(s)")
    _render_rows(prof)


@profile_app.command("show")
@handle_errors
def show_cmd(
    path: Path = typer.Argument(..., help="Profile file, or a directory (its newest version)."),
    json_out: bool = _JSON,
) -> None:
    """Print a profile's rows and a summary of its metadata."""
    from nfabric_cli.profile import read_profile, resolve_profile
    from nfabric_cli.profile.proven import proven_range

    resolved = resolve_profile(path)
    prof = read_profile(resolved)
    if json_out:
        rows = [r.to_dict() for r in prof.sorted_rows()]
        print_json({"path": str(resolved), "meta": prof.meta, "rows": rows})
        return
    console.print(f"[bold]{resolved}[/]")
    meta = Table("metadata", "value", show_header=False)
    for key in ("workload", "model_fingerprint", "world_size", "schema_version", "profile_version"):
        meta.add_row(key, _fmt(prof.meta.get(key)))
    for key in ("target", "substrate", "health"):
        meta.add_row(key, _fmt(prof.meta.get(key)))
    proven = proven_range(prof.meta)
    if proven is not None:
        worst = (prof.meta.get("proven") or {}).get("worst_degradation")
        tail = "" if worst is None else f"; worst degradation {worst:+.4f}"
        meta.add_row("proven on", proven.describe() + tail)
    prov = prof.meta.get("provenance") or {}
    meta.add_row("provenance", _fmt({k: v for k, v in prov.items() if not isinstance(v, dict)}))
    console.print(meta)
    _render_rows(prof)


@handle_errors
def compile_profile_cmd(
    profile: Path = typer.Argument(..., help="Profile file, or a directory (its newest version)."),
    workload: str | None = _WORKLOAD,
    model: str | None = _MODEL,
    world_size: int | None = typer.Option(
        None, "--world-size", help="Ranks (default: the profile's, else 2)."
    ),
    bucket_cap_mb: float | None = typer.Option(
        None, "--bucket-cap-mb",
        help="DDP bucket_cap_mb the run will use (default: DDP's own, 25 MB with a 1 MB "
             "first bucket).",
    ),
    total_steps: int | None = typer.Option(
        None, "--total-steps", help="Steps of the run (phase boundaries)."
    ),
    find_unused: bool = typer.Option(
        False, "--find-unused-parameters", help="Plan buckets for DDP(find_unused_parameters=True)."
    ),
    substrate: Path | None = typer.Option(
        None, "--substrate", help="Substrate TOML for bucket verdicts (default: the profile's)."
    ),
    out: Path | None = typer.Option(None, "--out", help="Write the bindings Parquet here."),
    json_out: bool = _JSON,
) -> None:
    """Resolve a profile against a model: bindings, DDP bucket plan, modelled traffic."""
    from nfabric_cli.binding import write_bindings
    from nfabric_cli.binding.compile import compile_for_workload, shadowed_rules
    from nfabric_cli.profile import read_profile, resolve_profile
    from nfabric_cli.profile.proven import outside_proven
    from nfabric_cli.workloads.base import find_unused as find_unused_of

    check_one_model_option(workload, model)
    if out is not None:  # the profile itself, above all, must not become its bindings
        check_out(out, "bindings")
    prof = read_profile(resolve_profile(profile))
    sub = None
    if substrate is not None:
        from nfabric_cli.substrate.model import load_substrate

        sub = load_substrate(substrate)
    net, wl, _ = load_model_from(workload, model)
    bindings = compile_for_workload(prof, net, wl, world_size, bucket_cap_mb, total_steps, sub,
                                    find_unused or find_unused_of(wl))
    if out is not None:
        write_bindings(bindings, out)
    summary = bindings.summary()
    for note in (bindings.meta.get("model_match") or {}).get("notes", []):
        err_console.print(f"note: {note}", highlight=False, soft_wrap=True)
    for selector, phases in shadowed_rules(prof, bindings).items():
        err_console.print(f"[yellow]warning[/]: rule {selector!r} claims no parameter in "
                          f"{', '.join(phases)}: an earlier rule claims every one it matches",
                          highlight=False, soft_wrap=True)
    # the earliest point to say a run of this length or world size is not what was proven
    # (`attach` says it again at run time, `validate` beside its verdict)
    for line in outside_proven(bindings.meta, steps=bindings.total_steps,
                               world_size=bindings.world_size):
        err_console.print(f"[yellow]warning[/]: {line}", highlight=False, soft_wrap=True)
    if json_out:
        buckets = [asdict(bk) for bk in bindings.buckets]
        print_json({**summary, "out": None if out is None else str(out), "bucket_plan": buckets})
        return
    _render_summary(summary, bindings, out)


@handle_errors
def diff_profile_cmd(
    a: Path = typer.Argument(..., help="Profile A (file or directory)."),
    b: Path = typer.Argument(..., help="Profile B (file or directory)."),
    json_out: bool = _JSON,
    md: bool = typer.Option(False, "--md", help="A Markdown table for a pull-request comment."),
    ignore_provenance: bool = typer.Option(
        False, "--ignore-provenance", help="Provenance changes do not count."
    ),
    ignore_evidence: bool = typer.Option(
        False, "--ignore-evidence", help="traffic_fraction, metric_delta, trials do not count."
    ),
) -> None:
    """Semantic diff keyed on (region, phase). Exit 0 equal, 1 different, 2 bad input."""
    from nfabric_cli.profile import diff_profiles, read_profile, resolve_profile

    if json_out and md:
        raise InputError("choose one of --json or --md")
    path_a, path_b = resolve_profile(a), resolve_profile(b)
    diff = diff_profiles(
        read_profile(path_a), read_profile(path_b), ignore_provenance, ignore_evidence
    )
    if json_out:
        print_json(diff.to_dict())
    elif md:
        typer.echo(diff.to_markdown())
    else:
        _render_diff(diff, path_a, path_b)
    if not diff.equal:
        raise CheckFailed(
            f"profiles differ: {len(diff.changes)} row change(s), "
            f"{len(diff.metadata)} metadata change(s)"
            + ("" if ignore_provenance else f", {len(diff.provenance)} provenance change(s)")
        )


# -- rendering --------------------------------------------------------------------------------
def _fmt(value: Any) -> str:
    from nfabric_cli.profile.diff import format_value

    return format_value(value)


def _render_rows(prof: Any) -> None:
    rows = prof.sorted_rows()
    evidence = any(r.traffic_fraction is not None or r.trials is not None for r in rows)
    columns = ["phase", "span", "prio", "region", "route", "tau", "ef", "reducer"]
    table = Table(*columns, *(["traffic", "Δmetric", "trials"] if evidence else []))
    for r in rows:
        cells = [
            r.phase, f"[{r.phase_start:g}, {r.phase_end:g})", str(r.priority), r.region,
            r.route, _fmt(r.tau), _fmt(r.error_feedback), r.reducer,
        ]  # fmt: skip
        if evidence:
            cells += [_fmt(r.traffic_fraction), _fmt(r.metric_delta), _fmt(r.trials)]
        table.add_row(*cells)
    console.print(table)


def _render_summary(summary: dict[str, Any], bindings: Any, out: Path | None) -> None:
    head = (
        f"{summary['params']} parameters ({summary['numel']:,} elements) in "
        f"{summary['buckets']} DDP bucket(s), world size {summary['world_size']}, "
        f"fingerprint {summary['fingerprint']}"
    )
    console.print(head + (f"; wrote {out}" if out else ""))
    table = Table(
        "phase", "span", "traffic vs fp32", "bytes/rank/step", "routes (params)", "buckets admitted"
    )
    for p in summary["phases"]:
        routes = ", ".join(f"{k} ({v['params']})" for k, v in p["routes"].items())
        table.add_row(
            p["phase"],
            f"[{p['start']:g}, {p['end']:g})",
            f"{100 * p['traffic_fraction']:.2f} %",
            f"{p['bytes_per_step']:,}",
            routes,
            f"{p['buckets_admitted']}/{p['buckets_admitted'] + p['buckets_fallback']}",
        )
    console.print(table)
    buckets = Table("bucket", "params", "elements", *[f"{p.name}" for p in bindings.phases])
    for bk in bindings.buckets:
        shown = ", ".join(bk.params[:3]) + (f" +{len(bk.params) - 3}" if len(bk.params) > 3 else "")
        buckets.add_row(
            str(bk.index), shown, f"{bk.numel:,}", *[bk.verdicts[p.name] for p in bindings.phases]
        )
    console.print(buckets)


def _render_diff(diff: Any, path_a: Path, path_b: Path) -> None:
    if diff.equal:
        note = " (provenance differs, ignored)" if diff.provenance else ""
        console.print(f"profiles are equal{note}: {path_a} {path_b}")
        return
    console.print(f"A = {path_a}\nB = {path_b}")
    if diff.changes:
        table = Table("region", "phase", "field", "A", "B")
        for c in diff.changes:
            table.add_row(
                c.region, c.phase, c.kind if c.field == "row" else c.field, _fmt(c.a), _fmt(c.b)
            )
        console.print(table)
    groups = [("metadata", diff.metadata), ("provenance", diff.provenance)]
    for title, items in groups:
        if items:
            ignored = " (ignored)" if title == "provenance" and diff.ignore_provenance else ""
            table = Table(f"{title}{ignored}", "A", "B")
            for m in items:
                table.add_row(m.key, _fmt(m.a), _fmt(m.b))
            console.print(table)
