"""`nfabric bench ...`: benchmarks that print ratios measured side by side in one run."""

from __future__ import annotations

import os

import typer
from rich.table import Table

from nfabric_cli.cli.common import console, handle_errors, print_json
from nfabric_cli.errors import InputError

bench_app = typer.Typer(help="Benchmarks (ratios against a reference measured in the same run).", no_args_is_help=True)


@bench_app.command("routes")
@handle_errors
def routes_cmd(
    size: int = typer.Option(1 << 24, "--size", help="Elements in the fp32 buffer."),
    repeats: int = typer.Option(5, "--repeats", help="Timed repeats; the best is kept."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Encode/decode throughput per route vs a plain read pass over the same buffer (local
    decode: a rank's own payload, as error feedback runs it; reduce decode: the combined result
    of 4 ranks, as every reduce ends)."""
    if size < 1 or repeats < 1:
        raise InputError("--size and --repeats must be >= 1")
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if 4 * size > memory:  # (refused before allocating: an overcommitting kernel would not)
        raise InputError(f"--size {size:,}: its fp32 buffer alone ({4 * size / 2**30:,.1f} GiB) "
                         f"is more than this machine's memory ({memory / 2**30:,.1f} GiB)")
    from nfabric_cli.benchmarks.routes import bench_routes

    try:
        result = bench_routes(size=size, repeats=repeats)
    except (MemoryError, RuntimeError) as exc:  # torch's CPU allocator raises RuntimeError
        if not isinstance(exc, MemoryError) and "allocate" not in str(exc):
            raise
        raise InputError(f"--size {size:,}: not enough memory for the benchmark's buffers "
                         "(ask for fewer elements)") from None
    if json_out:
        print_json(result)
        return
    table = Table(title=f"routes on {size:,} fp32 elements, 1 thread (read pass {result['read_gbps']:.2f} GB/s)")
    for col in ("route", "encode GB/s", "vs read", "local decode GB/s", "vs read",
                "reduce decode GB/s", "vs read", "payload bytes"):
        table.add_column(col, justify="right" if col != "route" else "left")
    for name, r in result["routes"].items():
        reduce = [f"{r['reduce_decode_gbps']:.2f}", f"{r['reduce_decode_vs_read']:.0%}"] \
            if "reduce_decode_gbps" in r else ["-", "-"]
        table.add_row(
            name, f"{r['encode_gbps']:.2f}", f"{r['encode_vs_read']:.0%}",
            f"{r['decode_gbps']:.2f}", f"{r['decode_vs_read']:.0%}", *reduce,
            f"{r['payload_bytes']:,}",
        )
    console.print(table)


@bench_app.command("runtime")
@handle_errors
def runtime_cmd(
    world_size: int = typer.Option(2, "--world-size", help="Ranks (one process each)."),
    steps: int = typer.Option(
        60, "--steps", help="Steps per arm and round (at least 3: the first two are warm-up)."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """All-fp32 profile step time vs plain DDP step time (same model, same run); beside them,
    a sign profile whose every scope the monitor holds on fp32 (its fallback path)."""
    from nfabric_cli.benchmarks.runtime import MIN_STEPS, bench_runtime

    if world_size < 1 or steps < MIN_STEPS:
        raise InputError(f"--world-size must be >= 1 and --steps >= {MIN_STEPS} (the first two "
                         "steps of each arm's round are warm-up, left out)")

    result = bench_runtime(world_size=world_size, steps=steps)
    if json_out:
        print_json(result)
        return
    console.print(
        f"plain DDP {result['plain_step_s'] * 1e3:.2f} ms/step, all-fp32 fabric "
        f"{result['fabric_step_s'] * 1e3:.2f} ms/step: ratio {result['ratio']:.3f} "
        f"(goal <= 1.05); PyTorch's allreduce_hook {result['allreduce_hook_ratio']:.3f}; "
        f"a sign profile held on fp32 by the monitor {result['held_ratio']:.3f}; "
        f"{world_size} ranks, {steps} steps, median of {result['rounds']} interleaved rounds"
    )


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
