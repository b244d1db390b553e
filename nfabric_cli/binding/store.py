"""Bindings on disk: one Parquet row per (parameter, phase), buckets and settings as metadata.

Written with the same deterministic, atomic writer as profiles; `load_bindings_or_profile`
accepts either artefact (it reads the ``nfabric.kind`` metadata key) so every command that
needs bindings can be handed a profile and a model instead.
"""

from __future__ import annotations

import os
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import pyarrow as pa
from torch import nn

from nfabric_cli.binding.bindings import Bindings, BucketPlan, ParamBinding
from nfabric_cli.binding.buckets import cap_text
from nfabric_cli.binding.compile import (
    check_total_steps,
    compile_profile,
    fill_buckets,
    plan_layout,
    remember_substrate,
)
from nfabric_cli.binding.fingerprint import model_fingerprint, trainable_parameters
from nfabric_cli.errors import InputError
from nfabric_cli.profile.operating import check_meta
from nfabric_cli.profile.parquet import read_metadata, read_table, write_table
from nfabric_cli.profile.phases import Phase
from nfabric_cli.profile.schema import zeros_as_written
from nfabric_cli.profile.store import read_profile, resolve_profile
from nfabric_cli.routes.spec import RouteSpec

BINDINGS_SCHEMA_VERSION = "1.1.0"  # 1.1: `zeros`, sign's vote for an exact zero
_REBIND_KEYS = {
    "world_size", "substrate", "bucket_cap_mb", "total_steps", "find_unused_parameters", "ready_order"
}  # fmt: skip
_SPEC_FIELDS = tuple(f.name for f in fields(RouteSpec))

BINDINGS_SCHEMA = pa.schema(
    [
        pa.field("param", pa.string()),
        pa.field("phase", pa.string()),
        pa.field("region", pa.string()),
        pa.field("route", pa.string()),
        pa.field("tau", pa.float64()),
        pa.field("chunk", pa.int64()),
        pa.field("error_feedback", pa.bool_()),
        pa.field("reducer", pa.string()),
        pa.field("rounding", pa.string()),
        pa.field("mode", pa.string()),
        pa.field("zeros", pa.string()),
        pa.field("shape", pa.list_(pa.int64())),
        pa.field("numel", pa.int64()),
        pa.field("dtype", pa.string()),
        pa.field("bucket", pa.int32()),
        pa.field("offset", pa.int64()),
        pa.field("aliases", pa.list_(pa.string())),
    ]
)


def write_bindings(bindings: Bindings, path: str | os.PathLike[str]) -> Path:
    """Write `bindings` atomically; the same bindings always give the same bytes."""
    records = []
    for b in bindings.params.values():
        for phase in bindings.phases:
            spec = b.routes[phase.name]
            records.append(
                {
                    "param": b.name,
                    "phase": phase.name,
                    "region": b.regions[phase.name],
                    "route": spec.name,
                    **{k: getattr(spec, k) for k in _SPEC_FIELDS if k != "name"},
                    "shape": list(b.shape),
                    "numel": b.numel,
                    "dtype": b.dtype,
                    "bucket": b.bucket,
                    "offset": b.offset,
                    "aliases": list(b.aliases),
                }
            )
    table = pa.Table.from_pylist(records, schema=BINDINGS_SCHEMA)
    meta = {
        "schema_version": BINDINGS_SCHEMA_VERSION,
        "phases": [asdict(p) for p in bindings.phases],
        "buckets": [asdict(b) for b in bindings.buckets],
        "world_size": bindings.world_size,
        "bucket_cap_mb": bindings.bucket_cap_mb,
        "total_steps": bindings.total_steps,
        "fingerprint": bindings.fingerprint,
        "find_unused_parameters": bindings.find_unused_parameters,
        "bucket_order": bindings.bucket_order,
        "profile": bindings.meta,
    }
    write_table(path, table, "bindings", meta)
    return Path(path)


