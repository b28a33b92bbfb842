"""The store moves: when the launcher hosting the store (the round's node 0) is lost, the
survivors elect the next host, and the job goes on.

**Where each launcher can be reached.** Every launcher of several nodes registers an address
(:class:`~phalanx.launcher.membership.Node` ``addr``/``port``), and every round's layout lists
its nodes with theirs, so every launcher knows the round's membership and addresses. Node 0's
is its gate; any other launcher binds at start a *standby gate* on the address it reaches node
0 from (at ``--master-port``, or a free port where that one is taken), served only once it
becomes the host. ``--rdzv-endpoint`` (or ``--master-addr``) is the first meeting place only.

**The election.** A launcher that loses the launchers' store (the host's gate closed its
connection, or TCP keepalive dropped it, within ``DEAD_PEER_S``), while the host had not
finished its part, stops its workers as for any other loss and moves. The candidates are the
last round's nodes but the lost host, in the round's order (lowest node rank first): every
survivor computes the same list. Going down it, a launcher that comes to itself becomes the
host: it serves its standby gate, with the job secret and the gate exactly as node 0's, and a
fresh launchers' store behind it. A candidate that is another node is given
:meth:`Mover.reach_s` to answer at its address; one that does not is passed over.

**The vote.** The new host opens the next round as node 0 did, once more than half of the
last round's nodes are with it; the lost host does not vote when it is known to have exited
(its address refuses connections: the machine is up, the launcher gone), nor does any node
whose connection its machine closed. Candidates passed over, and nodes that did not come
within the time they may take to get there, count as unreachable (they vote, and are not
there). A side without the majority stops with
:class:`~phalanx.launcher.membership.MajorityLost`: no second job runs under the job's id.

**Coming back.** A launcher given several ``--rdzv-endpoint`` s asks each, before anything
else, whether a gate of this job answers there (:func:`running_at`), and joins the first that
does: a restarted node 0 finds the job where the store moved.
"""

from __future__ import annotations

import errno
import json
import socket
import time
from dataclasses import replace
from typing import Any, Callable

from ..errors import RendezvousError
from ..gate.handshake import Refused
from ..gate.listen import DEAD_PEER_S, resolve
from ..gate.relay import dial_gate, wait_for_gate
from .board import LeaderBoard, NodeBoard
from .config import LaunchConfig
from .membership import Layout, Node, Store, StoreLost

# A candidate that is alive opens its gate once it has seen the loss (at most DEAD_PEER_S
# after the others, by keepalive) and stopped its workers (--shutdown-timeout); this much
# more for its helper to start (a Python process importing torch, on a loaded machine).
_START_S = 5.0
# Whether the lost host's address refuses connections: one attempt, within the 2 s in which
# a listening host answers a SYN after one retransmission (as phalanx.gate.relay's).
_PROBE_S = 2.0


def route_address(host: str, port: int) -> str:
    """This machine's address on the route to ``host:port`` (no packet is sent)."""
    family, sockaddr = resolve(host, port)
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)
        return probe.getsockname()[0]


