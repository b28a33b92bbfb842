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
    """Rank 0: the store on loopback behind a gate on ``host:port``; rank 0 reaches it through
    a door of its own, like every other rank (the store's signed loopback port takes no
    unsigned connection, so a client of its own could not be cloned)."""
    gate = listen(host, port)
    inner = InnerStore(timeout.total_seconds(), warn)
    refused = lambda message: warn(f"rank 0's store gate {message}")  # noqa: E731
    Gate(gate, key, lambda store: inner.connect(), lambda node, closed: None, refused)
    # the gate's and the door's threads keep the inner store alive
    return _through_own_door(inner.connect, timeout, warn)


def reach_gated(host: str, port: int, key: bytes, timeout: timedelta, warn) -> Any:
    """Another rank: a ``TCPStore`` client reaching rank 0's gated store through a door that
    only this process may use, which proves ``key`` for it.

    Raises:
        handshake.Refused: rank 0's gate refused the secret. TimeoutError: no gate answered.
    """
    wait_for_gate(host, port, key, time.monotonic() + timeout.total_seconds())
    return _through_own_door(lambda: dial_gate(host, port, key, "workers"), timeout, warn)


def _through_own_door(dial, timeout: timedelta, warn) -> Any:
    """A ``TCPStore`` client whose connections (its clones' too) go through a loopback door
    that only this process may use, and that ``dial`` connects onwards."""
    import torch.distributed as dist

    me = os.getpid()
    door = Door(listen(LOOPBACK, 0), lambda: [me], dial, warn, "phalanx-door")
    return dist.TCPStore(LOOPBACK, door.port, None, False, timeout)