def read_bindings(path: str | os.PathLike[str]) -> Bindings:
    """Read a bindings file written by `write_bindings` (InputError if unusable)."""
    table, meta = read_table(path, "bindings", BINDINGS_SCHEMA, BINDINGS_SCHEMA_VERSION, {})
    try:
        phases = [Phase(**p) for p in meta["phases"]]
        buckets = [BucketPlan(**b) for b in meta["buckets"]]
        params: dict[str, ParamBinding] = {}
        for r in table.to_pylist():
            b = params.get(r["param"])
            if b is None:
                b = params[r["param"]] = ParamBinding(
                    r["param"],
                    tuple(r["shape"]),
                    r["numel"],
                    r["dtype"],
                    r["bucket"],
                    r["offset"],
                    {},
                    {},
                    tuple(r["aliases"]),
                )
            spec = {k: r[k] for k in _SPEC_FIELDS if k != "name"}
            spec["zeros"] = zeros_as_written(r["route"], r["zeros"],
                                             meta["schema_version"]) or "split"
            b.routes[r["phase"]] = RouteSpec(name=r["route"], **spec)
            b.regions[r["phase"]] = r["region"]
        if not isinstance(meta["profile"], dict):
            raise TypeError(f"its profile metadata is {type(meta['profile']).__name__}")
        try:  # as a profile's: its thresholds refused here, not first in the ranks
            check_meta(meta["profile"])
        except InputError as exc:
            raise InputError(f"{path}: {exc}") from None
        return Bindings(
            phases=phases,
            params=params,
            buckets=buckets,
            world_size=meta["world_size"],
            bucket_cap_mb=meta["bucket_cap_mb"],
            total_steps=meta["total_steps"],
            fingerprint=meta["fingerprint"],
            meta=meta["profile"],
            find_unused_parameters=meta["find_unused_parameters"],
            bucket_order=meta["bucket_order"],
        )
    except (KeyError, TypeError) as exc:
        raise InputError(f"{path}: bindings metadata is incomplete ({exc})") from None


def other_world_size(bindings: Bindings, world_size: int) -> list[str]:
    """One sentence when `bindings` were compiled for another world size than the run's: the
    routes hold at any size, but the modelled bytes and capacity verdicts are per size. A
    bindings file loaded for the run has them worked out again (`compiled_world_size`); a
    `Bindings` object given as is keeps its stored bytes (the runtime's gate prices the run's
    own size either way)."""
    compiled = bindings.compiled_world_size or bindings.world_size
    if compiled == world_size:
        return []
    what = (f"their modelled bytes and capacity verdicts are worked out again for {world_size}"
            if bindings.compiled_world_size else f"their modelled bytes are those of {compiled} "
            f"ranks (the capacity gate prices {world_size})")
    return [f"these bindings were compiled for {compiled} ranks and run on {world_size}: "
            f"{what} (compile-profile --world-size {world_size} keeps a file of this run's "
            "own)"]


def load_bindings_or_profile(
    path: str | os.PathLike[str], model: nn.Module | None, **compile_kwargs: Any
) -> Bindings:
    """Bindings from a bindings file, or by compiling a profile (file or profile directory)
    against `model` with `compile_kwargs` (see `compile_profile`).

    For a bindings file the routes stay as compiled; a model, if given, must match its
    fingerprint. A different `bucket_cap_mb` / `find_unused_parameters` / `ready_order`
    re-plans the buckets (needs the model); `world_size` / `substrate` re-derive the modelled
    bytes and verdicts.
    """
    resolved = resolve_profile(path)
    kind, _ = read_metadata(resolved)
    if kind == "profile":
        if model is None:
            raise InputError(f"{resolved} is a profile: give --workload or --model to compile it")
        return compile_profile(read_profile(resolved), model, **compile_kwargs)
    bindings = read_bindings(resolved)
    if model is not None and model_fingerprint(model) != bindings.fingerprint:
        raise InputError(
            f"{resolved} was compiled for another model (fingerprint {bindings.fingerprint}, "
            f"this model {model_fingerprint(model)}); run compile-profile again"
        )
    unknown = set(compile_kwargs) - _REBIND_KEYS
    if unknown:
        raise InputError(f"cannot apply {', '.join(sorted(unknown))} to compiled bindings")
    steps = check_total_steps(compile_kwargs.get("total_steps"))
    if steps is not None:
        bindings.total_steps = steps
    cap = compile_kwargs.get("bucket_cap_mb", bindings.bucket_cap_mb)
    unused = compile_kwargs.get("find_unused_parameters", bindings.find_unused_parameters)
    order = compile_kwargs.get("ready_order")
    replan = cap != bindings.bucket_cap_mb or unused != bindings.find_unused_parameters or order
    if replan:
        if model is None:
            raise InputError(
                f"{resolved} was planned for {cap_text(bindings.bucket_cap_mb)} "
                f"(find_unused_parameters={bindings.find_unused_parameters}); give the model to "
                "re-plan its buckets, or run compile-profile again"
            )
        plan_layout(bindings, trainable_parameters(model), cap, unused, order)
    ws, sub = compile_kwargs.get("world_size"), compile_kwargs.get("substrate")
    if ws is not None:
        if not isinstance(ws, int) or ws < 1:
            raise InputError(f"world size must be a positive integer, got {ws!r}")
        if ws != bindings.world_size:
            replan = True
            bindings.compiled_world_size = bindings.world_size
        bindings.world_size = ws
    if sub is not None:
        remember_substrate(bindings, sub)
    if replan or sub is not None:
        fill_buckets(bindings, bindings.meta.get("substrate"))
    return bindings
