"""`nfabric capacity`: when does low-bit pay on this fabric? Per-bucket verdicts or a projection."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from nfabric_cli.cli.common import check_replace, console, handle_errors, is_png, print_json
from nfabric_cli.errors import InputError

SWEEP_LINKS_GBPS = [0.01 * 10 ** (i / 8) for i in range(41)]  # 10 Mbit/s .. 1 Tbit/s


def register(app: typer.Typer) -> None:
    app.command("capacity")(capacity)


@handle_errors
def capacity(
    path: Path | None = typer.Argument(
        None, help="Bindings or profile Parquet (not needed with --project)."
    ),
    workload: str | None = typer.Option(None, "--workload", help="Built-in workload or MODULE:FN."),
    model: str | None = typer.Option(None, "--model", help="MODULE:FN returning an nn.Module."),
    shape: str | None = typer.Option(None, "--shape", help="Built-in shapes for --project: "
                                     "pythia-1b, pythia-160m."),
    substrate: Path | None = typer.Option(None, "--substrate", help="Substrate TOML file."),
    link_gbps: float | None = typer.Option(None, "--link-gbps", help="Link, Gbit/s per rank."),
    link_mbit: float | None = typer.Option(None, "--link-mbit", help="Link, Mbit/s per rank "
                                           "(as validate and replay take it)."),
    latency_us: float | None = typer.Option(None, "--latency-us", help="Latency per hop, us."),
    endpoint_gbps: float | None = typer.Option(
        None, "--endpoint-gbps", help="Central reducer endpoint capacity, Gbit/s."
    ),
    topology: str | None = typer.Option(
        None, "--topology", help="Reducer for every compressed route: sharded or central."
    ),
    margin: float | None = typer.Option(None, "--margin", help="Required speed-up margin."),
    bench: Path | None = typer.Option(
        None, "--bench", help="`nfabric bench routes --json` output: codec throughput."
    ),
    no_codec: bool = typer.Option(
        False, "--no-codec", help="Count collectives only (codecs offloaded at line rate)."
    ),
    world_size: int | None = typer.Option(None, "--world-size", help="Ranks."),
    phase: str | None = typer.Option(None, "--phase", help="Phase (default: the longest)."),
    bucket_cap_mb: float | None = typer.Option(
        None, "--bucket-cap-mb", help="DDP bucket cap in MB (default: a bindings file's, else "
        "DDP's 25)."
    ),
    project: bool = typer.Option(False, "--project", help="Project to 8..1024 ranks."),
    plot: Path | None = typer.Option(None, "--plot", help="Write a PNG here."),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Predict per-bucket FP32 vs low-bit time and the gate's verdicts on a substrate."""
    from nfabric_cli.substrate.model import build_substrate, codec_rates_from_bench

    if world_size is not None and world_size < 1:
        raise InputError(f"--world-size must be >= 1, got {world_size}")
    if bucket_cap_mb is not None:
        from nfabric_cli.binding.buckets import check_bucket_cap

        check_bucket_cap(bucket_cap_mb)
    if plot is not None:
        check_replace(plot, "--plot", "PNG file", is_png)
    if link_mbit is not None:
        if link_gbps is not None:
            raise InputError("give the link once: --link-gbps or --link-mbit")
        if not 0 < link_mbit < math.inf:
            raise InputError(f"--link-mbit must be a finite number > 0, got {link_mbit:g}")
        link_gbps = link_mbit / 1000.0
    overrides: dict[str, Any] = dict(
        link_gbps=link_gbps, latency_us=latency_us, endpoint_gbps=endpoint_gbps,
        topology=topology, margin=margin, include_codec=False if no_codec else None,
        **(codec_rates_from_bench(bench) if bench else {}),
    )
    if project:
        if path is not None:
            raise InputError("--project takes shapes (--workload, --model or --shape), not a file")
        if world_size is not None or phase is not None:
            raise InputError("--world-size and --phase are for a bindings or profile file; "
                             "--project sweeps the world sizes itself")
        if link_gbps is None:
            overrides["link_gbps"] = 100.0  # placeholder: the projection sweeps the link
        sub = build_substrate(substrate, **overrides)
        cap = 25.0 if bucket_cap_mb is None else bucket_cap_mb  # DDP's default
        _run_projection(sub, workload, model, shape, cap, plot, json_out)
        return
    if path is None:
        raise InputError("give a bindings or profile file (or --project)")
    if shape:
        raise InputError("--shape is for --project")
    bindings = _load_bindings(path, workload, model, world_size, bucket_cap_mb)
    sub = build_substrate(substrate, base=(bindings.meta or {}).get("substrate"), **overrides)
    from nfabric_cli.substrate.report import bindings_report, link_sweep

    report, buckets = bindings_report(bindings, sub, world_size, phase)
    if plot:
        from nfabric_cli.substrate.plot import plot_link_sweep

        w = report["world_size"]
        plot_link_sweep(SWEEP_LINKS_GBPS, link_sweep(buckets, w, sub, SWEEP_LINKS_GBPS), w, plot)
    if json_out:
        print_json(report)
    else:
        _render_report(report, plot)


def _load_model(workload: str | None, model: str | None):
    """(model, workload object or None) from --workload or --model; (None, None) without."""
    if workload is None and model is None:
        return None, None
    from nfabric_cli.cli.profile import load_model_from

    net, wl, _ = load_model_from(workload, model)
    return net, wl


