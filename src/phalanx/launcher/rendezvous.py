"""How launchers and workers meet: listening sockets, node 0's stores, the other nodes' view.

Everything here stands on torch's ``TCPStore``; no protocol of our own goes over the wire.

* **Binding.** Every listening socket is bound to the master address's interface (loopback for
  ``--standalone``), never to all interfaces, and handed to ``TCPStore`` with
  ``master_listen_fd``. A port already taken is a :class:`~phalanx.errors.LaunchConfigError`.
* **The workers' store** (:class:`WorkerStore`), what ``MASTER_ADDR:MASTER_PORT`` point at, is
  hosted by node 0's launcher (``TORCHELASTIC_USE_AGENT_STORE=True``, as torchrun does), in a
  child process of its own. Each round gets a *new* ``TCPStore`` server on the same listening
  socket, so a restarted group never reads the keys of the attempt before (torchrun reuses its
  store, and a restarted Gloo group can dial the dead attempt's addresses). Connections made
  while no server runs wait in the socket's backlog.
* **Several nodes** (:class:`NodeBoard`): node 0's launcher also hosts a rendezvous store at
  ``--master-addr:--master-port``; every launcher registers there, they agree on the world size
  and rank offsets, hold a barrier before each round, and publish how each round ended.
  One node alone uses :class:`LocalBoard`, the same verbs without a store.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

from ..errors import LaunchConfigError, RendezvousError
from .config import LaunchConfig
from .outcome import RoundEnd
from .workers import Guardian, describe_exit, start_tied

# How often a waiting launcher looks at the store again: short next to a human's patience and
# to torch's own start-up, long enough that the polling costs nothing.
_POLL_S = 0.05
# A node's launcher reads the final outcome, checks out, then stops its workers; node 0 keeps
# the store up until every node has checked out, but never longer than this for a dead node.
_CHECK_OUT_WAIT_S = 30.0
# One attempt to connect to the master: within 2 s a listening host answers a SYN even after
# one retransmission (Linux's initial retransmission timeout is 1 s, RFC 6298); never under
# 0.1 s, so the last attempt before the deadline still has a round trip's time.
_CONNECT_TRY_S = 2.0
_CONNECT_TRY_MIN_S = 0.1
# Between refused attempts: 4 polls (0.2 s), nothing next to the time node 0's launcher may
# take to start (--rdzv-timeout, 600 s by default), and a node waiting that long never spins.
_CONNECT_RETRY_S = 4 * _POLL_S


class Interrupted(Exception):
    """A stop signal arrived while waiting for the other nodes."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _resolve(host: str, port: int) -> list[tuple]:
    try:
        return socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise LaunchConfigError(f"Cannot resolve master address {host!r}: {e.strerror}") from None


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host``'s interface at ``port`` (0: a free port).

    Raises:
        LaunchConfigError: the port is in use, or ``host`` is not an address of this machine.
    """
    family, _, _, _, sockaddr = _resolve(host, port)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # Lets a relaunch bind a port whose previous connections linger in TIME_WAIT; a port
        # someone listens on is still refused.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)  # every worker of every node connects at once
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise LaunchConfigError(
                f"Master port {port} on {host} is already in use; choose another --master-port, "
                "or use --standalone to have a free port picked"
            ) from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise LaunchConfigError(
                f"Master address {host} ({sockaddr[0]}) is not an address of this machine; "
                "node 0 must run on the host --master-addr names"
            ) from None
        raise
    return sock


def wait_reachable(host: str, port: int, timeout: float, node_rank: int, interrupted) -> float:
    """Wait until something accepts connections at ``host:port``; return the seconds left.

    Raises:
        RendezvousError: nothing answered within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        _raise_if(interrupted)
        left = deadline - time.monotonic()
        try:
            try_s = max(_CONNECT_TRY_MIN_S, min(left, _CONNECT_TRY_S))
            with socket.create_connection((host.strip("[]"), port), timeout=try_s):
                return max(left, _POLL_S)
        except OSError:
            if left <= 0:
                raise RendezvousError(
                    f"Node {node_rank} could not reach the master at {host}:{port} within "
                    f"{timeout:g} s (--rdzv-timeout). Is node 0's launcher running, and do "
                    "--master-addr/--master-port name its address and port?"
                ) from None
            time.sleep(min(_CONNECT_RETRY_S, max(left, 0)))


def _raise_if(interrupted: Callable[[], int | None]) -> None:
    signum = interrupted()
    if signum is not None:
        raise Interrupted(signum)


def _tcp_store(host: str, port: int, timeout: float, listener: socket.socket | None):
    import torch.distributed as dist  # only launchers of several nodes need torch themselves

    fd = None if listener is None else os.dup(listener.fileno())
    return dist.TCPStore(
        host.strip("[]"), port, None, listener is not None, timedelta(seconds=timeout),
        wait_for_workers=False, master_listen_fd=fd,
    )


