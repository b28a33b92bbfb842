"""Several nodes: who takes part in each round, and how each round ended.

Node 0's launcher (the *leader*, which hosts the launchers' store; once node 0 is lost, the
node the store moved to, :mod:`phalanx.launcher.relocate`) decides; the others
(*followers*) register and do as the store says. Everything goes through torch's
``TCPStore`` (``add``, ``set``, ``get``, ``check``, ``compare_set``); the keys:

``job``                    the leader's options; a node started with others is refused.
``joins``, ``join/J``      registration J of a launcher: its id, ``--node-rank``, workers, host.
``refused/ID``             why the leader refused launcher ID (a node rank taken, other options);
``refused/ID/read``        ID has read it (a leader refusing other options waits for it, 5 s at most).
``gone``, ``gone/ID``      written by node 0's gate when launcher ID's connection ends: ``exited``
                           (closed or reset by its end: the launcher exited or died, its
                           machine is up)
                           or ``unreachable`` (dropped by TCP keepalive within ~11 s: a dead
                           machine, or a cut network).
``roundR/ready/ID``        launcher ID stopped the workers of the round before R.
``roundR/layout``, ``latest``   the leader's decision: round R's nodes, in order; the last R.
``roundR/end``             how round R ended; the first record published wins.
``roundR/ack/ID``, ``roundR/lost``   after a failure: who is still there (see below).
``roundR/done``, ``roundR/done/ID``   how many nodes' workers all exited 0; node ID's did.
``final``                 the job's end, for nodes waiting outside a round.
``checked_out/ID``        launcher ID needs the store no more (it knows the job's end).

**Rounds.** The leader opens round R once every node of round R-1 that is still there is
ready, and at least ``--nnodes`` MIN nodes are (the first round also waits up to
``last_call_timeout`` for MAX), capped at MAX: the nodes of the last round first, then the
newcomers by ``--node-rank`` and arrival. Nodes left out wait for a later round. During a
round the leader ends it (``membership``) when one of its nodes is gone (not one whose
workers all exited 0: that node is done, not lost), or when a newcomer waits and the round
has fewer than MAX nodes; every node stops its workers and meets again.
A round opens only with more than half of the last round's nodes (those that exited do not
vote; see :func:`majority`), so that a side cut off from the others never runs the job a
second time. When a worker fails, every node acknowledges; the leader waits for each node's
acknowledgement or its ``gone`` mark (at most :data:`ACK_WAIT_S`) and publishes who is
lost: a failure with nodes lost is a membership change too, and uses no restart.
"""

from __future__ import annotations

import math
import socket
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import RendezvousError
from .config import LaunchConfig

# Keys written by node 0's gate (phalanx.launcher.storehost) and read here.
GONE_COUNT = "gone"
EXITED, UNREACHABLE = "exited", "unreachable"  # the values of gone/ID
# How often a waiting launcher looks at the store again: short next to a human's patience and
# to torch's own start-up, long enough that the polling costs nothing.
POLL_S = 0.05
# After a failure, how long the leader waits for a node that neither acknowledges nor is
# marked gone: a live launcher acknowledges within its --monitor-interval; a dead machine is
# marked gone within ~11 s (phalanx.gate.listen.DEAD_PEER_S). Past this, it is taken as lost.
ACK_WAIT_S = 15.0


def gone_key(node_id: str) -> str:
    return f"gone/{node_id}"


def checked_out_key(node_id: str) -> str:
    return f"checked_out/{node_id}"


def _key(round_: int, what: str) -> str:
    return f"round{round_}/{what}"


class MajorityLost(RendezvousError):
    """Too few of the last round's nodes are left to go on: this side of a split stops."""


def majority(staying: int, voters: int) -> bool:
    """Whether ``staying`` nodes are more than half of the ``voters``: the last round's nodes
    but those known to have exited (their connection closed by a live machine: they run no
    second job). Two sides of a split cannot both hold more than half of the same voters."""
    return 2 * staying > voters


@dataclass(frozen=True)
class Node:
    """One launcher: ``node_rank`` as given (``None``: numbered by arrival); ``addr:port``,
    where it can be reached: node 0's gate, or the others' standby gate
    (:mod:`phalanx.launcher.relocate`)."""

    id: str
    node_rank: int | None
    nproc: int
    host: str
    arrival: int = 0
    leader: bool = False
    addr: str = ""
    port: int = 0

    @classmethod
    def me(cls, config: LaunchConfig, nproc: int, leader: bool, addr: str, port: int) -> "Node":
        return cls(uuid.uuid4().hex[:12], config.node_rank, nproc, socket.gethostname(),
                   leader=leader, addr=addr, port=port)

    def name(self) -> str:
        """``"node 1"``; ``"the node on HOST"`` for a node numbered by arrival."""
        return f"the node on {self.host}" if self.node_rank is None else f"node {self.node_rank}"

    def label(self) -> str:
        """``"node 1 (HOST)"``; ``"the node on HOST"`` for a node numbered by arrival."""
        return self.name() if self.node_rank is None else f"{self.name()} ({self.host})"

    def order(self) -> tuple:
        return (not self.leader, math.inf if self.node_rank is None else self.node_rank,
                self.arrival)


@dataclass(frozen=True)
class Layout:
    """This node's place in one round, as the nodes agreed."""

    round: int
    world_size: int
    rank_offset: int
    nnodes: int
    node_rank: int  # GROUP_RANK: this node's position in the round
    run_id: str
    store_host: str
    store_port: int
    restarts: int = 0  # failed rounds restarted before this one
    members: tuple[str, ...] = ()  # each node's label, by position


class StoreLost(RendezvousError):
    """The launchers' store stopped answering: its host (the round's node 0) is gone."""


class Store:
    """The launchers' store, with errors that say what was lost."""

    def __init__(self, store: Any, where: str, me: str) -> None:
        self._store, self.where, self._me = store, where, me

    def __getattr__(self, name: str) -> Callable:
        fn = getattr(self._store, name)

        def call(*args: Any) -> Any:
            try:
                return fn(*args)
            except RuntimeError as e:  # DistNetworkError, DistStoreError
                raise StoreLost(
                    f"{self._me} lost the rendezvous store at {self.where} ({e}); node 0's "
                    "launcher has probably exited"
                ) from None
        return call

    def read(self, key: str) -> str | None:
        return self.get(key).decode() if self.check([key]) else None

    def release(self) -> None:
        self._store = None


def layout_for(me: Node, decision: dict, host: str, port: int, run_id: str) -> Layout | None:
    """``me``'s layout in a published round, or ``None`` when it is left out."""
    nodes = [Node(**n) for n in decision["nodes"]]
    ids = [n.id for n in nodes]
    if me.id not in ids:
        return None
    at = ids.index(me.id)
    counts = [n.nproc for n in nodes]
    return Layout(decision["round"], sum(counts), sum(counts[:at]), len(nodes), at, run_id,
                  host, port, decision["restarts"], tuple(n.label() for n in nodes))
