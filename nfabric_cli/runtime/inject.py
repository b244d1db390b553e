"""Fault injection for tests and `validate --inject`: `KIND@STEP[:RANK]` specs.

- ``nan@STEP[:RANK]``: the rank's gradients become NaN at that step (the health monitor must
  catch it before any low-bit encoder turns NaN into a vote);
- ``spike@STEP[:RANK]``: the rank's gradients are multiplied by 1e3 at that step;
- ``kill@STEP[:RANK]``: the rank exits at that step (the caller calls ``os._exit(17)``).

Without ``:RANK`` an injection hits every rank. Example: ``parse_injections(["nan@5:1"])``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nfabric_cli.errors import InputError

if TYPE_CHECKING:
    from torch import Tensor

KINDS: tuple[str, ...] = ("nan", "spike", "kill")
SPIKE_FACTOR = 1e3
#: Exit status of a rank killed by ``kill@STEP`` (lets a launcher tell it from a crash).
KILL_EXIT_CODE = 17

_SPEC = re.compile(r"^(?P<kind>[a-z]+)@(?P<step>[+-]?\d+)(?::(?P<rank>.*))?$")


@dataclass(frozen=True)
class Injection:
    """One fault: what, at which step, on which rank (None: every rank)."""

    kind: str
    step: int
    rank: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InputError(f"unknown injection kind {self.kind!r} (choose from nan, spike, kill)")
        if self.step < 0:
            raise InputError(f"injection step must be >= 0, got {self.step}")
        if self.rank is not None and self.rank < 0:
            raise InputError(f"injection rank must be >= 0, got {self.rank}")

    def hits(self, step: int, rank: int) -> bool:
        return self.step == step and (self.rank is None or self.rank == rank)

    def __str__(self) -> str:
        return f"{self.kind}@{self.step}" + ("" if self.rank is None else f":{self.rank}")


def parse_injections(specs: Iterable[str]) -> list[Injection]:
    """Parse ``KIND@STEP[:RANK]`` strings; a bad spec raises a one-line `InputError`."""
    out = []
    for spec in specs:
        text = spec.strip().lower()
        m = _SPEC.match(text)
        if m is None:
            raise InputError(
                f"bad injection {spec!r}: expected KIND@STEP[:RANK] with KIND nan, spike or kill"
            )
        kind, rank_text = m["kind"], m["rank"]
        if kind not in KINDS:
            raise InputError(f"bad injection {spec!r}: unknown kind {kind!r} (nan, spike or kill)")
        step = int(m["step"])
        if step < 0:
            raise InputError(f"bad injection {spec!r}: step must be >= 0")
        rank = None
        if rank_text is not None:
            if not rank_text.isdigit():
                raise InputError(f"bad injection {spec!r}: rank must be an integer >= 0")
            rank = int(rank_text)
        out.append(Injection(kind, step, rank))
    return out


def check_ranks(injections: Iterable[Injection], world_size: int) -> None:
    """Refuse injections aimed at a rank the run does not have."""
    for inj in injections:
        if inj.rank is not None and inj.rank >= world_size:
            raise InputError(
                f"injection {inj} names rank {inj.rank}, but world size is {world_size}"
            )


def check_steps(injections: Iterable[Injection], steps: int) -> None:
    """Refuse injections at a step the run never reaches (they could not fire)."""
    for inj in injections:
        if inj.step >= steps:
            raise InputError(
                f"injection {inj} is at step {inj.step}, but the run's steps are 0-{steps - 1}"
            )


def apply_injection(
    injections: Iterable[Injection], step: int, rank: int, grads: Sequence[Tensor | None]
) -> None:
    """Corrupt `grads` in place for every nan/spike injection that hits (step, rank).

    ``nan`` fills whole gradients with NaN; ``spike`` multiplies them by 1e3. None entries
    (parameters without a gradient) are skipped.
    """
    for inj in injections:
        if inj.kind == "kill" or not inj.hits(step, rank):
            continue
        for g in grads:
            if g is None:
                continue
            if inj.kind == "nan":
                g.fill_(float("nan"))
            else:
                g.mul_(SPIKE_FACTOR)


def should_kill(injections: Iterable[Injection], step: int, rank: int) -> bool:
    """True when a ``kill`` injection hits (step, rank); the caller exits with `KILL_EXIT_CODE`."""
    return any(inj.kind == "kill" and inj.hits(step, rank) for inj in injections)
