"""Two network namespaces joined by a veth pair: two "machines" on one host (no torch).

The slow-link benchmark runs a rank in each, with ``tc`` limiting the link; the launcher's
multi-node and elastic tests run a node in each (tests/e2e/launch_helpers.py). Needs root
(``ip netns``, and ``tc`` for a rate).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from typing import Iterator

# tc's token bucket: 1 MiB of burst, several 64 KiB segments (veth offloads segmentation), so
# that the rate and not the bucket is the limit; a packet may wait 100 ms in the queue.
TBF_BURST, TBF_LATENCY = "1mb", "100ms"


class NamespaceError(RuntimeError):
    """An ``ip``/``tc`` command failed; ``nothing_created``: it was the first one (no rights?)."""

    def __init__(self, message: str, nothing_created: bool) -> None:
        super().__init__(message)
        self.nothing_created = nothing_created


def _ip(*args: str, nothing_created: bool = False) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode:
        raise NamespaceError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}", nothing_created)


@contextlib.contextmanager
def veth_namespaces(prefix: str, subnet: str, rate: str | None = None) -> Iterator[list[tuple[str, str, str]]]:
    """Two namespaces joined by a veth pair, removed on the way out (also on an exception).

    Args:
        prefix: names start with it (namespaces ``{prefix}{pid}a``/``b``, interfaces
            ``v{prefix}{pid}a``/``b``: keep it short, interface names have 15 characters).
        subnet: the first three octets of a private /24; the ends get ``.1`` and ``.2``.
        rate: ``tc`` rate limiting each end's sending (e.g. ``"1gbit"``); ``None``: no limit.

    Yields ``[(namespace, interface, address), ...]`` for the two ends.

    Raises:
        NamespaceError: an ``ip`` or ``tc`` command failed, naming it and its error.
    """
    tag = os.getpid() % 100000
    nodes = [(f"{prefix}{tag}{s}", f"v{prefix}{tag}{s}", f"{subnet}.{i + 1}") for i, s in enumerate("ab")]
    created: list[str] = []
    try:
        for ns, _, _ in nodes:
            first = not created
            created.append(ns)  # before it exists: a Ctrl-C during `ip netns add` leaves none
            _ip("netns", "add", ns, nothing_created=first)
        _ip("link", "add", nodes[0][1], "type", "veth", "peer", "name", nodes[1][1])
        for ns, dev, addr in nodes:
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if rate is not None:
                _ip("netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                    "burst", TBF_BURST, "latency", TBF_LATENCY)
        yield nodes
    finally:
        # a second Ctrl-C (or SIGTERM) must not cut the removal short: the namespaces would
        # outlive the run; the signals are held until it is done, then delivered
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
        try:
            for ns in created:  # deleting a namespace deletes its end of the veth pair (and the other)
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