def _load_bindings(path: Path, workload, model, world_size, bucket_cap_mb):
    from nfabric_cli.binding import load_bindings_or_profile
    from nfabric_cli.workloads.base import find_unused

    if not path.exists():
        raise InputError(f"file not found: {path}")
    kwargs: dict[str, Any] = {}
    if world_size:
        kwargs["world_size"] = world_size
    if bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = bucket_cap_mb
    net, wl = _load_model(workload, model)
    if wl is not None and find_unused(wl):  # DDP's buckets as the workload trains
        kwargs["find_unused_parameters"] = True
    return load_bindings_or_profile(path, net, **kwargs)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.3g}"


def _reduces(bucket: dict[str, Any], route: str) -> str:
    """' (2 reduces)' when a route's slices of the bucket go out in several region groups."""
    n = sum(g["route"] == route for g in bucket["groups"])
    return f" ({n} reduces)" if n > 1 else ""


def _render_report(report: dict[str, Any], plot: Path | None) -> None:
    from nfabric_cli.substrate.cost import human_bytes

    sub = report["substrate"]
    console.print(
        f"phase [bold]{report['phase']}[/], {report['world_size']} ranks, link "
        f"{sub['link_gbps']:g} Gbit/s, latency {sub.get('latency_us', 10.0):g} us, topology "
        f"{sub.get('topology', 'per route')}, margin {sub.get('margin', 0.1):g}"
    )
    if sub.get("latency_us_by_kind") or sub.get("codec_call_us"):
        parts = [f"{k} {v:g} us/round" for k, v in sub.get("latency_us_by_kind", {}).items()]
        parts += [f"{k} codec {v:g} us/call" for k, v in sub.get("codec_call_us", {}).items()]
        console.print("fitted: " + ", ".join(parts))
    table = Table(title="capacity per bucket")
    for col in ("bucket", "elements", "routes (bytes/rank/step)", "fp32 ms", "low-bit ms",
                "verdict", "reason"):
        table.add_column(col, justify="right" if col.endswith(("ms", "elements")) else "left")
    for b in report["buckets"]:
        routes = ", ".join(f"{k} {human_bytes(v['bytes'])}" + _reduces(b, k)
                           for k, v in b["routes"].items())
        colour = "green" if b["verdict"] == "admit" else "yellow"
        table.add_row(str(b["index"]), f"{b['numel']:,}", routes, _ms(b["fp32_time_s"]),
                      _ms(b["lowbit_time_s"]), f"[{colour}]{b['verdict']}[/]", b["reason"])
    console.print(table)
    t = report["totals"]
    console.print(
        f"totals: fp32 {_ms(t['fp32_time_s'])} ms, profile {_ms(t['profile_time_s'])} ms, "
        f"with gate {_ms(t['gated_time_s'])} ms per step; {t['admitted']} admitted, "
        f"{t['fallback']} fallback; bytes {human_bytes(t['bytes'])} vs fp32 "
        f"{human_bytes(t['fp32_bytes'])}"
    )
    c = report["crossover"]
    for label, n in c["bucket_numel"].items():
        text = f"loses below {n:,} elements" if n is not None else "never admitted at any size"
        console.print(f"crossover {label}: {text}")
    for label, w in c["central_saturation_world_size"].items():
        limit = c["route_world_size_limit"][label]
        text = f"stops paying at {w} ranks" if w is not None else (
            f"still pays at {limit} ranks (the route's limit)")
        console.print(f"{label} on the {c['central_saturation_numel']:,}-element bucket: {text}")
    if plot:
        console.print(f"plot: {plot}")


def _run_projection(sub, workload, model, shape, bucket_cap_mb, plot, json_out) -> None:
    from nfabric_cli.substrate.project import assumptions, builtin_shapes, model_shapes, project

    if sum(x is not None for x in (workload, model, shape)) != 1:
        raise InputError("--project needs exactly one of --workload, --model, --shape")
    shapes = builtin_shapes(shape) if shape else model_shapes(_load_model(workload, model)[0])
    proj = project(shapes, sub, bucket_cap_mb=bucket_cap_mb)
    if plot:
        from nfabric_cli.substrate.plot import plot_projection

        plot_projection(proj, plot)
    notes = assumptions(sub)
    if json_out:
        print_json({
            "params": proj.params,
            "buckets": len(proj.buckets),
            "assumptions": notes,
            "rows": [
                {"world_size": r.world_size, "link_gbps": r.link_gbps,
                 "fp32_ring_s": r.fp32_ring_s, "sign_sharded_s": r.sign_sharded_s,
                 "sign_central_s": r.sign_central_s, "central_saturated": r.central_saturated}
                for r in proj.rows
            ],
            "saturation_world_size": {f"{k:g}": v for k, v in proj.saturation.items()},
            "route_world_size_limit": proj.route_limit,
        })
        return
    table = Table(title=f"gradient communication per step, {proj.params:,} parameters, "
                        f"{len(proj.buckets)} buckets")
    for col in ("link Gbit/s", "ranks", "fp32 ring ms", "sign sharded ms", "sign central ms"):
        table.add_column(col, justify="right")
    for r in proj.rows:
        central = _ms(r.sign_central_s) + (" [red]sat[/]" if r.central_saturated else "")
        table.add_row(f"{r.link_gbps:g}", str(r.world_size), _ms(r.fp32_ring_s),
                      _ms(r.sign_sharded_s), central)
    console.print(table)
    for link, w in proj.saturation.items():
        text = f"{w} ranks" if w is not None else f"no saturation up to {proj.route_limit} ranks"
        console.print(f"{link:g} Gbit/s: sign-central stops paying at {text}")
    console.print("assumptions:")
    for note in notes:
        console.print(f"  - {note}")
    if plot:
        console.print(f"plot: {plot}")
