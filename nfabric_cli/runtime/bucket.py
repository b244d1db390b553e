"""One DDP bucket's reduction, in three stages the hook interleaves across buckets.

`FabricState` (runtime/state.py) runs, for each bucket k of a step, on its one worker thread
(the last bucket on DDP's thread once the worker is done: one thread at a time either way):

    job_k.start()      encode, issue bucket k's collectives (all-to-all, float all-reduces)
    job_{k-1}.finish() wait for bucket k-1's all-gather, decode, copy back, error feedback
    job_k.middle()     wait for the all-to-all, combine, issue bucket k's all-gather

so bucket k encodes while bucket k-1's results are on the wire, and decodes while bucket
k+1's codes are. The stages of all jobs run in this fixed order on every rank, so every rank
issues the same collectives in the same order (gloo and NCCL match collectives by order).
The step's last bucket starts once the one before it has landed, and carries the step's statistics
(`runtime/agree.py`) at the end of its all-gather; a last bucket without one (all fp32) sends
them in an all-reduce of their own. Then the last bucket finishes and the statistics are read.
In a step with nothing on a low-bit route (the monitor holding the whole model) every bucket
is started on DDP's thread as it arrives (`FabricState.submit`: no middle stage, no worker)
and all land with the last bucket.

Within a bucket (`start`): all sharded low-bit reduces share one exchange
(`routes/exchange.py`: at most one all-to-all and one all-gather); float groups (fp32,
bf16, fp16) are one all-reduce each, issued before it; the central reducer runs its own
collectives then and there. A bucket whose parameters are all on fp32 is one in-place
all-reduce, exactly plain DDP's. A traced run (`nfabric validate --trace`) reduces
group by group, blocking, so each reduce is timed and metered alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from nfabric_cli.routes import FP32, make_route
from nfabric_cli.routes.base import CodeRoute, Noise, codec_noise
from nfabric_cli.routes.exchange import Exchange, Piece
from nfabric_cli.routes.fp32 import FloatRoute
from nfabric_cli.routes.groups import BucketGroup, whole_bucket
from nfabric_cli.routes.plan import WireBytes, op_wire_bytes
from nfabric_cli.routes.spec import RouteSpec
from nfabric_cli.routes.tally import Tally

if TYPE_CHECKING:
    from nfabric_cli.runtime.agree import StatsRound
    from nfabric_cli.runtime.state import FabricState


class _Part(NamedTuple):
    """What one reduce works on: its float tensor, its parameters' sizes and names, and the
    codec noise it is encoded with (error feedback's roundtrip reuses the same)."""

    x: torch.Tensor
    segments: tuple[int, ...]
    names: list[str]
    noise: Noise


def _timed(fn: Callable[[BucketJob], None]) -> Callable[[BucketJob], None]:
    """A stage whose wall time adds to the job's `seconds` (what the capacity gate judges)."""
    def run(self: BucketJob) -> None:
        t0 = time.perf_counter()
        fn(self)
        self.seconds += time.perf_counter() - t0

    run.__doc__ = fn.__doc__
    return run


class BucketJob:
    """The reduction of one bucket of step `step` (see the module docstring)."""

    def __init__(self, state: FabricState, buffer: torch.Tensor, names: list[str],
                 slices: list[torch.Tensor], offsets: list[int], groups: Sequence[BucketGroup],
                 step: int, phase: str, index: int, rider: StatsRound | None = None) -> None:
        self.state, self.buffer, self.names = state, buffer, names
        self.rider = rider  # the step's statistics, carried by this bucket's all-gather if any
        self.slices, self.offsets, self.groups = slices, offsets, groups
        self.step, self.phase, self.index = step, phase, index
        self.lowbit = any(g.spec.lowbit for g in groups)
        self.seconds = 0.0  # the worker's time on this bucket, its three stages together
        self._after: list[Callable[[], None]] = []  # waits, copy-backs, error feedback
        self._exchange: Exchange | None = None
        self._labels: list[str] = []

    @_timed
    def start(self) -> None:
        """Prepare every reduce, issue the float all-reduces and start the exchange."""
        st, slices = self.state, self.slices
        dtype = slices[0].dtype
        if whole_bucket([g.spec for g in self.groups]):
            self._whole_bucket_fp32()
            return
        # Never encode NaN/Inf (the sign of NaN is not a vote, and error feedback would keep
        # it): the identity on finite values, so no host read has to decide it. A non-finite
        # step is zeroed at its end; plain fp32 carries the NaN there by itself.
        self.buffer.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        pieces: list[Piece] = []
        traced = st.trace is not None
        for gi, group in enumerate(self.groups):
            spec = group.spec
            route = make_route(spec, dtype)
            for ks in group.reduces():
                part = self._prepare([group.index[k] for k in ks], spec)
                # each region's agreement apart, though they share the reduce
                stats = (Tally.over([group.regions[k] for k in ks], part.segments,
                                    st._group_stats) if spec.lowbit else None)
                if isinstance(route, CodeRoute) and spec.reducer == "sharded" and not traced:
                    if part.x.numel():
                        pieces.append(Piece(route, part.x, part.segments, stats, part.noise))
                        self._labels.append(spec.label())
                elif isinstance(route, FloatRoute) and not traced:
                    self._issue_float(route, part.x, spec)
                else:  # the central reducer, or a traced run: one blocking reduce
                    self._blocking(route, part, spec, stats, gi)
        if pieces:
            self._exchange = Exchange(pieces, st.comm, slot=self.index,  # buffers per bucket
                                      rider=self.rider)
            self._exchange.start()

    @_timed
    def middle(self) -> None:
        """Combine this rank's shards and issue the exchange's all-gather."""
        if self._exchange is not None:
            self._exchange.middle()
            st, measured = self.state, self.state.comm.take()
            if self._exchange.rider is not None:  # its bytes are the statistics round's
                control = op_wire_bytes("all_gather", self._exchange.rider.nbytes,
                                        st.world_size, st.rank)
                st.meter.add(self.step, self.phase, "control", control)
                measured = measured - control
            self._meter_pieces(self._exchange.pieces, measured)

    @_timed
    def finish(self) -> None:
        """Wait for everything in flight, decode, copy back, update error feedback."""
        if self._exchange is not None:
            self._exchange.finish()
        for fn in self._after:
            fn()

    # -- parts of start ------------------------------------------------------------------------
    def _whole_bucket_fp32(self) -> None:
        """Every parameter on fp32: one in-place all-reduce of the bucket, plain DDP's."""
        st = self.state
        full = make_route(FP32, self.buffer.dtype)
        if st.trace is not None:
            local, t0 = self.buffer.clone(), time.perf_counter()
            full.reduce(self.buffer, st.comm)
            wb = st.comm.take()
            st.meter.add(self.step, self.phase, "fp32", wb)
            st.trace.record(self.step, self.phase, self.index, self.buffer.numel(),
                            len(self.names), FP32, tuple(s.numel() for s in self.slices),
                            time.perf_counter() - t0, wb.sent, wb.received, local)
            return
        self._after.insert(0, full.reduce_async(self.buffer, st.comm))
        st.meter.add(self.step, self.phase, "fp32", st.comm.take())

    def _issue_float(self, route: FloatRoute, x: torch.Tensor, spec: RouteSpec) -> None:
        """A float group: its all-reduce issued now, its result written back when it lands
        (before the copy-backs `_prepare` queued, which read it)."""
        wait = route.reduce_async(x, self.state.comm)

        def land() -> None:
            out = wait()
            if out.data_ptr() != x.data_ptr():
                x.copy_(out)

        self._after.insert(0, land)
        self.state.meter.add(self.step, self.phase, spec.label(), self.state.comm.take())

    def _blocking(self, route, part: _Part, spec: RouteSpec, stats, gi: int) -> None:  # noqa: ANN001
        st = self.state
        local = part.x.clone() if st.trace is not None else None
        t0 = time.perf_counter()
        out = route.reduce(part.x, st.comm, part.segments, stats, part.noise)
        if out.data_ptr() != part.x.data_ptr():
            part.x.copy_(out)
        seconds = time.perf_counter() - t0
        wb = st.comm.take()
        st.meter.add(self.step, self.phase, spec.label(), wb)
        if st.trace is not None:
            st.trace.record(self.step, self.phase, self.index, self.buffer.numel(),
                            len(self.names), spec, part.segments, seconds, wb.sent,
                            wb.received, local, group=gi)

    def _prepare(self, idx: list[int], spec: RouteSpec) -> _Part:
        """The tensor one reduce works on, and what to do with it afterwards (queued).

        Consecutive parameters without error feedback are reduced in the bucket's own memory
        (routes decode into their input): nothing to copy back for a float32 bucket. Error
        feedback compensates a copy (and updates the residual from what was sent); parameters
        that are not consecutive are concatenated and copied back."""
        st = self.state
        group_names = [self.names[i] for i in idx]
        parts = [self.slices[i] for i in idx]
        segs = tuple(p.numel() for p in parts)
        # drawn once: the wire and error feedback's roundtrip encode with the same noise
        noise = codec_noise(spec, st.seed, self.step, st.rank, group_names, segs)
        if spec.error_feedback:
            x = st.ef.compensate_flat(group_names, spec.label(), parts)
        elif idx == list(range(idx[0], idx[0] + len(idx))):
            x = self.buffer[self.offsets[idx[0]] : self.offsets[idx[0]] + sum(segs)]
        else:
            x = torch.cat(parts)
        if x.dtype != torch.float32 and spec.name != "fp32":
            x = x.float()  # code routes decode float32 (a bf16 bucket: copied back below)
        if spec.error_feedback and spec.lowbit:
            compensated = x.clone()  # the reduce works in place
            route = make_route(spec, x.dtype)

            def feedback() -> None:
                # One roundtrip per reduce (chunks never span parameters: the per-parameter
                # roundtrips, concatenated), with the noise as sent.
                sent = route.roundtrip(compensated, segs, noise)
                st.ef.update_flat(group_names, compensated, sent, segs)

            self._after.append(feedback)
        if x.data_ptr() != parts[0].data_ptr():  # not the bucket's own memory
            def copy_back() -> None:
                off = 0
                for part in parts:
                    part.copy_(x[off : off + part.numel()])
                    off += part.numel()

            self._after.append(copy_back)
        return _Part(x, segs, group_names, noise)

    def _meter_pieces(self, pieces: list[Piece], measured: WireBytes) -> None:
        """Credit the exchange's bytes to each piece's route: its own plan's bytes (what it
        alone would have sent), any rounding of the shared collectives to the first."""
        st = self.state
        planned = [p.route.wire_bytes(p.x.numel(), st.world_size, st.rank, p.segments)
                   for p in pieces]
        rest = measured - sum(planned, WireBytes())
        for i, (label, wb) in enumerate(zip(self._labels, planned, strict=True)):
            st.meter.add(self.step, self.phase, label, wb + rest if i == 0 else wb)
