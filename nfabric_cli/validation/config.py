"""`ValidateConfig`: everything one validation run needs, checked once, shared with every rank.

The parent checks the user's input (one `InputError` line each: arms, baselines, world size,
steps, rendezvous endpoint, injections, link rate) and writes the config as JSON into the run
directory; every rank, spawned or started by torchrun, reads the same file. The config is
plain data so a rank on another node can rebuild it from the same command line.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from nfabric_cli.atomic import atomic_write_text
from nfabric_cli.errors import InputError
from nfabric_cli.runtime.inject import check_ranks, parse_injections
from nfabric_cli.workloads.common import check_seed

#: Arms in report order. `fp32` always runs: it is the reference every delta is taken against.
ARMS: tuple[str, ...] = ("fp32", "static", "profile")
#: PyTorch's own hooks, run as extra arms after ours.
BASELINES: tuple[str, ...] = ("fp16", "powersgd")
LAUNCHERS: tuple[str, ...] = ("spawn", "torchrun")
#: Default tolerance when the profile names none: absolute, in metric units.
DEFAULT_TOLERANCE = {True: 0.01, False: 0.05}  # higher_is_better -> tolerance
DEFAULT_TIMEOUT_S = 30.0

_HOST_PORT = re.compile(r"^(?:\[(?P<v6>[0-9a-fA-F:.]+)\]|(?P<host>[A-Za-z0-9._-]+)):(?P<port>\d+)$")


@dataclass
class ValidateConfig:
    """One validation run (see `nfabric validate --help` for the meaning of each field)."""

    source: str  # profile file/dir or bindings file
    workload: str
    world_size: int | None = None  # None: --nnodes x --nproc-per-node under torchrun, else 2
    steps: int | None = None  # None: `run.default_steps` (the profile's calibrated length, ...)
    arms: list[str] = field(default_factory=lambda: list(ARMS))
    baselines: list[str] = field(default_factory=list)
    seed: int = 0
    tolerance: float | None = None  # None: the profile's target, else DEFAULT_TOLERANCE
    launcher: str = "spawn"
    nnodes: int = 1
    node_rank: int = 0
    nproc_per_node: int | None = None
    rdzv_endpoint: str | None = None
    link_mbit: float | None = None
    inject: list[str] = field(default_factory=list)
    report_dir: str = ""
    timeout_s: float = DEFAULT_TIMEOUT_S
    data_dir: str | None = None
    powersgd_rank: int = 2
    bucket_cap_mb: float | None = None  # what every arm passes to DDP (None: DDP's default)
    record_trace: str | None = None  # directory for the profile arm's bucket traces (replay)
    gate: str = "model"  # the profile arm's capacity gate: "model" (substrate) or "measure"
    store_path: str | None = None  # FileStore of a spawn launch
    run_dir: str = ""  # progress files, logs, results.json

    # -- derived ----------------------------------------------------------------------------
    def all_arms(self) -> list[str]:
        """Arms in run order: fp32 first, then the requested arms, then the baselines."""
        ours = [a for a in ARMS if a == "fp32" or a in self.arms]
        return ours + [b for b in BASELINES if b in self.baselines]

    def powersgd_start_iter(self) -> int:
        """PowerSGD's `start_powerSGD_iter`: 10 % of the run, as its docs suggest, and >= 2
        (its minimum with error feedback / warm start)."""
        return max(2, math.ceil(0.1 * (self.steps or 0)))

    # -- checks -----------------------------------------------------------------------------
    def check(self) -> ValidateConfig:
        """Raise `InputError` (one line) on anything unusable; return self."""
        if self.world_size is None:
            per_node = self.nproc_per_node
            self.world_size = per_node * self.nnodes if per_node and self.nnodes > 0 else 2
        if self.world_size < 1:
            raise InputError(f"--world-size must be >= 1, got {self.world_size}")
        check_seed(self.seed, "--seed")
        if self.steps is not None and self.steps < 1:
            raise InputError(f"--steps must be >= 1, got {self.steps}")
        if not self.arms:
            raise InputError(f"--arms names no arm (choose from {', '.join(ARMS)})")
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown:
            raise InputError(f"unknown arm {unknown[0]!r} (choose from {', '.join(ARMS)})")
        unknown = [b for b in self.baselines if b not in BASELINES]
        if unknown:
            raise InputError(
                f"unknown baseline {unknown[0]!r} (choose from {', '.join(BASELINES)})"
            )
        if self.launcher not in LAUNCHERS:
            raise InputError(f"unknown launcher {self.launcher!r} (spawn or torchrun)")
        if self.tolerance is not None and not (
            self.tolerance >= 0 and math.isfinite(self.tolerance)
        ):
            raise InputError(f"--tolerance must be a finite number >= 0, got {self.tolerance}")
        if not self.timeout_s > 0:
            raise InputError(f"--timeout must be > 0 seconds, got {self.timeout_s}")
        if self.gate not in ("model", "measure"):
            raise InputError(f"--gate: model or measure, got {self.gate!r}")
        if self.powersgd_rank < 1:
            raise InputError(f"--powersgd-rank must be >= 1, got {self.powersgd_rank}")
        if self.link_mbit is not None and not (
            self.link_mbit > 0 and math.isfinite(self.link_mbit)
        ):
            raise InputError(f"--link-mbit must be a positive number, got {self.link_mbit}")
        check_ranks(parse_injections(self.inject), self.world_size)
        self._check_launch()
        return self

    def _check_launch(self) -> None:
        if self.nnodes < 1:
            raise InputError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not (0 <= self.node_rank < self.nnodes):
            raise InputError(f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.rdzv_endpoint is not None:
            parse_endpoint(self.rdzv_endpoint)
        if self.launcher == "spawn":
            if self.nnodes != 1 or self.rdzv_endpoint is not None or self.nproc_per_node:
                raise InputError(
                    "--nnodes/--node-rank/--nproc-per-node/--rdzv-endpoint need --launcher torchrun"
                )
            return
        per_node = self.nproc_per_node
        if per_node is None:
            if self.world_size % self.nnodes:
                raise InputError(
                    f"--world-size {self.world_size} is not a multiple of --nnodes {self.nnodes}"
                )
            self.nproc_per_node = self.world_size // self.nnodes
        elif per_node < 1:
            raise InputError(f"--nproc-per-node must be >= 1, got {per_node}")
        elif self.world_size != per_node * self.nnodes:
            raise InputError(f"--world-size {self.world_size} is not --nnodes {self.nnodes} x "
                             f"--nproc-per-node {per_node}: give one or the other")
        if self.nnodes > 1 and self.rdzv_endpoint is None:
            raise InputError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (node 0's address)")
        if self.nnodes > 1 and self.link_mbit is not None:
            raise InputError("--link-mbit shapes one machine's loopback: it needs --nnodes 1")

    # -- files ------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> Path:
        atomic_write_text(path, json.dumps(asdict(self), indent=2, sort_keys=True))
        return Path(path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ValidateConfig:
        data = json.loads(Path(path).read_text())
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def parse_list(text: str | None, option: str) -> list[str]:
    """'fp32, static' -> ['fp32', 'static']; '' -> []. Repeats are refused."""
    if text is None:
        return []
    items = [t.strip().lower() for t in text.split(",") if t.strip()]
    dupes = sorted({t for t in items if items.count(t) > 1})
    if dupes:
        raise InputError(f"{option} names {dupes[0]!r} twice")
    return items


def parse_endpoint(text: str) -> tuple[str, int]:
    """'HOST:PORT' or '[v6]:PORT' -> (host, port); InputError when malformed."""
    m = _HOST_PORT.match(text.strip())
    if m is None:
        raise InputError(f"bad --rdzv-endpoint {text!r}: expected HOST:PORT, e.g. 10.0.0.1:29400")
    port = int(m["port"])
    if not (1 <= port <= 65535):
        raise InputError(f"bad --rdzv-endpoint {text!r}: port must be in 1..65535")
    return (m["v6"] or m["host"]), port


def resolve_tolerance(explicit: float | None, target: dict[str, Any] | None, higher: bool) -> float:
    """--tolerance, else the profile's target tolerance, else the default for the metric kind."""
    if explicit is not None:
        return float(explicit)
    value = (target or {}).get("tolerance")
    if value is not None:
        return float(value)
    return DEFAULT_TOLERANCE[bool(higher)]