def bind_standby(config: LaunchConfig) -> socket.socket:
    """A socket bound, not listening yet, to the address this node reaches the master from,
    at ``--master-port`` when free there, else at a free port: the gate it serves if it
    becomes the host. Until then a connection to it is refused at once."""
    family, sockaddr = resolve(route_address(config.master_addr, config.master_port),
                               config.master_port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    # as phalanx.gate.listen's: a port whose earlier connections linger in TIME_WAIT is free
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(sockaddr)
    except OSError as e:
        if e.errno != errno.EADDRINUSE:  # several nodes on one machine: node 0 listens there
            sock.close()
            raise
        sock.bind((sockaddr[0], 0, *sockaddr[2:]))
    return sock


def refuses(node: Node) -> bool:
    """Whether ``node``'s address refuses a connection: its machine answers, and nothing
    listens there any more (its launcher and store helper are gone)."""
    try:
        socket.create_connection((node.addr, node.port), timeout=_PROBE_S).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


def running_at(config: LaunchConfig, interrupted: Callable[[], None]) -> tuple[str, int] | None:
    """The first of ``config.rdzv_endpoints`` where a gate of this job answers now, when
    several are given (a launcher started again while its job runs: the store may have moved
    away from the first); ``None``: none answers (the job starts, as usual)."""
    if len(config.rdzv_endpoints) < 2:
        return None
    for host, port in config.rdzv_endpoints:
        interrupted()
        try:
            dial_gate(host, port, config.job_secret.encode(), "probe", timeout=_PROBE_S).close()
        except (OSError, Refused):  # nothing there, a standby gate, or another job's
            continue
        return host, port
    return None


class MovedBoard(LeaderBoard):
    """The board of a launcher that became the host: it leads the ``last`` round's nodes but
    those ``away`` (lost hosts and candidates that did not answer: id -> whether it is known
    to have exited, which takes away its vote). Those that did not register ``wait_s`` after
    it started are taken as unreachable."""

    def __init__(self, *args, run_id: str, last: list[Node], away: dict[str, bool],
                 wait_s: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.run_id = run_id
        self.members = [replace(n, leader=n.id == self.me.id) for n in last if n.id not in away]
        self._away = [n.label() for n in last if n.id in away and not away[n.id]]  # they vote
        self._absent_after = time.monotonic() + wait_s

    def start(self) -> None:
        self._s.set("job", json.dumps({**self._options(), "run_id": self.run_id}))
        self._register()

    def _gone_ids(self) -> set[str]:
        gone = super()._gone_ids()
        if time.monotonic() < self._absent_after:
            return gone
        return gone | {n.id for n in self.members if n.id not in self._known}

    def _voters(self, before: list[Node]) -> int:
        return super()._voters(before) + len(self._away)

    def _silent(self, before: list[Node], staying: list[Node]) -> list[str]:
        return self._away + super()._silent(before, staying)


class Mover:
    """Builds the board and store helper of a launcher that moves to a new host.

    Args:
        config: the launch request.
        standby: this node's standby gate (``None`` on node 0, whose gate is in use).
        start_store: ``(role, sockets, upstream)`` -> a new
            :class:`~phalanx.launcher.rendezvous.StoreHost`.
        client: ``(store_host, where)`` -> the launchers' store through its door.
        interrupted: raises once a stop signal has arrived.
        note: prints a launcher's note.
    """

    def __init__(self, config: LaunchConfig, standby: socket.socket | None,
                 start_store: Callable[..., Any], client: Callable[[Any, str], Store],
                 interrupted: Callable[[], None], note: Callable[[str], None]) -> None:
        self._config, self._standby = config, standby
        self._start_store, self._client = start_store, client
        self._raise_if, self._note = interrupted, note
        # hosts lost and candidates that did not answer, since the last round opened: id ->
        # whether it is known to have exited
        self.failed: dict[str, bool] = {}

    def reach_s(self) -> float:
        """How long a candidate may take to answer at its address (see :data:`_START_S`)."""
        return DEAD_PEER_S + self._config.shutdown_timeout + _START_S

    def move(self, lost: StoreLost, host: Node, last: list[Node], me: Node,
             run_id: str) -> tuple[NodeBoard, Any, Node]:
        """This node's board and store helper once the store has moved from ``host`` (lost),
        and the new host."""
        if host.id == me.id:  # its own store helper stopped: nothing to move to
            raise lost
        exited = self.failed[host.id] = refuses(host)
        self._note(f"the store's host, {host.label()}, {'exited' if exited else 'cannot be reached'}"
                   "; the store moves to the first of the last round's other nodes that answers")
        candidates = [n for n in last if n.id not in self.failed]
        for position, candidate in enumerate(candidates):
            self._raise_if()
            if candidate.id == me.id:
                return (*self._host_here(me, last, run_id, position), me)
            where = f"{candidate.addr}:{candidate.port}"
            if self._answers(candidate):
                self._note(f"the store moved to {candidate.label()} at {where}")
                return (*self._join(me, candidate), candidate)
            self._note(f"{candidate.label()} did not answer at {where} within "
                       f"{self.reach_s():g} s: passed over")
            self.failed[candidate.id] = False
        raise lost  # not reached: this node is one of the candidates

    def _answers(self, node: Node) -> bool:
        try:
            wait_for_gate(node.addr, node.port, self._config.job_secret.encode(),
                          time.monotonic() + self.reach_s(), self._raise_if)
        except (TimeoutError, Refused):  # silent, or another job's gate
            return False
        return True

    def _host_here(self, me: Node, last: list[Node], run_id: str,
                   position: int) -> tuple[NodeBoard, Any]:
        where = f"{me.addr}:{me.port}"
        if self._standby is None:  # node 0 hosts from the start; no node hosts twice
            raise RendezvousError(f"{me.label()} has no standby gate to host the store on")
        try:
            self._standby.listen(socket.SOMAXCONN)  # every worker of every node may connect
        except OSError as e:
            raise RendezvousError(f"{me.label()} cannot listen at {where} to host the store "
                                  f"({e.strerror})") from None
        self._note(f"{me.label()} hosts the store at {where} from now on")
        store = self._start_store("host", {"gate": self._standby}, [me.addr, me.port])
        self._standby = None
        # the others may each try the candidates before this one first
        board = MovedBoard(self._client(store, where), replace(me, leader=True), self._config,
                           self._raise_if, store.ports["workers_door"], self._note,
                           open_store=store.open_round, run_id=run_id, last=last,
                           away=dict(self.failed), wait_s=(position + 1) * self.reach_s())
        board.start()
        return board, store

    def _join(self, me: Node, host: Node) -> tuple[NodeBoard, Any]:
        store = self._start_store("door", {}, [host.addr, host.port])
        board = NodeBoard(self._client(store, f"{host.addr}:{host.port}"), replace(me, leader=False),
                          self._config, self._raise_if, store.ports["workers_door"], self._note)
        board.start()
        return board, store


class MovingBoard:
    """The board of a launcher of several nodes, whose store may move: it passes every call
    to the current board, and moves (see the module docstring) when a round cannot begin
    because the store is lost. :attr:`store` is the current store helper."""

    multi = True

    def __init__(self, board: NodeBoard, store: Any, mover: Mover) -> None:
        self.current, self.store, self._mover = board, store, mover
        self._last: list[Node] = []  # the last round's nodes
        self._host: Node | None = None  # the store's host, when it is not the last round's

    def __getattr__(self, name: str) -> Any:
        return getattr(self.current, name)

    def next_round(self, previous: Layout | None, restarts: int):
        while True:
            try:
                layout = self.current.next_round(previous, restarts)
            except StoreLost as lost:
                if previous is None or not self._last and not self.current.members:
                    raise  # no round yet: nobody knows the others' addresses
                self._move(lost)
                continue
            if self.current.members:  # a round opened: the candidates start afresh
                self._last, self._host = list(self.current.members), None
                self._mover.failed.clear()
            return layout

    def acknowledge(self, round_: int) -> None:
        try:
            self.current.acknowledge(round_)
        except StoreLost:  # the host went with the failure: lost_in says so
            pass

    def lost_in(self, round_: int) -> list[str]:
        try:
            return self.current.lost_in(round_)
        except StoreLost:  # the host went with the failure
            return [self._host_now().label()]

    def _host_now(self) -> Node:
        last = self._last or self.current.members
        return self._host or next(n for n in last if n.leader)

    def _move(self, lost: StoreLost) -> None:
        self._last = self._last or list(self.current.members)
        host, me, run_id = self._host_now(), self.current.me, self.current.run_id
        self.store.close()
        self.current.close()
        self.current, self.store, self._host = self._mover.move(lost, host, self._last, me, run_id)


class CurrentStore:
    """The current store helper of a :class:`MovingBoard`, for the agent."""

    def __init__(self, board: MovingBoard) -> None:
        self._board = board

    def __getattr__(self, name: str) -> Any:
        return getattr(self._board.store, name)
