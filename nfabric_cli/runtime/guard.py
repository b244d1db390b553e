"""`UpdateGuard`: while the health monitor holds a scope, its update keeps the magnitude it had.

Why: a low-bit route bounds what it delivers (`sign` sends at most the chunk's mean |g| per
element: an implicit clip), so the moment the monitor switches a scope to FP32, mid-spike, is
the moment the raw heavy-tailed gradient would reach the optimizer. Measured on `vision`
(seed 0, W = 4, 300 steps): the fp32-reduced gradient at the spike had norm 9.6 against
sign's 6.5; momentum carried it on and the run ended at 0.794 accuracy against 0.983 with no
monitor at all. Holding the update norm of a held scope to twice its recent median (the
updates it delivered while healthy) ends that run at 0.992 (see docs/health.md).

The rule, per scope and step, on the reduced gradient (identical on every rank, so is the
decision):
- the scope is held (tripped this step, cooling down, on probation or pinned) and its window
  holds at least `min_history` norms: the update is scaled down to ``update_cap * median``
  when larger (never up; the default cap, 2, sits above the healthy updates' own spread, so
  an ordinary update passes and a spike does not); on the step a blow-up is detected in the
  scope, to ``blowup_cap * median`` instead (1: about one healthy update; 0: ``update_cap``);
- otherwise the step's update norm joins the scope's window (a skipped, non-finite step's
  never does), so the median is always that of healthy, profile-routed updates.
- a scope *ramped* (its route changed at a phase boundary, or the capacity gate switched its
  wire: `StepController`) and not held is scaled down to ``update_cap * median`` the same
  way, and what it delivered joins its window: the cap rises with the delivered updates, at
  most doubling each half window; the controller closes the ramp once `window` steps in a
  row capped nothing. Why: a model
  trained on `sign` and then sent the raw fp32 gradient takes steps its weights are not
  shaped for. Simulated, `vision.v13` on seeds 10-19 at 600 steps, two ranks, no monitor:
  15 steps of every parameter on fp32 (nothing wrong) from step 200 cost up to 11.9 points,
  from step 300 up to 13.9, against the same seeds without them (docs/health.md, "Route
  changes ramp"). A ramp to a full-precision wire also clips each element of the update
  (`StepController._clips`; not here: the guard sees norms only), since a norm within the cap
  still broke that model when its elements were heavy-tailed (docs/health.md, "The gate's
  switches ramp").

Pure and deterministic like `HealthMonitor`; nothing here talks to a process group.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Held:
    """One scope's update scaled down at one step."""

    scope: str
    factor: float  # what the update was multiplied by (< 1)
    norm: float  # its norm before
    cap: float  # the norm it was held to
    multiple: float  # cap / the median of the scope's healthy updates


class UpdateGuard:
    """Per-scope windows of healthy update norms; see the module docstring."""

    def __init__(self, scopes: Iterable[str], window: int, min_history: int, cap: float,
                 blowup_cap: float = 0.0) -> None:
        self.cap = float(cap)
        self.blowup_cap = float(blowup_cap) or self.cap  # 0: a blow-up's step at `cap` too
        self.min_history = int(min_history)
        self._windows: dict[str, deque[float]] = {s: deque(maxlen=window) for s in scopes}

    def judge(
        self, norms: Mapping[str, float], held: Iterable[str], skipped: bool,
        blowups: Iterable[str] = (), ramped: Iterable[str] = (),
    ) -> list[Held]:
        """The scale-downs for one step's update norms (per scope) given the held scopes,
        those a blow-up was detected in this step (held at `blowup_cap`) and the ramped ones
        (see the module doc); records the healthy norms, and the ramped scopes' delivered
        ones. Returns one `Held` per scope scaled, in scope order."""
        if skipped:
            return []
        held, blowups, ramped = set(held), set(blowups), set(ramped)
        out = []
        for scope, window in self._windows.items():
            norm = norms.get(scope)
            if norm is None or not math.isfinite(norm):
                continue
            if scope in held or scope in ramped:
                multiple = self.blowup_cap if scope in blowups else self.cap
                h = None
                if self.cap > 0 and len(window) >= self.min_history:
                    cap = multiple * statistics.median(window)
                    if norm > cap > 0:
                        h = Held(scope, cap / norm, norm, cap, multiple)
                        out.append(h)
                if scope in held:  # a held update never enters the window; a ramped one's
                    continue       # delivery does (so its cap rises)
                norm = norm if h is None else h.cap
            window.append(float(norm))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"windows": {s: list(w) for s, w in self._windows.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for scope, values in state["windows"].items():
            self._windows[scope].clear()
            self._windows[scope].extend(values)
