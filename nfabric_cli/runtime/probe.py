"""Measured admission: with no substrate to price it, time whole steps on both paths, keep the faster.

The capacity gate prices buckets on a fitted substrate (`substrate/cost.py`); without one it
admits every bucket as the profile wrote it, however slow low-bit is on the link at hand.
With ``gate="measure"`` (`attach`, `validate --gate measure`) and no substrate, each phase with
a low-bit route runs a *probe cycle*: `warmup` steps as written (untimed: first steps pay for
allocation and DDP's bucket rebuild), then `2 * steps` steps alternating between the profile's
routes and plain DDP's fp32 path, each step's period (first bucket to next step's first
bucket) timed. At the next step's first bucket the ranks all-reduce their medians (one small
blocking all-reduce per cycle, while nothing else is in flight), so every rank takes the same
decision; the phase then keeps the faster path until `recheck_every` more steps have passed,
and probes again. Every decision is an event with both medians.

Why whole steps and not the buckets' own reduce times (what this probed first): a low-bit
step also pays for the step's statistics round, the worker thread's hand-offs and the gradient
norms, and its reduce no longer overlaps backward as fp32's all-reduce does. On vision over
unshaped loopback the bucket timings said low-bit 3.4 ms against fp32 5.8 ms while the step was
1.24x slower on low-bit (`python -m bench.validate_link`, docs/capacity.md).

Opt-in, not the default: a decision from wall-clock times differs from run to run, so
calibration cannot predict it and one seed no longer fixes a run (`validate` and the
simulator stay bit-reproducible without it). Probing costs `steps` steps on the slower path
per cycle.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

LOWBIT, FP32 = "low-bit", "fp32"


@dataclass
class _Cycle:
    start: int = 0  # the phase step its current cycle began at
    seen: int = 0  # steps of the phase so far
    times: dict[str, list[float]] = field(default_factory=lambda: {LOWBIT: [], FP32: []})
    decision: str | None = None  # the path kept (None: not decided yet)
    reason: str = ""


class MeasuredAdmission:
    """Probe cycles per phase (see the module docstring). Drive it at each step's first bucket:
    `record` the previous step's period, `due` / `decide` a finished cycle on agreed medians,
    then `path` for this step."""

    def __init__(self, steps: int = 4, recheck_every: int = 500, warmup: int = 2) -> None:
        if steps < 1 or recheck_every < 0 or warmup < 0:
            raise ValueError("probe steps must be >= 1, recheck_every and warmup >= 0")
        self.steps, self.recheck_every, self.warmup = steps, recheck_every, warmup
        self._cycles: dict[str, _Cycle] = {}

    @property
    def _probe_end(self) -> int:
        return self.warmup + 2 * self.steps

    def path(self, phase: str) -> tuple[str, bool]:
        """This step's path in `phase` and whether its period is to be timed (one call per
        step of the phase)."""
        c = self._cycles.setdefault(phase, _Cycle())
        pos = c.seen - c.start
        if c.decision is not None and pos >= self._probe_end + self.recheck_every:
            c.start, pos = c.seen, 0  # probe again
            c.times, c.decision, c.reason = {LOWBIT: [], FP32: []}, None, ""
        c.seen += 1
        if pos < self.warmup:
            return LOWBIT, False
        if pos < self._probe_end:
            return (LOWBIT if (pos - self.warmup) % 2 == 0 else FP32), True
        return c.decision or LOWBIT, False  # undecided (a resumed cycle lost its times): as written

    def record(self, phase: str, path: str, seconds: float) -> None:
        """A timed step's period (measured on this rank)."""
        self._cycles[phase].times[path].append(seconds)

    def due(self, phase: str) -> tuple[float, float] | None:
        """(low-bit, fp32) local medians when `phase`'s cycle has probed its last step and not
        been decided, else None. The same on every rank (it depends on step counts only)."""
        c = self._cycles.get(phase)
        if c is None or c.seen - c.start != self._probe_end or c.decision is not None:
            return None
        low, full = c.times[LOWBIT], c.times[FP32]
        if not low or not full:
            return None
        return statistics.median(low), statistics.median(full)

    def decide(self, phase: str, lowbit_s: float, fp32_s: float) -> tuple[str, str]:
        """Take the decision on agreed medians; returns (path kept, why) for the event."""
        c = self._cycles[phase]
        c.decision = LOWBIT if lowbit_s < fp32_s else FP32
        n = min(len(c.times[LOWBIT]), len(c.times[FP32]))
        c.reason = (f"measured step: low-bit {lowbit_s * 1e3:.2f} ms vs fp32 {fp32_s * 1e3:.2f} "
                    f"ms (median of {n} steps each, mean over ranks)")
        return c.decision, c.reason

    def decision(self, phase: str) -> str | None:
        """The path `phase` keeps between probes (None: not decided yet)."""
        c = self._cycles.get(phase)
        return None if c is None else c.decision

    def state_dict(self) -> dict[str, Any]:
        return {"cycles": {phase: [c.start, c.seen, c.times, c.decision, c.reason]
                           for phase, c in self._cycles.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._cycles = {}
        for phase, (start, seen, times, decision, reason) in state.get("cycles", {}).items():
            self._cycles[phase] = _Cycle(start, seen, {k: list(v) for k, v in times.items()},
                                         decision, reason)
