"""Measured admission: with no substrate to price it, time whole steps on both paths, keep the faster.

The capacity gate prices buckets on a fitted substrate (`substrate/cost.py`); without one it
admits every bucket as the profile wrote it, however slow low-bit is on the link at hand.
With ``gate="measure"`` (`attach`, `validate --gate measure`) and no substrate, each phase
with a low-bit route runs a *probe cycle* (phases that route every parameter alike share
one: vision.v5's warm-up and main phase are timed once, not at a slow-path step each):
`warmup` steps as written, then up to `steps` pairs of steps (then blocks on a close call,
below), one on the profile's routes and one on plain DDP's fp32 path, each step's period
(first bucket to next step's first bucket) timed. After each pair, at the next step's first
bucket, the ranks all-reduce each path's fastest period so far (one small blocking
all-reduce, while nothing else is in flight; not counted in any period: every timed period
starts after such a round, see `FabricState._measured_path`) and every rank takes the same
decision: keep the faster path once one is `decisive` times the
other (a slow link: one pair, not four, of slow fp32 steps) or after the last pair, else
probe on. `decisive` is 2: at 1.5 a single step of a 4-8 ms step's ordinary jitter (one fp32
step at 8.9 ms beside a low-bit one at 5.5) chose low-bit for 500 steps on a model where it
was 1.3x slower; slow links are 2.5x (100 Mbit/s) to 11x (20 Mbit/s) apart.
The phase keeps its path until `recheck_every` more steps have passed, and probes again.
Every decision is an event with both times.

Which times: before the last pair, each path's *fastest* sample, the warm-up steps' low-bit
periods included; after it, the *medians* of the pairs' samples. A period also holds whatever
the training loop did between two steps, and a loop that pauses there (an evaluation, a
checkpoint, a slow batch) makes that one sample long. On medians alone, one pair 2x apart
decided by its two samples, so a pause in the timed low-bit step would have kept fp32 for 500
steps on a slow link where low-bit is up to 11x faster. A pause only ever adds time, so the
fastest sample ignores it, and the warm-up steps, which run the profile's routes anyway, add
low-bit samples for free (the first ones, slowed by allocation and DDP's bucket rebuild, are
ignored the same way). A close call is judged on medians of equal counts: the fastest of six
low-bit samples against the fastest of four fp32 ones favours low-bit by the count alone, and
kept it at 1000 Mbit/s where it was 1.13x slower (`bench.link_paired`, 13.06 vs 13.82 ms).
A pause in the one fp32 sample of a slow-link pair cannot mislead (fp32 only looks slower
there); on a fast link it can make low-bit look 2x faster and keep it, 1.1-1.3x slower there,
until the re-check.

A close call probes longer, in blocks: when the `steps`-th pair's medians are within `close`
(1.15x), the cycle probes on in `close_blocks` (3) pairs of `block` (4) steps a path, an event
of its own, and decides on the medians of the blocks' samples (two blocks `decisive` times
apart on the fastest samples still end it early). Near the crossover a probe step on the
slower path costs little (at most 15 % of a step), while four samples a path decide badly:
transformer.v5 at 500 Mbit/s, where static was 6 % faster than fp32 over the run, measured
24.73 against 21.97 ms on four steps each and kept fp32 for the run (`bench.link_paired`,
profile 1.147x min(fp32, static)). Why blocks: every single-step sample starts at a round with
the ranks in step, which no step of a run of that path does; over 29 decisions of twelve
single-step pairs the probe's fp32 median read 0.913x the fp32 arm's steps of the same rounds
and its low-bit median 0.976x static's, enough to keep the wrong path within a few per cent. A
block starts at a round and its other steps run on, as a run of the path would. A block's
sample is the *median* of its steps' periods: a mean let one paused step (the bench's other
arms, between two of its rounds) make a block 607 ms long and decide fp32 on it.

A close decision stands for less: decided within `close`, it is re-checked after
`close_recheck` (100) steps, not `recheck_every`, then after 200, 400, ... while the calls stay
close, on `close_blocks` pairs of blocks from the start (the warm-up steps untimed): four pairs
of a noisy stretch can read 1.4x where the paths are within a few per cent, and a decision
beyond `close` stands the full `recheck_every` (two pairs of blocks `decisive` times apart
still end it early, so a link that changed is seen; one does not, as one paused sample could).
Its medians pool its blocks with the last check's (that check was close, or there would be no
re-check): twelve pairs of one stretch read 1.18x at 1000 Mbit/s (transformer.v6, low-bit 10.94
against fp32 12.92 ms) and kept low-bit for 500 steps, where fp32 was 4 % faster over the run;
two stretches a hundred steps and more apart share less of the host's noise. The pool is two
checks deep, so a lasting change under 2x takes over at the second re-check. The
first cycle runs in a run's first steps, the noisiest there are: transformer.v6 at 500 Mbit/s,
where static was 8 % faster than fp32 over the run, measured low-bit 25.40 against 23.15 ms
on twelve pairs at step 74 and kept fp32 until step 600 (profile 1.096x static, 40 rounds,
session 37). A re-check costs at most `close_blocks` x `block` steps on a path within 15 % of
the other.

A re-check's cost: on a clear call it times one step on the slower path, the cost of
(ratio - 1) steps on the faster one. A decision `ratio` apart therefore stands `recheck_every`
x (ratio - 1) / (`decisive` - 1) steps, at least `recheck_every` and at most `stretch` (8)
times it: at the threshold (2x) one probe step costs one step in 500, as before; on
transformer.v6 at 50 Mbit/s (fp32 130 ms, low-bit 7.7 ms, 17x) the re-check at step 555 cost
as much as 16 low-bit steps, 2 % of an 800-step run, to confirm what a 17x gap had said.
And a phase's first cycle starts with the fastest fp32 step of the cycle decided last (plain
DDP's path is the same in every phase): if its first low-bit steps are `decisive` times
faster or slower than that, it decides without an fp32 step of its own; otherwise it probes
as usual. transformer.v6's int8 warm-up and sign main phase are two cycles: the second one's
fp32 step was the other 130 ms of the three the gate spent at 50 Mbit/s. A re-check always
times both paths itself.

Why whole steps and not the buckets' own reduce times (what this probed first): a low-bit
step also pays for the step's statistics round, any thread hand-offs and the gradient
norms, and its reduce no longer overlaps backward as fp32's all-reduce does. On vision over
unshaped loopback the bucket timings said low-bit 3.4 ms against fp32 5.8 ms while the step was
1.24x slower on low-bit (`python -m bench.validate_link`, docs/capacity.md).

The steps a probe or a decision sends on fp32 after low-bit ones are ramped, and back
(`StepController.refused`): on a model trained on `sign`, 4-step fp32 blocks tripped the
monitor on the step after a block in 7 of 10 seeds (vision.v13, the probe blocks simulated)
until each element of those updates was clipped (docs/health.md, "The gate's switches ramp").
The clip's time is left out of the step's period (`FabricState._scale`: 0.3x a 47M-parameter
model's compute, `bench.ramp_cost`); the update norms a ramped plain-DDP step reads stay in it
(they share its finiteness check's host read), slightly against fp32 in a close call.

Opt-in, not the default: a decision from wall-clock times differs from run to run, so
calibration cannot predict it and one seed no longer fixes a run (`validate` and the
simulator stay bit-reproducible without it). Probing costs 1 to `steps` steps on the slower
path per cycle, `steps` + `close_blocks` x `block` on a close call (and the `warmup` steps,
which run low-bit), none for a new phase decided on the carried fp32 time.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, NamedTuple

LOWBIT, FP32 = "low-bit", "fp32"
PROBE_ON = "probe on"  # `decide`'s verdict when a close call extends the cycle
WARMUP = "warm-up"  # the low-bit periods of a cycle's warm-up steps
VERSION = 2  # `state_dict`'s layout: 2 since cycles sample blocks (older cycles probe again)


def _no_times() -> dict[str, list[float]]:
    return {LOWBIT: [], FP32: [], WARMUP: []}


class ProbeStep(NamedTuple):
    """A step's path, whether its period is timed, and whether a timed period starts at a
    round (every single step and every block's first; a block's other steps run on)."""

    path: str
    timed: bool
    fresh: bool


@dataclass
class _Cycle:
    start: int = 0  # the phase step its current cycle began at
    seen: int = 0  # steps of the phase so far
    decided_at: int = 0  # the phase step its decision was taken at
    times: dict[str, list[float]] = field(default_factory=_no_times)
    decision: str | None = None  # the path kept (None: not decided yet)
    reason: str = ""
    # the cycle position its blocks begin at (None: single steps): a close call's or a
    # re-check after one; its samples are then the blocks' median periods
    blocks_from: int | None = None
    close_calls: int = 0  # decisions in a row taken within `close`: re-checked sooner
    # a re-check after a close call: the last check's block samples, pooled into its medians
    prior: dict[str, list[float]] = field(default_factory=dict)
    ratio: float = 1.0  # the slower path's time over the faster's, as last decided
    block: list[float] = field(default_factory=list)  # the periods of the block in progress
    # a new phase's first cycle: the fastest fp32 period of the cycle decided last, if any
    # (plain DDP's path is the same in every phase; not saved: a resumed cycle times its own)
    carried: float | None = None


class MeasuredAdmission:
    """Probe cycles, keyed by the name the hook passes as `phase`: the first of the phases
    routed alike (see the module docstring). Drive it at each step's first bucket:
    `record` the previous step's period, `due` / `decide` a finished cycle on agreed times,
    then `path` for this step."""

    def __init__(self, steps: int = 4, recheck_every: int = 500, warmup: int = 2,
                 decisive: float = 2.0, close: float = 1.15, block: int = 4,
                 close_blocks: int = 3, close_recheck: int = 100, stretch: float = 8.0) -> None:
        if (steps < 1 or recheck_every < 0 or warmup < 0 or not 1 <= close <= decisive
                or block < 1 or close_blocks < 1 or close_recheck < 0 or stretch < 1):
            raise ValueError("probe steps, block and close_blocks must be >= 1, recheck_every, "
                             "close_recheck and warmup >= 0, 1 <= close <= decisive, "
                             "stretch >= 1")
        self.steps, self.recheck_every, self.warmup = steps, recheck_every, warmup
        self.decisive, self.close, self.block = decisive, close, block
        self.close_blocks, self.close_recheck, self.stretch = close_blocks, close_recheck, stretch
        self._cycles: dict[str, _Cycle] = {}
        self._last_fp32: float | None = None  # the fastest fp32 period of the last decision

    def _end(self, c: _Cycle) -> int:
        """The cycle position its last pair ends at."""
        if c.blocks_from is None:
            return self.warmup + 2 * self.steps
        return c.blocks_from + 2 * self.block * self.close_blocks

    def _recheck(self, c: _Cycle) -> int:
        """Steps a decision stands: `recheck_every`, longer the further apart the paths were
        (module docstring, "A re-check's cost"); after a close call `close_recheck`,
        doubling with each close call in a row, up to `recheck_every`."""
        if not c.close_calls:
            far = (c.ratio - 1) / (self.decisive - 1) if self.decisive > 1 else 1.0
            return round(self.recheck_every * min(self.stretch, max(1.0, far)))
        return min(self.recheck_every, self.close_recheck << (c.close_calls - 1))

    def _restart(self, c: _Cycle) -> None:
        """Begin a cycle at this step: on blocks from the warm-up's end after a close call."""
        c.start, c.times, c.decision, c.reason = c.seen, _no_times(), None, ""
        c.blocks_from, c.block = (self.warmup if c.close_calls else None), []

    def _rechecking(self, c: _Cycle) -> bool:
        """Whether a decided cycle's decision has stood its time: the next step re-checks."""
        return c.decision is not None and c.seen - c.decided_at >= self._recheck(c)

    def probing(self, phase: str) -> bool:
        """Whether `phase`'s next step would be a probe's (no decision yet, or its re-check
        due): a step the caller cannot time as the path it names waits instead (`FabricState`
        while the monitor holds every low-bit scope), leaving the cycle where it is."""
        c = self._cycles.get(phase)
        return c is None or c.decision is None or self._rechecking(c)

    def path(self, phase: str) -> ProbeStep:
        """This step's path and how it is timed (one call per step of the phase)."""
        c = self._cycles.get(phase)
        if c is None:
            c = self._cycles[phase] = _Cycle(carried=self._last_fp32)
        if self._rechecking(c):
            # probe again; after a close call on blocks, pooled with the last check's
            c.prior = {k: c.times[k] for k in (LOWBIT, FP32)} if c.close_calls else {}
            self._restart(c)
        elif c.decision is None and c.seen - c.start >= self._end(c):
            self._restart(c)  # undecided at its end: a resumed cycle lost its times
        pos = c.seen - c.start
        c.seen += 1
        if c.decision is not None:
            return ProbeStep(c.decision, False, False)
        if c.blocks_from is not None and pos >= c.blocks_from:
            k = pos - c.blocks_from
            return ProbeStep(FP32 if k // self.block % 2 else LOWBIT, True, k % self.block == 0)
        if pos < self.warmup:  # more low-bit samples (module docstring); none beside blocks
            timed = c.blocks_from is None
            return ProbeStep(LOWBIT, timed, timed)
        return ProbeStep(FP32 if (pos - self.warmup) % 2 else LOWBIT, True, True)

    def record(self, phase: str, path: str, seconds: float) -> None:
        """A timed step's period (measured on this rank), called before the next step's
        `path`: so the recorded step is the cycle's last, and a warm-up one is told apart. A
        block's sample is its steps' median period, taken at its last step."""
        c = self._cycles[phase]
        pos = c.seen - 1 - c.start
        if c.blocks_from is None or pos < c.blocks_from:
            c.times[WARMUP if pos < self.warmup else path].append(seconds)
            return
        k = (pos - c.blocks_from) % self.block
        if k == 0:  # a block's first step (after a resume, the block holds the steps since)
            c.block = []
        c.block.append(seconds)
        if k == self.block - 1:
            c.times[path].append(statistics.median(c.block))
            c.block = []

    def _paired(self, c: _Cycle, pos: int) -> bool:
        """Whether a pair (of steps, or of blocks) ended at the step before cycle position
        `pos`."""
        first, width = ((self.warmup, 2) if c.blocks_from is None
                        else (c.blocks_from, 2 * self.block))
        return first < pos <= self._end(c) and (pos - first) % width == 0

    def due(self, phase: str) -> tuple[float, float] | None:
        """(low-bit, fp32) local times when `phase`'s cycle has just probed a pair and is
        undecided, else None: after the last pair the medians of the pairs' samples (a
        re-check's pooled with the last check's), before it each path's fastest sample, the
        warm-up's included (module docstring). The same on every rank (it depends on step
        counts only)."""
        c = self._cycles.get(phase)
        if c is None or c.decision is not None:
            return None
        if (c.carried is not None and c.blocks_from is None and c.times[LOWBIT]
                and c.seen - c.start == self.warmup + 1):  # before its first fp32 step
            return min(c.times[LOWBIT] + c.times[WARMUP]), c.carried
        if not self._paired(c, c.seen - c.start):
            return None
        low, full = c.times[LOWBIT], c.times[FP32]
        if not low or not full:
            return None
        if c.seen - c.start >= self._end(c):
            return (statistics.median(low + c.prior.get(LOWBIT, [])),
                    statistics.median(full + c.prior.get(FP32, [])))
        return min(low + c.times[WARMUP]), min(full)

    def decide(self, phase: str, lowbit_s: float, fp32_s: float) -> tuple[str, str] | None:
        """Judge agreed times after a pair: (path kept, why) for the event once one path is
        `decisive` times the other or the last pair is in, else None (probe on). A close call
        on single steps (within `close`) probes on in `close_blocks` pairs of blocks first,
        and says so: (`PROBE_ON`, why), an event too."""
        c = self._cycles[phase]
        carried, c.carried = c.carried is not None and not c.times[FP32], None  # used once
        last = c.seen - c.start >= self._end(c)
        slow, fast = max(lowbit_s, fp32_s), min(lowbit_s, fp32_s)
        near = last and slow < self.close * fast  # a close call, on the medians
        low, full = len(c.times[LOWBIT]), len(c.times[FP32])
        # after a close call the paths were within `close`: one paused sample must not end a
        # re-check (a 441 ms fp32 step at 500 Mbit/s did), so the fastest of two a path
        if not last and (slow < self.decisive * fast or (c.close_calls and min(low, full) < 2)):
            return None
        times = f"low-bit {lowbit_s * 1e3:.2f} ms vs fp32 {fp32_s * 1e3:.2f} ms"
        blocks = f"{self.block}-step blocks"
        if near and c.blocks_from is None:
            c.blocks_from, c.times = c.seen - c.start, _no_times()
            return PROBE_ON, (f"close call: {times} (median of {min(low, full)} steps each, "
                              f"within {self.close:g}x): probing on in {self.close_blocks} "
                              f"pairs of {blocks}")
        c.decision, c.decided_at = (LOWBIT if lowbit_s < fp32_s else FP32), c.seen
        c.ratio = slow / fast if fast > 0 else 1.0
        if c.times[FP32]:
            self._last_fp32 = min(c.times[FP32])
        what = "steps" if c.blocks_from is None else blocks
        how = (f"median of {min(low, full)} {what} each" if last else
               f"fastest of {low + len(c.times[WARMUP])} low-bit {what} and the last "
               "cycle's fastest fp32 step" if carried else
               f"fastest of {low + len(c.times[WARMUP])} low-bit and {full} fp32 {what}")
        if last and c.prior:  # the medians pooled the last check's blocks (`due`)
            how += f" and the last check's {min(map(len, c.prior.values()))}"
        c.close_calls = c.close_calls + 1 if near else 0
        stands = self._recheck(c)
        again = (f"; close: re-checked in {stands} steps" if c.close_calls else
                 f"; re-checked in {stands} steps" if stands != self.recheck_every else "")
        c.reason = f"measured step: {times} ({how}, mean over ranks){again}"
        return c.decision, c.reason

    def state_dict(self) -> dict[str, Any]:
        return {"version": VERSION,
                "cycles": {phase: [c.start, c.seen, c.decided_at, c.times, c.decision,
                                   c.reason, c.blocks_from, c.close_calls, c.prior, c.ratio]
                           for phase, c in self._cycles.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._cycles = {}
        for phase, row in state.get("cycles", {}).items():
            if state.get("version", 1) < VERSION:  # single-step samples: probe again
                self._cycles[phase] = c = _Cycle(seen=row[1])
                self._restart(c)
                continue
            start, seen, decided_at, times, decision, reason, *rest = row
            kept = {**_no_times(), **{k: list(v) for k, v in times.items()}}
            self._cycles[phase] = _Cycle(start, seen, decided_at, kept, decision, reason, *rest)
