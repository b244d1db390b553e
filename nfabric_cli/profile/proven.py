"""Where a profile was proven, and whether a run lies outside it.

`nfabric calibrate` records in `meta["proven"]` the seeds, run lengths and world sizes its
winner was shown within tolerance on (the search's own run and every confirmation cell,
`calibration/choice.py`). A profile calibrated before that record existed was proven on its
provenance's one seed at its budget's one length. A hand-written profile (`profile init`) has
neither, and nothing is compared; nor has a calibrated profile that is all fp32 because no
low-bit candidate held (``{"fp32": true}``: it is the reference, there is nothing to prove).

Outside that range a profile may still be right, but nothing measured says so: `validate`
reports it beside its verdict and `attach` warns, so the user knows which claims were tested.
Lengths count as covered between the shortest and the longest proven (phases are fractions
of the run); seeds and world sizes only where proven (a profile written before
`world_sizes` was recorded names its one `world_size`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nfabric_cli.profile.provenance import calibrated


@dataclass(frozen=True)
class ProvenRange:
    seeds: tuple[int, ...]
    steps: tuple[int, ...]
    world_sizes: tuple[int, ...]  # (): not recorded
    recorded: bool  # False: read from an older profile's provenance (one seed, one length)

    def describe(self) -> str:
        seeds = ", ".join(str(s) for s in self.seeds)
        steps = ", ".join(str(n) for n in self.steps)
        plural = "s" if len(self.world_sizes) > 1 else ""
        ws = (f", world size{plural} {', '.join(map(str, self.world_sizes))}"
              if self.world_sizes else "")
        how = "" if self.recorded else " (calibrated before confirmation was recorded)"
        return (f"seed{'s' if len(self.seeds) > 1 else ''} {seeds} at {steps} steps{ws}"
                f"{how}")


def proven_range(meta: dict[str, Any]) -> ProvenRange | None:
    """The range a profile's metadata records, or None when it records none."""
    proven = meta.get("proven")
    if isinstance(proven, dict) and proven.get("fp32"):
        return None
    if isinstance(proven, dict) and proven.get("seeds") and proven.get("steps"):
        worlds = proven.get("world_sizes") or (
            [proven["world_size"]] if proven.get("world_size") is not None else [])
        return ProvenRange(tuple(int(s) for s in proven["seeds"]),
                           tuple(int(n) for n in proven["steps"]),
                           tuple(int(w) for w in worlds), True)
    prov = meta.get("provenance") or {}
    budget = prov.get("budget") or {}
    if not calibrated(meta) or prov.get("seed") is None or not budget.get("steps"):
        return None
    world = meta.get("world_size")
    return ProvenRange((int(prov["seed"]),), (int(budget["steps"]),),
                       () if world is None else (int(world),), False)


def calibrated_steps(meta: dict[str, Any]) -> int | None:
    """The shortest run length the profile was proven at (its calibration's own, as a rule),
    or None when it records none: `validate`'s default length, so that the default run is one
    calibration vouches for."""
    rng = proven_range(meta)
    return min(rng.steps) if rng is not None else None


def outside_proven(meta: dict[str, Any], *, seeds: list[int] | None = None,
                   steps: int | None = None, world_size: int | None = None) -> list[str]:
    """One sentence per way the run (its seeds, length, world size) leaves the profile's
    proven range; [] when inside it or when the profile records no range."""
    rng = proven_range(meta)
    if rng is None:
        return []
    out = []
    new = [s for s in (seeds or []) if s not in rng.seeds]
    if new:
        out.append(f"seed{'s' if len(new) > 1 else ''} {', '.join(map(str, new))}")
    if steps is not None and not min(rng.steps) <= steps <= max(rng.steps):
        out.append(f"{steps} steps")
    if world_size is not None and rng.world_sizes and world_size not in rng.world_sizes:
        out.append(f"world size {world_size}")
    if not out:
        return []
    return [f"the profile was proven on {rng.describe()}; outside that range here: "
            f"{', '.join(out)} (a result there is not covered by calibration)"]


def thin_margin(meta: dict[str, Any], seeds: list[int], tolerance: float) -> list[str]:
    """One sentence when the profile's proof leaves no room for the worst of this run's new
    seeds (those it was not proven on): the 95 % bound for the worst of that many
    (`target.validation_bound`, over the recorded cells) is past `tolerance` (the run's: the
    profile's unless `--tolerance` says otherwise), so one of them may well miss (`lm.v11`:
    five new seeds, bound +0.0621 against 0.05; one missed at +0.0535). [] when the bound is
    within it, or the profile records no finite cells to bound with (hand-written)."""
    import math

    from nfabric_cli.profile.target import validation_bound, within_tolerance

    rng, proven = proven_range(meta), meta.get("proven")
    new = [s for s in seeds if rng is None or s not in rng.seeds]
    cells = proven.get("cells") if isinstance(proven, dict) else None
    if rng is None or not new or not isinstance(cells, list):
        return []
    degrs = [c.get("degradation") for c in cells if isinstance(c, dict)]
    degrs = [float(d) for d in degrs if isinstance(d, (int, float)) and math.isfinite(d)]
    bound = validation_bound(degrs, len(new)) if len(degrs) == len(cells) else None
    if bound is None or within_tolerance(bound, tolerance):
        return []
    many = f"the worst of {len(new)} new seeds" if len(new) > 1 else "a new seed"
    return [f"the profile's proof leaves no room for {many}: its {len(degrs)} cells bound it at "
            f"{bound:+.4g} (95 %) against a tolerance of {tolerance:g}, so a seed may miss "
            "(calibrate's validate rule asks for that room: docs/calibration.md, 'The rule')"]


def other_host(meta: dict[str, Any], here: dict[str, str]) -> list[str]:
    """One sentence when the profile was calibrated on another CPU than `here`
    (`provenance.host`, what both name): its proven cells may not replay here bit for bit,
    each is then in effect another seed; [] when they agree, or the profile does not say
    (made before this was recorded). The host is the one that wrote the profile: cells a
    study's other workers or an earlier run on another machine measured are not told apart."""
    from nfabric_cli.profile.provenance import calibrated

    if not calibrated(meta):  # (hand-written: nothing was measured anywhere)
        return []
    recorded = meta["provenance"].get("host")
    if not isinstance(recorded, dict):
        return []
    # what both name (a key added later, or a CPU model one side could not read, is no
    # difference)
    both = [k for k, v in here.items() if v and recorded.get(k)]
    if all(recorded[k] == here[k] for k in both):
        return []

    def said(h: dict) -> str:
        return f"{h.get('cpu') or '?'}, {h.get('machine') or '?'} {h.get('kernels') or '?'}"

    return [f"the profile was calibrated on another CPU or kernel level ({said(recorded)}; here "
            f"{said(here)}): float results may differ in their last bits from one to the "
            "other, so its proven cells may not replay here exactly, each one then in effect a "
            "new seed"]


def other_data(meta: dict[str, Any], fingerprint: str | None) -> list[str]:
    """One sentence when the profile was calibrated on other data than `fingerprint` (the
    workload's here: another `--data-dir`, or data built with other bits, as the glyph images
    on another CPU); [] when they agree or either is unknown."""
    provenance = meta.get("provenance")
    recorded = provenance.get("data_fingerprint") if isinstance(provenance, dict) else None
    if not recorded or not fingerprint or recorded == fingerprint:
        return []
    return [f"the profile was calibrated on other data (fingerprint {recorded[:12]}, here "
            f"{fingerprint[:12]}): a result here is not the one calibration measured"]
