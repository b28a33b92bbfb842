"""The ranks' store when no launcher hosts it (``srun``, a script's own processes).

Rank 0 hosts torch's ``TCPStore``; the other ranks connect to it. What phalanx adds:

* rank 0's store listens on the master address's interface only (a socket bound to
  ``MASTER_ADDR`` handed to ``TCPStore`` with ``master_listen_fd``), never on every interface
  as ``TCPStore`` does when it binds itself;
* with ``PHALANX_JOB_SECRET`` set on every rank, rank 0 hosts the store behind the gate
  (:class:`~phalanx.gate.inner.InnerStore`, :class:`~phalanx.gate.relay.Gate`) and every other
  rank reaches it through a door of its own (only this process may use it) that proves the
  secret: a process without it can neither read nor write a key.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

from .inner import InnerStore
from .listen import LOOPBACK, listen
from .relay import Door, Gate, dial_gate, wait_for_gate


def host_bound(host: str, port: int, world_size: int, timeout: timedelta) -> Any:
    """Rank 0's ``TCPStore``, listening on ``host``'s interface only.

    Raises:
        OSError: the port is taken, or ``host`` is not an address of this machine.
    """
    import torch.distributed as dist

    listener = listen(host, port)
    try:
        return dist.TCPStore(host.strip("[]"), port, world_size, True, timeout,
                             wait_for_workers=False, master_listen_fd=os.dup(listener.fileno()))
    finally:
        listener.close()  # the server listens on its own copy


def host_gated(host: str, port: int, key: bytes, timeout: timedelta, warn) -> Any:
    """Rank 0: the store on loopback behind a gate on ``host:port``; returns the store's own
    client, which rank 0 uses directly."""
    gate = listen(host, port)
    inner = InnerStore(timeout.total_seconds(), warn)
    refused = lambda message: warn(f"rank 0's store gate {message}")  # noqa: E731
    Gate(gate, key, lambda store: inner.connect(), lambda node: None, refused)
    return inner.store  # the gate's thread keeps the gate and the inner store alive


def reach_gated(host: str, port: int, key: bytes, timeout: timedelta, warn) -> Any:
    """Another rank: a ``TCPStore`` client reaching rank 0's gated store through a door that
    only this process may use, which proves ``key`` for it.

    Raises:
        handshake.Refused: rank 0's gate refused the secret. TimeoutError: no gate answered.
    """
    import torch.distributed as dist

    wait_for_gate(host, port, key, time.monotonic() + timeout.total_seconds())
    me = os.getpid()
    door = Door(listen(LOOPBACK, 0), lambda: [me], lambda: dial_gate(host, port, key, "workers"),
                warn, "phalanx-door")
    return dist.TCPStore(LOOPBACK, door.port, None, False, timeout)
