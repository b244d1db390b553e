"""Reducer-side replay: recorded bucket traces through the real reducers, and the fitted model.

- `trace`: load and check a trace directory (`runtime/trace.py` writes it), group its rows.
- `plan`: what every replay rank runs (groups, fp32 twins, an fp32 size sweep).
- `worker` / `launch`: the ranks (gloo over a FileStore, optionally behind a shaped link).
- `timed`: a clock around each collective, splitting a reduce into codec stages and wire.
- `fit`: least-squares α, β, codec GB/s and endpoint capacity (pure functions).
- `run`: `replay_trace`, the whole flow, and the predicted-vs-measured comparison.

It sits beside validation (it borrows its `ShapedLink`) and above runtime and substrate.
"""

from nfabric_cli.replay.run import ReplayReport, replay_trace
from nfabric_cli.replay.trace import Trace, TraceGroup, load_trace

__all__ = ["ReplayReport", "Trace", "TraceGroup", "load_trace", "replay_trace"]
