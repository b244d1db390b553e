"""A bandwidth-shaped link for ranks on one machine: a network namespace with only loopback.

`ShapedLink(mbit)` creates namespace ``nfabric-<pid>``, sets ``lo`` up with MTU 9000 and a
`tc tbf` root qdisc at the given rate, and `wrap(cmd)` runs a command inside it
(``ip netns exec``); `link_wrap(mbit)` gives that wrapper, or the identity without a rate.
Every rank's traffic then crosses the one shaped loopback: with W ranks the link is shared,
as on a node behind one NIC. The namespace is deleted on exit, also on
Ctrl-C or an error. Inside the namespace, `read_lo_counters()` reads the loopback's byte
counters, so a run can compare the bytes it claims with the bytes that crossed the link
(loopback counts each packet once in tx and once in rx; headers included).

Queueing: the tbf queue holds `latency` worth of data (1 s) so TCP is slowed, not dropped:
a drop would be retransmitted and counted twice on the wire.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

from nfabric_cli.errors import InputError

MTU = 9000
LATENCY = "1s"
#: One read of this file gives bytes and packets from one stats snapshot; reading sysfs
#: counters one after the other can straddle a packet (a TCP ACK still in flight).
_NET_DEV = Path("/proc/self/net/dev")
_SNMP = Path("/proc/self/net/snmp")


def burst_bytes(mbit: float) -> int:
    """tbf bucket: 1 ms at the rate, at least 64 KiB (one GSO segment of loopback).

    A bucket refills while the link idles and lets its bytes through at loopback speed; a real
    link serialises every byte at its rate. At 10 ms (until session 42) the bucket held about
    one fp32 step's traffic at 500 Mbit/s (625 KB against ~800 KB), so fp32 steps after idle
    low-bit ones passed largely at loopback speed: fp32's step read 14.5 ms there, 19.9 ms
    with 1 ms (transformer, W = 2), and the measured gate's short fp32 probes read 0.87-0.94x
    the fp32 arm's steps (docs/validation.md, session 42). Below 52 Mbit/s the floor decides."""
    return max(64 * 1024, int(mbit * 1e6 / 8 * 0.001))


def link_available() -> str | None:
    """None when a shaped link can be made here, else why not (one line)."""
    if os.geteuid() != 0:
        return "--link-mbit needs root (it creates a network namespace and a tc qdisc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"--link-mbit needs the iproute2 tools; not found: {', '.join(missing)}"
    return None


class ShapedLink:
    """Context manager: the namespace exists between enter and exit."""

    def __init__(self, mbit: float, name: str | None = None) -> None:
        self.mbit = float(mbit)
        self.name = name or f"nfabric-{os.getpid()}"
        self._made = False

    def __enter__(self) -> ShapedLink:
        reason = link_available()
        if reason:
            raise InputError(reason)
        # A namespace of this name is left over from a launcher that died (pids are reused).
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, check=False)
        _run(["ip", "netns", "add", self.name], "create network namespace")
        self._made = True
        try:
            _run(["ip", "-n", self.name, "link", "set", "lo", "up", "mtu", str(MTU)], "set up lo")
            _run(
                ["tc", "-n", self.name, "qdisc", "add", "dev", "lo", "root", "tbf",
                 "rate", f"{self.mbit:g}mbit", "burst", str(burst_bytes(self.mbit)),
                 "latency", LATENCY],
                "shape lo",
            )  # fmt: skip
        except BaseException:
            self.close()
            raise
        return self

    def wrap(self, cmd: list[str]) -> list[str]:
        """`cmd` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *cmd]

    def qdisc_stats(self) -> str:
        """`tc -s qdisc show dev lo` inside the namespace (sent bytes, drops, overlimits)."""
        out = subprocess.run(
            ["tc", "-n", self.name, "-s", "qdisc", "show", "dev", "lo"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        return out.stdout.strip()

    def close(self) -> None:
        if self._made:
            subprocess.run(["ip", "netns", "del", self.name], capture_output=True, check=False)
            self._made = False

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def link_wrap(mbit: float | None) -> Iterator[Callable[[list[str]], list[str]]]:
    """A function that puts a command inside a `ShapedLink` at `mbit` for the duration of the
    block, or leaves it as it is when `mbit` is None or 0 (plain loopback)."""
    if not mbit:
        yield lambda cmd: cmd
        return
    with ShapedLink(mbit) as link:
        yield link.wrap


def read_lo_counters() -> dict[str, int]:
    """This network namespace's loopback counters (read inside it): bytes and packets sent,
    and TCP segments retransmitted (their bytes cross the link again, unclaimed)."""
    for line in _NET_DEV.read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == "lo":
            f = [int(x) for x in fields.split()]
            return {"tx": f[8], "packets": f[9], "retransmits": _tcp_retransmits()}
    raise RuntimeError("no loopback in /proc/self/net/dev")


def _tcp_retransmits() -> int:
    """`RetransSegs` of this namespace's TCP statistics (0 where the file says nothing)."""
    rows = [line.split() for line in _SNMP.read_text().splitlines() if line.startswith("Tcp:")]
    if len(rows) == 2 and "RetransSegs" in rows[0]:
        return int(rows[1][rows[0].index("RetransSegs")])
    return 0


def _run(cmd: list[str], what: str) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        detail = (out.stderr or out.stdout).strip().splitlines()
        raise InputError(f"--link-mbit: cannot {what}: {detail[-1] if detail else 'failed'}")