class WorkerStore:
    """The workers' store, hosted by node 0's launcher: a fresh ``TCPStore`` server per round
    on one listening socket (see the module docstring), served by a child process
    (:mod:`phalanx.launcher.storehost`) that is tied to the launcher like the workers."""

    def __init__(self, listener: socket.socket, host: str, guardian: Guardian) -> None:
        self._listener = listener
        self.host = host
        self.port = listener.getsockname()[1]
        self._guardian = guardian
        self._server: subprocess.Popen | None = None

    def open_round(self) -> None:
        """Start this round's server; connections already waiting are served once it runs."""
        self.close_round()
        fd = self._listener.fileno()
        command = [sys.executable, "-m", "phalanx.launcher.storehost", str(fd), self.host, str(self.port)]
        self._server = start_tied(command, pipe_output=False, pass_fds=(fd,))
        self._guardian.watch(self._server.pid)

    def check(self) -> None:
        """Raise if this round's server has stopped."""
        if self._server is not None and self._server.poll() is not None:
            raise RendezvousError(
                f"The workers' store on {self.host}:{self.port} stopped "
                f"({describe_exit(self._server.returncode)}); see its error above"
            )

    def close_round(self) -> None:
        """Stop this round's server (its keys go with it)."""
        if self._server is not None:
            self._server.kill()
            self._server.wait()
            self._guardian.release(self._server.pid)
            self._server = None

    def close(self) -> None:
        self.close_round()
        self._listener.close()


@dataclass(frozen=True)
class Layout:
    """Where this node's workers sit in the job, as the nodes agreed."""

    world_size: int
    rank_offset: int
    nnodes: int
    run_id: str
    store_host: str
    store_port: int


class LocalBoard:
    """One node: how a round ended, kept in memory."""

    nnodes = 1

    def __init__(self) -> None:
        self._ends: dict[int, RoundEnd] = {}
        self._done: set[int] = set()

    def publish_end(self, round_: int, record: RoundEnd) -> RoundEnd:
        """Record how ``round_`` ended unless it already is; return the record that stands."""
        return self._ends.setdefault(round_, record)

    def end_record(self, round_: int) -> RoundEnd | None:
        return self._ends.get(round_)

    def report_done(self, round_: int) -> None:
        self._done.add(round_)

    def all_done(self, round_: int) -> bool:
        return round_ in self._done

    def check_out(self) -> None:
        """Nothing to tell anyone."""

    def close(self) -> None:
        """Nothing to release."""


