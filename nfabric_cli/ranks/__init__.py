"""The ground floor for ranks: start them, watch them, stop them, and the link they talk over.

Every launcher of real ranks stands on this package: `nfabric validate` (`validation/launch.py`,
which adds its progress-file supervision), `nfabric replay` (`replay/launch.py`), the runtime
benchmark and the test suite. Nothing here knows about profiles or arms.

- `sessions`: a worker module per rank, each in its own process session (so one `killpg` takes
  the rank and anything it started), its log file, the rank environment, killing and reaping.
- `wait`: wait for every rank to exit 0 before a deadline; otherwise kill them all and name the
  first failed rank with its last log line.
- `functions`: run a Python function on N gloo ranks spawned from this process (tests,
  benchmarks), results gathered per rank.
- `loop`: the training loop a fabric rank runs (forward, `observe`, backward, step).
- `netns`: the tbf-shaped loopback in a private network namespace (root only).
"""
