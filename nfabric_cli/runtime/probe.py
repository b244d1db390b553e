"""Measured admission: with no substrate to price it, time both paths per bucket, keep the faster.

The capacity gate prices buckets on a fitted substrate (`substrate/cost.py`); without one it
admits every bucket as the profile wrote it, however slow low-bit is on the link at hand.
With ``gate="measure"`` (`attach`, `validate --gate measure`) and no substrate, each bucket
with a low-bit route (key: its parameter names and phase) runs a *probe cycle*: `steps`
steps on the low-bit path as written, then `steps` on fp32, the whole bucket timed by the hook
and the time all-reduced with the step's statistics (so every rank holds the same numbers and
takes the same decision before the next step, and the collective order stays identical).
After the cycle the bucket keeps low-bit if its median time is below fp32's, else fp32, until
`recheck_every` more steps have passed; then it probes again. Every decision is an event with
both medians.

Opt-in, not the default: a decision from wall-clock times differs from run to run, so
calibration cannot predict it and one seed no longer fixes a run (`validate` and the
simulator stay bit-reproducible without it). Probing costs `steps` steps on the slower path
per cycle and bucket.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from nfabric_cli.substrate.cost import Verdict

LOWBIT, FP32 = "low-bit", "fp32"


@dataclass
class _Probe:
    start: int = 0  # the sighting its current cycle began at
    seen: int = 0  # sightings so far (one per step the bucket is reduced with low-bit routes)
    times: dict[str, list[float]] = field(default_factory=lambda: {LOWBIT: [], FP32: []})
    path: str | None = None  # the path its latest sighting was timed on (None: not timed)
    decision: Verdict | None = None


class MeasuredAdmission:
    """Probe cycles per bucket key (see the module docstring)."""

    def __init__(self, steps: int = 3, recheck_every: int = 500) -> None:
        if steps < 1 or recheck_every < 0:
            raise ValueError("probe steps must be >= 1 and recheck_every >= 0")
        self.steps = steps
        self.recheck_every = recheck_every
        self._probes: dict[tuple, _Probe] = {}

    def verdict(self, key: tuple) -> Verdict:
        """This step's path for the bucket `key` (called once per step it is reduced)."""
        p = self._probes.setdefault(key, _Probe())
        pos = p.seen - p.start
        if p.decision is not None and pos >= 2 * self.steps + self.recheck_every:
            p.start, pos = p.seen, 0  # probe again
            p.times = {LOWBIT: [], FP32: []}
        p.seen += 1
        if pos < self.steps:
            p.path = LOWBIT
            return Verdict("admit", f"probing low-bit ({pos + 1}/{self.steps})")
        if pos < 2 * self.steps:
            p.path = FP32
            return Verdict("fallback", f"probing fp32 ({pos + 1 - self.steps}/{self.steps})")
        p.path = None
        if p.decision is None:  # a probed step went untimed: keep the profile's routes
            return Verdict("admit", "probe incomplete: admitted as written")
        return p.decision

    def settled(self, key: tuple) -> Verdict | None:
        """The decision the next `verdict(key)` returns if it will not probe, else None."""
        p = self._probes.get(key)
        if p is None or p.decision is None:
            return None
        pos = p.seen - p.start
        return p.decision if 2 * self.steps <= pos < 2 * self.steps + self.recheck_every else None

    def timed(self, key: tuple) -> bool:
        """Whether the hook must time this step's reduce of `key` (it is probing)."""
        p = self._probes.get(key)
        return p is not None and p.path is not None

    def observe(self, key: tuple, seconds: float) -> tuple[str, str] | None:
        """Record a probed step's agreed time; at a cycle's end, decide and return the path
        chosen and why (the event), else None."""
        p = self._probes.get(key)
        if p is None or p.path is None:
            return None
        p.times[p.path].append(seconds)
        low, full = p.times[LOWBIT], p.times[FP32]
        if len(low) < self.steps or len(full) < self.steps:
            return None
        lo, fp = statistics.median(low), statistics.median(full)
        admit = lo < fp
        reason = (f"measured: low-bit {lo * 1e3:.2f} ms vs fp32 {fp * 1e3:.2f} ms (median of "
                  f"{self.steps} steps each)")
        p.decision = Verdict("admit" if admit else "fallback", reason, fp, lo)
        return (LOWBIT if admit else FP32), reason

    def state_dict(self) -> dict[str, Any]:
        return {"probes": [[list(names), phase, p.start, p.seen, p.times,
                            None if p.decision is None else list(p.decision)]
                           for (names, phase), p in self._probes.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._probes = {}
        for names, phase, start, seen, times, decision in state.get("probes", []):
            self._probes[(tuple(names), phase)] = _Probe(
                start, seen, {k: list(v) for k, v in times.items()}, None,
                None if decision is None else Verdict(*decision))