class NodeBoard:
    """Several nodes: registration, round barriers and round outcomes in node 0's store."""

    def __init__(self, store: Any, config: LaunchConfig, interrupted) -> None:
        self._store = store
        self._node = config.node_rank
        self.nnodes = config.nnodes
        self._where = f"{config.master_addr}:{config.master_port}"
        self._timeout = config.rdzv_timeout
        self._interrupted = interrupted
        self._checked_out = False

    def _op(self, fn: Callable, *args: Any) -> Any:
        try:
            return fn(*args)
        except RuntimeError as e:  # DistNetworkError, DistStoreError
            raise RendezvousError(
                f"Node {self._node} lost the rendezvous store at {self._where} ({e}); "
                "node 0's launcher has probably exited"
            ) from None

    def _wait(self, keys: list[str], what: str, nodes: list[int]) -> None:
        deadline = time.monotonic() + self._timeout
        while not self._op(self._store.check, keys):
            _raise_if(self._interrupted)
            if time.monotonic() > deadline:
                missing = [n for n, k in zip(nodes, keys) if not self._op(self._store.check, [k])]
                raise RendezvousError(
                    f"Node(s) {missing} did not {what} within {self._timeout:g} s "
                    f"(--rdzv-timeout) at {self._where}"
                )
            time.sleep(_POLL_S)

    def join(self, nproc: int, config: LaunchConfig, store_port: int | None) -> Layout:
        """Register this node and wait for all; every node checks they were started alike."""
        if self._op(self._store.add, f"node{self._node}/claims", 1) != 1:
            raise RendezvousError(
                f"Node rank {self._node} is already taken at {self._where}: give each "
                "launcher its own --node-rank"
            )
        info = {"nproc": nproc, "host": socket.gethostname(), "nnodes": config.nnodes,
                "max_restarts": config.max_restarts}
        if self._node == 0:
            info.update(run_id=config.run_id or str(uuid.uuid4()), store_port=store_port)
        # Other nodes read node 0's options before publishing their own: a launcher started
        # with another --nnodes fails at once instead of waiting for nodes that will never
        # come, and it needs the store no more once node 0 (which may then exit) can see it.
        if self._node != 0:
            self._wait(["node0/info"], "join", [0])
            first = json.loads(self._op(self._store.get, "node0/info"))
        self._op(self._store.set, f"node{self._node}/info", json.dumps(info))
        if self._node != 0:
            self._check_alike({0: first, self._node: info})
        nodes = list(range(self.nnodes))
        self._wait([f"node{n}/info" for n in nodes], "join", nodes)
        infos = [json.loads(self._op(self._store.get, f"node{n}/info")) for n in nodes]
        self._check_alike(dict(enumerate(infos)))
        counts = [i["nproc"] for i in infos]
        return Layout(
            world_size=sum(counts), rank_offset=sum(counts[: self._node]), nnodes=self.nnodes,
            run_id=infos[0]["run_id"], store_host=config.master_addr,
            store_port=infos[0]["store_port"],
        )

    @staticmethod
    def _check_alike(infos: dict[int, dict]) -> None:
        """Every launcher must be started with node 0's --nnodes and --max-restarts."""
        for key in ("nnodes", "max_restarts"):
            for node, info in sorted(infos.items()):
                if info[key] != infos[0][key]:
                    raise RendezvousError(
                        f"The launchers disagree on --{key.replace('_', '-')}: node 0 has "
                        f"{infos[0][key]}, node {node} has {info[key]}; start every node with "
                        "the same options"
                    )

    def start_round(self, round_: int, open_store: Callable[[], None] | None) -> None:
        """Barrier before a round: node 0 opens the round's store once every node has
        stopped the workers of the round before; then all start theirs."""
        if self._node == 0:
            others = list(range(1, self.nnodes))
            self._wait([f"round{round_}/ready{n}" for n in others], f"join round {round_}", others)
            if open_store is not None:
                open_store()
            self._op(self._store.set, f"round{round_}/open", "1")
        else:
            self._op(self._store.set, f"round{round_}/ready{self._node}", "1")
            self._wait([f"round{round_}/open"], f"open round {round_}", [0])

    def publish_end(self, round_: int, record: RoundEnd) -> RoundEnd:
        won = self._op(self._store.compare_set, f"round{round_}/end", "", record.to_json())
        return RoundEnd.from_json(won)

    def end_record(self, round_: int) -> RoundEnd | None:
        key = f"round{round_}/end"
        if not self._op(self._store.check, [key]):
            return None
        return RoundEnd.from_json(self._op(self._store.get, key))

    def report_done(self, round_: int) -> None:
        self._op(self._store.add, f"round{round_}/done", 1)

    def all_done(self, round_: int) -> bool:
        return self._op(self._store.add, f"round{round_}/done", 0) >= self.nnodes

    def check_out(self) -> None:
        """This node needs the store no more."""
        self._op(self._store.add, "checked_out", 1)
        self._checked_out = True

    def close(self) -> None:
        """Node 0, once the job has ended, keeps the store up until every node has checked
        out (bounded); after a rendezvous failure nobody will."""
        if self._node == 0 and self._checked_out:
            deadline = time.monotonic() + _CHECK_OUT_WAIT_S
            while time.monotonic() < deadline:
                if self._op(self._store.add, "checked_out", 0) >= self.nnodes:
                    break
                time.sleep(_POLL_S)
        self._store = None


def meet(config: LaunchConfig, nproc: int, interrupted,
         guardian: Guardian) -> tuple[Any, WorkerStore | None, Layout]:
    """Bind, host or reach the stores this node needs; return (board, worker store, layout).

    ``interrupted()`` returns a stop signal's number once one has arrived, else ``None``.
    """
    if config.nnodes == 1:
        host = "127.0.0.1" if config.standalone else config.master_addr
        listener = bind_listener(host, 0 if config.standalone else config.master_port)
        store = WorkerStore(listener, host, guardian)
        layout = Layout(nproc, 0, 1, config.run_id or str(uuid.uuid4()), host, store.port)
        return LocalBoard(), store, layout
    if config.node_rank != 0:
        return _join(config, nproc, interrupted, None, _reach_store(config, interrupted))
    listener = bind_listener(config.master_addr, config.master_port)
    worker_store = None
    try:
        worker_store = WorkerStore(bind_listener(config.master_addr, 0), config.master_addr,
                                   guardian)
        store = _tcp_store(config.master_addr, config.master_port, config.rdzv_timeout, listener)
        listener.close()  # the store listens on its own copy
        return _join(config, nproc, interrupted, worker_store, store)
    except BaseException:  # no round will be served: give both ports back
        listener.close()
        if worker_store is not None:
            worker_store.close()
        raise


def _reach_store(config: LaunchConfig, interrupted) -> Any:
    """Other nodes: wait for node 0's rendezvous store, then connect to it."""
    left = wait_reachable(config.master_addr, config.master_port, config.rdzv_timeout,
                          config.node_rank, interrupted)
    try:
        return _tcp_store(config.master_addr, config.master_port, left, None)
    except RuntimeError as e:  # DistNetworkError, DistStoreError
        raise RendezvousError(
            f"Node {config.node_rank} reached {config.master_addr}:{config.master_port} but "
            f"found no phalanx/torch store there ({e}); is that node 0's launcher?"
        ) from None


def _join(config: LaunchConfig, nproc: int, interrupted, worker_store: WorkerStore | None,
          store: Any) -> tuple[NodeBoard, WorkerStore | None, Layout]:
    board = NodeBoard(store, config, interrupted)
    layout = board.join(nproc, config, worker_store.port if worker_store else None)
    return board, worker_store, layout
