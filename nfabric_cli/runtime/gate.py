"""`CapacityGate`: admit a low-bit route for a bucket only where it is predicted to pay.

The verdict is taken on the *actual* bucket (DDP rebuilds buckets after the first step, so
the compile-time plan is only a forecast), priced per reduce the hook issues for it (one group per
route, `routes/groups.py`) by the substrate's α-β cost model
(`substrate/cost.py`), as compile-profile and calibration price it. Without a substrate every
bucket is admitted as the profile wrote it.
Measured collective times can revoke an admission: if a bucket's low-bit reduction is seen
slower than the model's fp32 prediction by the margin for `revoke_after` consecutive steps,
that bucket falls back to fp32 (decided from all-reduced timings, so every rank agrees).
With ``measure=True`` and no substrate, the hook times whole steps on both paths instead and
keeps the faster (`probe.py`, opt-in); a step it sends low-bit is admitted as written here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nfabric_cli.runtime.probe import MeasuredAdmission
from nfabric_cli.substrate.cost import Verdict

if TYPE_CHECKING:
    from nfabric_cli.substrate.cost import BucketGroups


ADMIT_AS_WRITTEN = Verdict("admit", "no substrate: admitted as written")
ALL_FP32 = Verdict("admit", "all fp32")
MEASURED_LOWBIT = Verdict("admit", "measured: the step goes low-bit")


class CapacityGate:
    __slots__ = ("substrate", "world_size", "_cache", "_revoked", "_slow", "revoke_after", "enabled",
                 "measured")

    def __init__(
        self, substrate: Any | None, world_size: int, enabled: bool = True, revoke_after: int = 3,
        measure: bool = False,
    ) -> None:
        self.substrate = _as_substrate(substrate)
        # with no substrate to price buckets on, time them (opt-in: see probe.py)
        self.measured = MeasuredAdmission() if measure and self.substrate is None else None
        self.world_size = world_size
        self.enabled = enabled
        self.revoke_after = revoke_after
        self._cache: dict[tuple, Verdict] = {}
        self._revoked: dict[tuple, str] = {}
        self._slow: dict[tuple, int] = {}

    def verdict(self, key: tuple, groups: BucketGroups) -> Verdict:
        """Verdict for a bucket (key: its parameter names + phase), priced as `groups`: one
        (route, elements) pair per reduce the hook issues (`routes.groups.spec_numels`).
        The first verdict taken for a key is kept for the rest of the phase."""
        if not self.enabled or (self.substrate is None and self.measured is None):
            return ADMIT_AS_WRITTEN
        from nfabric_cli.substrate.cost import as_groups, bucket_verdict

        if self.measured is not None:  # the step's path was measured (`probe.py`)
            return MEASURED_LOWBIT if _lowbit(as_groups(groups)) else ALL_FP32
        if key in self._revoked:
            return Verdict("fallback", self._revoked[key])
        cached = self._cache.get(key)
        if cached is None:
            pairs = as_groups(groups)
            cached = (bucket_verdict(self.substrate, pairs, self.world_size) if _lowbit(pairs)
                      else ALL_FP32)
            self._cache[key] = cached
        return cached

    def refuses(self, key: tuple) -> bool:
        """Whether the next verdict for bucket `key` is known already to be fp32 (a cached or
        revoked model verdict): the hook can then send the bucket as plain DDP would, with
        nothing to time. (The measured gate decides whole steps: `probe.py`.)"""
        if not self.enabled or self.measured is not None:
            return False
        cached = self._cache.get(key)
        return key in self._revoked or (cached is not None and not cached.admit)

    def decided(self) -> dict[tuple, Verdict]:
        """Every verdict taken so far, by bucket key (revocations are in the events log)."""
        return dict(self._cache)

    def state_dict(self) -> dict[str, Any]:
        """Verdicts taken, revocations and slow-step counts, by bucket key (JSON-able)."""
        def rows(d: dict[tuple, Any]) -> list[list[Any]]:
            return [[list(names), phase, value] for (names, phase), value in d.items()]

        cache = {k: list(v) for k, v in self._cache.items()}
        out = {"cache": rows(cache), "revoked": rows(self._revoked), "slow": rows(self._slow)}
        if self.measured is not None:
            out["measured"] = self.measured.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        def keyed(rows: list[list[Any]]) -> dict[tuple, Any]:
            return {(tuple(names), phase): value for names, phase, value in rows}

        self._cache = {k: _verdict(*v) for k, v in keyed(state["cache"]).items()}
        self._revoked = keyed(state["revoked"])
        self._slow = keyed(state["slow"])
        if self.measured is not None and "measured" in state:
            self.measured.load_state_dict(state["measured"])

    def observe(self, key: tuple, measured_lowbit_s: float) -> str | None:
        """Feed a measured low-bit time (the mean over ranks); return a reason when revoking."""
        v = self._cache.get(key)
        if v is None or not v.admit or v.fp32_time_s is None or key in self._revoked:
            return None
        margin = getattr(self.substrate, "margin", 0.1)
        if measured_lowbit_s > v.fp32_time_s * (1 + margin):
            self._slow[key] = self._slow.get(key, 0) + 1
        else:
            self._slow[key] = 0
        if self._slow[key] >= self.revoke_after:
            reason = (
                f"revoked: measured {measured_lowbit_s * 1e3:.2f} ms > predicted fp32 "
                f"{v.fp32_time_s * 1e3:.2f} ms for {self.revoke_after} steps"
            )
            self._revoked[key] = reason
            return reason
        return None


def _lowbit(pairs: Any) -> bool:
    return any(spec.lowbit for spec, _ in pairs)


def _verdict(verdict: str | bool, reason: str, fp32_s: float | None, low_s: float | None) -> Verdict:
    """A saved verdict (states saved before the verdicts were unified hold admit as a bool)."""
    if isinstance(verdict, bool):
        verdict = "admit" if verdict else "fallback"
    return Verdict(verdict, reason, fp32_s, low_s)


def _as_substrate(substrate: Any | None) -> Any | None:
    from nfabric_cli.substrate.model import as_substrate

    return as_substrate(substrate, source="profile substrate")
