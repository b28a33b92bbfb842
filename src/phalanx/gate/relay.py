"""Doors and the gate: connections accepted, checked, then spliced through to a store.

* A :class:`Door` listens on this host for the processes it serves: its launcher and that
  launcher's workers, or the one process that opened it. A connection from any other process
  is closed unread (see :mod:`phalanx.gate.peers`). What a door lets in goes on to its
  upstream: a store on this host, or node 0's gate.
* The :class:`Gate` listens on the master's interface for the other nodes' doors, and lets in
  a connection only once it has proved the job secret (:mod:`phalanx.gate.handshake`).
* :func:`splice` copies bytes both ways until one side closes, then closes both. Nothing is
  parsed: the store's bytes pass untouched.

Each accepted connection is served by a thread of its own; the stores' traffic is small (a
rendezvous, a few keys per collective set-up), so threads that wait in ``select`` cost nothing.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from typing import Callable, Iterable

from . import handshake, peers
from .listen import keepalive

_CHUNK = 64 * 1024  # one recv: the kernel's default socket buffer order of magnitude
# Between attempts to reach a gate that is not up yet: short next to a launcher's or a
# process group's start-up, long enough not to spin.
_RETRY_S = 0.2
# One attempt to connect: within 2 s a listening host answers a SYN even after one
# retransmission (Linux's initial retransmission timeout is 1 s, RFC 6298); never under
# 0.1 s, so the last attempt before a deadline still has a round trip's time.
_CONNECT_TRY_S, _CONNECT_TRY_MIN_S = 2.0, 0.1

Report = Callable[[str], None]


def splice(a: socket.socket, b: socket.socket) -> bool:
    """Copy bytes between ``a`` and ``b`` until either closes or fails; then close both.
    Returns True when the other end's machine ended it (end of file, or a reset: its process
    is gone, its machine is up), False when it was dropped unanswered (TCP keepalive or the
    user timeout: a dead machine, or a cut network)."""
    try:
        while True:
            readable, _, _ = select.select([a, b], [], [])
            for source in readable:
                data = source.recv(_CHUNK)
                if not data:
                    return True
                (b if source is a else a).sendall(data)
    except (ConnectionResetError, BrokenPipeError):
        return True
    except OSError:
        return False
    finally:
        a.close()
        b.close()


def serve(listener: socket.socket, handle: Callable[[socket.socket], None], name: str) -> threading.Thread:
    """Accept on ``listener`` in a daemon thread until it is closed; each connection is
    handled by ``handle`` in a daemon thread of its own, and closed if ``handle`` raises."""

    def handled(conn: socket.socket) -> None:
        try:
            handle(conn)
        except Exception:  # the peer went away, a store is gone: only this connection ends
            conn.close()

    def accept_forever() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed: this listener is done
                return
            threading.Thread(target=handled, args=(conn,), name=name, daemon=True).start()

    thread = threading.Thread(target=accept_forever, name=name, daemon=True)
    thread.start()
    return thread


class Door:
    """Lets in connections made by the processes ``allowed()`` lists, and splices each to a
    connection from ``upstream()`` (which may wait, e.g. for the round's store)."""

    def __init__(self, listener: socket.socket, allowed: Callable[[], Iterable[int]],
                 upstream: Callable[[], socket.socket], report: Report, name: str) -> None:
        self.port = listener.getsockname()[1]
        self._allowed, self._upstream, self._report = allowed, upstream, report
        serve(listener, self._admit, name)

    def _admit(self, conn: socket.socket) -> None:
        if peers.connected_by(conn, self._allowed()) is None:
            where = conn.getpeername()
            # said before the close: whoever sees the connection end finds it said
            self._report(f"refused a connection to port {self.port} from {where[0]}:{where[1]}: "
                         "not a process of this job")
            conn.close()
            return
        splice(conn, self._upstream())


class Gate:
    """Lets in connections that prove the job secret; ``route(store)`` gives the store
    connection to splice each to. When the last ``rdzv`` connection of a node closes,
    ``on_leave(node, closed)`` is called: that node's launcher is gone (or done); ``closed``:
    its connection was closed by the other end (its launcher exited), not dropped as
    unreachable (see :func:`splice`)."""

    def __init__(self, listener: socket.socket, key: bytes,
                 route: Callable[[str], socket.socket], on_leave: Callable[[str, bool], None],
                 report: Report) -> None:
        self._key, self._route, self._on_leave, self._report = key, route, on_leave, report
        self._lock = threading.Lock()
        self._open: dict[str, int] = {}  # node -> its rdzv connections now open
        serve(listener, self._admit, "phalanx-gate")

    def _admit(self, conn: socket.socket) -> None:
        conn.settimeout(handshake.HANDSHAKE_TIMEOUT_S)
        where = conn.getpeername()
        try:
            hello = handshake.serve(conn, self._key)
        except handshake.Silent:  # it hung up without a word (a prober that gave up waiting)
            conn.close()
            return
        except OSError:  # it fell silent (a plain TCPStore client waits for a reply)
            hello = None
        if hello is None:
            self._report(f"refused a connection from {where[0]}:{where[1]}: it did not prove "
                         "this job's secret")  # (before the close, as the door's)
            conn.close()
            return
        store, node = hello
        if store == "probe":
            conn.close()
            return
        conn.settimeout(None)
        keepalive(conn)
        tracked = store == "rdzv" and node != "-"
        if tracked:
            with self._lock:
                self._open[node] = self._open.get(node, 0) + 1
        closed = False
        try:
            closed = splice(conn, self._route(store))
        finally:
            if tracked:
                with self._lock:
                    self._open[node] -= 1
                    last = self._open[node] == 0
                if last:
                    self._on_leave(node, closed)


def dial_gate(host: str, port: int, key: bytes, store: str, node: str = "-",
              timeout: float = handshake.HANDSHAKE_TIMEOUT_S) -> socket.socket:
    """A connection to the gate at ``host:port`` that has proved ``key`` for ``store``.

    Raises:
        handshake.Refused: wrong secret, or not a gate. OSError: unreachable.
    """
    sock = socket.create_connection((host.strip("[]"), port), timeout=timeout)
    try:
        handshake.greet(sock, key, store, node)
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return keepalive(sock)


def wait_for_gate(host: str, port: int, key: bytes, deadline: float,
                  check: Callable[[], None] = lambda: None) -> None:
    """Check the secret with the gate at ``host:port``, retrying while nothing answers there,
    until ``time.monotonic()`` passes ``deadline``. ``check()`` runs before each attempt (and
    may raise to give up).

    Raises:
        handshake.Refused: the gate refused the secret, or it is not a phalanx gate.
        TimeoutError: nothing answered before the deadline.
    """
    while True:
        check()
        left = deadline - time.monotonic()
        try:
            try_s = max(_CONNECT_TRY_MIN_S, min(left, _CONNECT_TRY_S))
            dial_gate(host, port, key, "probe", timeout=try_s).close()
            return
        except handshake.Refused:
            raise
        except OSError:
            if left <= 0:
                raise TimeoutError(f"nothing answered at {host}:{port}") from None
            time.sleep(min(_RETRY_S, max(left, 0)))
