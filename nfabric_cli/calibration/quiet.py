"""The health monitor's loss-spike floor, raised until the fp32 reference is quiet.

A healthy run's losses may spike on their own. A classifier that nearly fits its data
(scikit-learn's breast-cancer MLP, batches of 16) sits at a loss of a few hundredths, and one
hard batch reads 8-12x that median, at 10-13 robust deviations. On that run, with nothing
compressed, the default floor (a spike must also reach 0.25x the run's early loss) let five of
these spikes through in 150 steps. On a profile the same spikes trip every scope to fp32 and pin
it: 40-85 % of fp32's bytes at 2x and 4x the length, against 5-9 % planned.

`calibrate` runs its fp32 references (the search's, and one per confirmation cell: other
seeds, lengths and world sizes) before the search, with the detectors passive. Where they
report loss spikes, the floor is raised above the highest of them, with a margin (`MARGIN`), up
to the early loss itself (`CAP`: beyond that a spike is the loss climbing back past where
training started). The references are shared by every worker of a study, and so is the floor
they set: the search, the confirmation and the profile's `health` all use it. A floor given in
the spec is kept, and false spikes beside it are only reported.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from nfabric_cli.profile.thresholds import HealthThresholds
from nfabric_cli.runtime.health import SPIKE

#: The raised floor: this much above the highest spike the fp32 reference showed.
MARGIN = 1.25
#: No higher than the early loss itself.
CAP = 1.0


def spike_heights(detections: Sequence[tuple[int, str, str]], losses: Sequence[float],
                  early_loss: float | None) -> list[tuple[int, float]]:
    """(step, loss / early loss) of every loss spike the detectors gave."""
    if not early_loss or early_loss <= 0:
        return []
    return [(step, losses[step] / early_loss) for step, scope, reason in detections
            if reason.startswith(SPIKE) and step < len(losses) and math.isfinite(losses[step])]


def spikes_of(result: Any) -> list[tuple[int, float]]:
    """`spike_heights` of a passive simulated run (a `SimResult`)."""
    return spike_heights(result.detections, result.losses, result.early_loss)


def quiet_floor(heights: Sequence[tuple[int, float]], health: Mapping[str, Any]
                ) -> tuple[dict[str, float], str | None]:
    """The thresholds to change (`loss_spike_floor`, or none) and a note saying why, for the
    spikes `heights` of a healthy fp32 run under `health` (the spec's thresholds)."""
    if not heights:
        return {}, None
    current = HealthThresholds.from_dict(dict(health)).loss_spike_floor
    top = max(h for _, h in heights)
    steps = ", ".join(str(s) for s, _ in heights[:5]) + (", ..." if len(heights) > 5 else "")
    seen = (f"the fp32 references' own losses spiked {len(heights)} time(s) (steps {steps}; "
            f"up to {top:.2f}x the early loss)")
    if "loss_spike_floor" in health:
        return {}, f"warning: {seen}, above the spec's loss_spike_floor {current:g}: these " \
                   "would trip a profile to fp32 on a healthy run"
    floor = min(CAP, math.ceil(MARGIN * top * 100) / 100)
    if floor <= current:
        return {}, None
    note = f"health: loss_spike_floor {current:g} -> {floor:g}: {seen}"
    if floor < MARGIN * top:
        note += f"; capped at {CAP:g}x the early loss, so some would still trip"
    return {"loss_spike_floor": floor}, note
