"""``python -m phalanx.launcher.storehost``: a launcher's helper process for the stores.

Started by every launcher (see :class:`phalanx.launcher.rendezvous.StoreHost`), it holds the
listening sockets the launcher bound and serves them on threads, so that torch's import and
the byte copying stay off the launcher's single thread. Its role, from the first line of its
stdin (JSON, with the job secret: never on a command line):

``local``  (one node) a door for the workers, in front of the workers' store of the round.
``host``   (node 0 of several) the gate on the master's interface; the launchers' store
           (through the gate, and this launcher's door); the workers' store of the round
           (through the gate, and this node's door for its workers).
``door``   (the other nodes) a door for the launcher and one for its workers, each spliced
           to node 0's gate, proving the job secret for them.

The workers' store is made anew for every round: ``open`` (from the launcher, on stdin)
makes a fresh one, ``close`` ends it and answers ``closed``. End of file on stdin means the
launcher is gone: this process exits, unless ``linger ID...`` came first (node 0, at the end
of the job): then it keeps the launchers' store up until each launcher named has checked out
or is gone, at most :data:`LINGER_S` seconds, so that every node learns how the job ended.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time

from ..gate import peers
from ..gate.inner import InnerStore
from ..gate.relay import Door, Gate, dial_gate
from .membership import EXITED, GONE_COUNT, UNREACHABLE, checked_out_key, gone_key

# How long node 0's store stays up after its launcher has gone, for the other launchers to
# read the job's end and check out; a launcher looks at the store every --monitor-interval.
LINGER_S = 30.0
_POLL_S = 0.05  # between looks at the check-outs while lingering


def _report(message: str) -> None:
    sys.stderr.write(f"[phalanx] store: {message}\n")
    sys.stderr.flush()


class Rounds:
    """A store made anew by each ``open``; connections wait for one to be open."""

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self.current: InnerStore | None = None
        self._changed = threading.Condition()
        self._opened = 0  # opens and closes so far: a store made for an older one is late

    def open(self) -> None:
        """Make a fresh store and serve it (this thread waits for it)."""
        self._serve(self._replace(), InnerStore(self._timeout, _report))

    def open_soon(self) -> None:
        """:meth:`open` on a thread of its own: the first store imports torch (a second or
        two), and the launcher's next order must not wait for it. A ``close`` meanwhile is
        answered at once (a run whose workers were that quick ends without waiting for the
        import); the store, once made, is then closed unused."""
        which = self._replace()

        def make() -> None:
            try:
                self._serve(which, InnerStore(self._timeout, _report))
            except Exception as e:  # as from main(): the launcher sees this process end
                _report(f"failed: {type(e).__name__}: {e}")
                os._exit(1)

        threading.Thread(target=make, name="phalanx-store-open", daemon=True).start()

    def close(self) -> None:
        self._replace()

    def _replace(self) -> int:
        """End the store served now (if any); the number of the next one."""
        with self._changed:
            if self.current is not None:
                self.current.close()
            self.current = None
            self._opened += 1
            return self._opened

    def _serve(self, which: int, fresh: InnerStore) -> None:
        with self._changed:
            if which != self._opened:  # closed (or opened again) while it was being made
                fresh.close()
                return
            self.current = fresh
            self._changed.notify_all()

    def connect(self) -> socket.socket:
        with self._changed:
            if not self._changed.wait_for(lambda: self.current is not None, self._timeout):
                raise TimeoutError("no round's store opened in time")
            return self.current.connect()


def _serve(config: dict, rounds: Rounds) -> InnerStore | None:
    """Start the doors (and the gate) of ``config``'s role; the launchers' store for ``host``."""
    role, launcher = config["role"], os.getppid()
    mine = lambda: peers.descendants(launcher)  # noqa: E731 - the launcher and its workers
    sock = lambda name: socket.socket(fileno=config[name])  # noqa: E731
    if role == "door":
        host, port = config["upstream"]
        key, node = config["secret"].encode(), config["node"]
        Door(sock("launcher_door"), lambda: [launcher],
             lambda: dial_gate(host, port, key, "rdzv", node), _report, "phalanx-door")
        Door(sock("workers_door"), mine,
             lambda: dial_gate(host, port, key, "workers", node), _report, "phalanx-door")
        return None
    Door(sock("workers_door"), mine, rounds.connect, _report, "phalanx-door")
    if role == "local":
        return None
    rdzv = Rounds(config["timeout"])  # one "round": the launchers' store, for the whole job

    def left(node: str, closed: bool) -> None:  # its launcher's last connection ended: gone
        rdzv.current.store.set(gone_key(node), EXITED if closed else UNREACHABLE)
        rdzv.current.store.add(GONE_COUNT, 1)

    # Serving first, so the other nodes' probes get an answer while torch is imported.
    Door(sock("launcher_door"), lambda: [launcher], rdzv.connect, _report, "phalanx-door")
    routes = {"rdzv": rdzv.connect, "workers": rounds.connect}
    Gate(sock("gate"), config["secret"].encode(), lambda store: routes[store](), left, _report)
    rdzv.open()
    return rdzv.current


def _linger(rdzv: InnerStore | None, nodes: list[str]) -> None:
    deadline = time.monotonic() + LINGER_S
    while rdzv is not None and time.monotonic() < deadline:
        nodes = [n for n in nodes if not any(rdzv.store.check([key(n)])
                                             for key in (checked_out_key, gone_key))]
        if not nodes:
            return
        time.sleep(_POLL_S)


def main() -> None:
    config = json.loads(sys.stdin.readline())
    rounds = Rounds(config["timeout"])
    rdzv = _serve(config, rounds)
    linger = None
    for line in sys.stdin:  # the launcher's orders, until it closes the pipe (or dies)
        order, *args = line.split()
        if order == "open":
            rounds.open_soon()
        elif order == "close":
            rounds.close()
            print("closed", flush=True)
        elif order == "linger":
            linger = args
    if linger is not None:
        # Whoever reads the launcher's output (a terminal, a pipe, a test) must not wait for
        # this process: it lets go of the launcher's stderr before it lingers.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        _linger(rdzv, linger)
    os._exit(0)  # the doors' threads go with it


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # the launcher sees this process end and names it
        _report(f"failed: {type(e).__name__}: {e}")
        os._exit(1)
