"""`TraceRecorder`: per-bucket traces of a real run, for `nfabric replay`.

Each rank writes `buckets-rank<R>.parquet` (one row per step x bucket x route group: sizes,
route, options, measured seconds, bytes) and a bounded sample of the real local gradient
payloads (`payloads/rank<R>-step<S>-bucket<B>.npy`, the first `payload_steps` steps, at most
`payload_bytes` per rank), plus `trace.json` (format version, world size, backend). Replay
feeds the payloads through the real reducer code paths and fits the cost model's constants.
Data only: Parquet, JSON and .npy; never pickle.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from nfabric_cli.atomic import atomic_path, atomic_write_text

TRACE_VERSION = "1.0"

_SCHEMA = pa.schema(
    [
        ("rank", pa.int32()),
        ("step", pa.int64()),
        ("phase", pa.string()),
        ("bucket", pa.int32()),  # order of the bucket within its step
        ("bucket_numel", pa.int64()),
        ("params", pa.int32()),
        ("route", pa.string()),  # route label, e.g. sign/sharded
        ("spec", pa.string()),  # RouteSpec as JSON
        ("numel", pa.int64()),
        ("segments", pa.list_(pa.int64())),
        ("seconds", pa.float64()),
        ("sent", pa.int64()),
        ("received", pa.int64()),
        ("payload", pa.string()),  # relative path of the sampled payload, or ""
    ]
)


class TraceRecorder:
    """Collects rows in memory; `close()` writes them atomically."""

    def __init__(
        self,
        directory: str | Path,
        rank: int,
        world_size: int,
        backend: str,
        payload_steps: int = 2,
        payload_bytes: int = 16 << 20,
    ) -> None:
        self.dir = Path(directory)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.payload_steps, self.payload_budget = payload_steps, payload_bytes
        self.rows: list[dict[str, Any]] = []
        (self.dir / "payloads").mkdir(parents=True, exist_ok=True)

    def record(
        self,
        step: int,
        phase: str,
        bucket: int,
        bucket_numel: int,
        params: int,
        spec: Any,
        segments: tuple[int, ...],
        seconds: float,
        sent: int,
        received: int,
        local: torch.Tensor | None,
        group: int = 0,
    ) -> None:
        """One route group of one bucket; `local` is this rank's input (sampled if in budget)."""
        payload = ""
        if local is not None and step < self.payload_steps and local.numel() * 4 <= self.payload_budget:
            # group: the route group's index within the bucket (two regions may share a route)
            name = f"payloads/rank{self.rank}-step{step}-bucket{bucket}-g{group}-{spec.name}.npy"
            with atomic_path(self.dir / name) as tmp:
                with open(tmp, "wb") as fh:
                    np.save(fh, local.detach().float().cpu().numpy())
            self.payload_budget -= local.numel() * 4
            payload = name
        self.rows.append(
            {
                "rank": self.rank, "step": step, "phase": phase, "bucket": bucket,
                "bucket_numel": bucket_numel, "params": params, "route": spec.label(),
                "spec": json.dumps(spec.to_dict(), sort_keys=True), "numel": sum(segments),
                "segments": list(segments), "seconds": seconds, "sent": sent,
                "received": received, "payload": payload,
            }
        )

    def close(self) -> None:
        table = pa.Table.from_pylist(self.rows, schema=_SCHEMA)
        with atomic_path(self.dir / f"buckets-rank{self.rank}.parquet") as tmp:
            pq.write_table(table, tmp)
        if self.rank == 0:
            meta = {"format": "nfabric-trace", "version": TRACE_VERSION,
                    "world_size": self.world_size, "backend": self.backend}
            atomic_write_text(self.dir / "trace.json", json.dumps(meta, indent=2, sort_keys=True))


def clear_trace(directory: str | Path) -> None:
    """Remove an earlier recording's files from `directory` (trace.json, the ranks' bucket
    files, the payload samples), so a new recording there is not read beside another run's
    ranks or samples; anything else in the folder is left alone."""
    d = Path(directory)
    for f in [d / "trace.json", *d.glob("buckets-rank*.parquet"),
              *d.glob("payloads/rank*-step*-bucket*.npy")]:
        f.unlink(missing_ok=True)
