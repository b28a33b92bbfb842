"""How launchers and workers meet: listening sockets, the stores' host, the nodes' board.

Everything stands on torch's ``TCPStore``; what phalanx adds goes around it, not over its
wire (see :mod:`phalanx.gate`):

* **Binding.** Every listening socket is bound to one interface: the master's address for
  the gate (and for one node's workers), loopback for the rest, never all interfaces. A port
  already taken, or an address not of this host, is a :class:`~phalanx.errors.LaunchConfigError`.
* **The stores** live in each launcher's helper process (:class:`StoreHost`, see
  :mod:`phalanx.launcher.storehost`), on loopback, reachable only through a door that lets in
  this launcher and its workers, or (node 0) through the gate that lets in whoever proves the
  job secret. The workers' store is fresh every round, so a restarted group never reads the
  keys of the attempt before (torchrun reuses its store, and a restarted Gloo group can dial
  the dead attempt's addresses). Workers find it at ``MASTER_ADDR:MASTER_PORT``: the master
  address and port for one node, this node's door on loopback for several.
* **Several nodes** meet on node 0's launchers' store, through the board
  (:mod:`phalanx.launcher.board`): node 0 decides each round's nodes. When node 0 is lost,
  the store moves to the next node (:mod:`phalanx.launcher.relocate`).
"""

from __future__ import annotations

import errno
import json
import select
import socket
import sys
import time
import uuid
from dataclasses import replace
from datetime import timedelta
from typing import Any, Callable

from ..errors import LaunchConfigError, RendezvousError
from ..gate.handshake import Refused
from ..gate.listen import LOOPBACK, listen
from ..gate.relay import wait_for_gate
from ..gate.secret import HOW_TO_MAKE
from .board import LeaderBoard, NodeBoard
from .config import LaunchConfig
from .localboard import LocalBoard
from .membership import Layout, Node, Store
from .relocate import CurrentStore, Mover, MovingBoard, bind_standby, running_at
from .workers import Guardian, describe_exit, start_tied

# The helper's answer to "close": it ends the round's store at once; the bound covers a
# machine so loaded that the helper has not run for that long.
_CLOSE_WAIT_S = 60.0


class Interrupted(Exception):
    """A stop signal arrived while waiting for the other nodes."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _explain(host: str, port: int, e: OSError) -> Exception:
    """The :class:`LaunchConfigError` for a failed bind, or ``e`` itself."""
    if isinstance(e, socket.gaierror):
        return LaunchConfigError(f"Cannot resolve master address {host!r}: {e.strerror}")
    if e.errno == errno.EADDRINUSE:
        return LaunchConfigError(
            f"Master port {port} on {host} is already in use; choose another --master-port, "
            "or use --standalone to have a free port picked"
        )
    if e.errno == errno.EADDRNOTAVAIL:
        address = socket.getaddrinfo(host.strip("[]"), port)[0][4][0]
        return LaunchConfigError(
            f"Master address {host} ({address}) is not an address of this machine; "
            "node 0 must run on the host --master-addr names"
        )
    return e


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host``'s interface at ``port`` (0: a free port).

    Raises:
        LaunchConfigError: the port is in use, or ``host`` is not an address of this machine.
    """
    try:
        return listen(host, port)
    except OSError as e:
        raise _explain(host, port, e) from None


class StoreHost:
    """This launcher's helper process (:mod:`phalanx.launcher.storehost`) and its doors.

    Args:
        role: ``"local"``, ``"host"`` or ``"door"`` (see the helper's docstring).
        sockets: the listening sockets it serves, by name (``workers_door``,
            ``launcher_door``, ``gate``); this process closes its own copies.
        guardian: kills the helper with the launcher (not node 0's: it may linger).
        settings: the rest of the helper's configuration (secret, upstream, node, timeout).
    """

    def __init__(self, role: str, sockets: dict[str, socket.socket], guardian: Guardian,
                 **settings: Any) -> None:
        self.role = role
        self.ports = {name: sock.getsockname()[1] for name, sock in sockets.items()}
        fds = {name: sock.fileno() for name, sock in sockets.items()}
        command = [sys.executable, "-m", "phalanx.launcher.storehost"]
        self._proc = start_tied(command, pass_fds=tuple(fds.values()), control=True,
                                die_with_parent=role != "host")
        for sock in sockets.values():
            sock.close()
        if role != "host":
            self._guardian = guardian
            guardian.watch(self._proc.pid)
        self._send(json.dumps({"role": role, **fds, **settings}))

    def _send(self, line: str) -> None:
        try:
            self._proc.stdin.write(f"{line}\n".encode())
            self._proc.stdin.flush()
        except OSError:  # it has died: check() says so
            pass

    def check(self) -> None:
        """Raise if the helper has stopped."""
        if self._proc.poll() is not None:
            raise RendezvousError(
                f"The launcher's store helper stopped ({describe_exit(self._proc.returncode)}); "
                "see its error above"
            )

    def open_round(self) -> None:
        """A fresh workers' store; workers that connect before it is up wait for it."""
        if self.role != "door":
            self._send("open")

    def close_round(self) -> None:
        """End the round's workers' store (its keys go with it); returns once it is gone."""
        if self.role == "door" or self._proc.poll() is not None:
            return
        self._send("close")
        ready, _, _ = select.select([self._proc.stdout], [], [], _CLOSE_WAIT_S)
        if not ready or self._proc.stdout.readline() != b"closed\n":
            self.check()
            raise RendezvousError(f"The launcher's store helper did not close the round's "
                                  f"store within {_CLOSE_WAIT_S:g} s")

    def linger(self, nodes: list[str]) -> None:
        """Node 0: keep the launchers' store up after this launcher exits, until each of
        ``nodes`` (launcher ids) has checked out or is gone (bounded)."""
        self._send(" ".join(["linger", *nodes]))

    def kill(self) -> None:
        """Stop the helper at once (nothing was served yet)."""
        self._proc.kill()
        self._proc.wait()
        self.close()

    def close(self) -> None:
        """Let the helper go: end of file on its stdin."""
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        if self.role != "host":  # node 0's may linger: it ends itself (see linger)
            self._proc.wait()
            self._guardian.release(self._proc.pid)


# How long one attempt to reach the store helper may take: between attempts a stop signal is
# looked at (a TCPStore client retries on its own for its whole timeout, deaf to signals).
_CONNECT_TRY_S = 1.0


def _tcp_store(port: int, timeout: float, interrupted: Callable[[], None]) -> Any:
    """A client of the store helper's door on ``port``, with ``timeout`` for its operations;
    tried for at most ``timeout`` seconds, :class:`Interrupted` by a stop signal."""
    import torch.distributed as dist  # only launchers of several nodes need torch themselves

    deadline = time.monotonic() + timeout
    while True:
        attempt = max(0.1, min(_CONNECT_TRY_S, deadline - time.monotonic()))
        try:
            client = dist.TCPStore(LOOPBACK, port, None, False, timedelta(seconds=attempt))
        except RuntimeError:
            interrupted()
            if time.monotonic() >= deadline:
                raise
            continue
        client.set_timeout(timedelta(seconds=timeout))
        return client


def _who(config: LaunchConfig) -> str:
    return "This node" if config.node_rank is None else f"Node {config.node_rank}"


def _raise_if(interrupted: Callable[[], int | None]) -> None:
    signum = interrupted()
    if signum is not None:
        raise Interrupted(signum)


def _gate_listener(config: LaunchConfig) -> socket.socket | None:
    """Node 0's gate, bound to the master's address; ``None`` on the other nodes. A node
    numbered by arrival is node 0 when it can bind there (as torchrun's c10d host)."""
    if config.node_rank not in (0, None):
        return None
    try:
        return listen(config.master_addr, config.master_port)
    except OSError as e:
        if config.node_rank is None and e.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
            return None  # another launcher hosts it, or another machine: we join
        raise _explain(config.master_addr, config.master_port, e) from None


def _check_secret(config: LaunchConfig, interrupted: Callable[[], int | None]) -> None:
    """Wait for node 0's gate and prove the secret to it, before anything else."""
    where = f"{config.master_addr}:{config.master_port}"
    try:
        wait_for_gate(config.master_addr, config.master_port, config.job_secret.encode(),
                      config.rdzv_deadline, lambda: _raise_if(interrupted))
    except Refused as e:
        raise LaunchConfigError(
            f"{_who(config)}: node 0's launcher at {where} refused this node's job secret "
            f"({e}). Give every node the same PHALANX_JOB_SECRET or --job-secret-file "
            f"({HOW_TO_MAKE})"
        ) from None
    except TimeoutError:
        raise RendezvousError(
            f"{_who(config)} could not reach the master at {where} within "
            f"{config.rdzv_timeout:g} s (--rdzv-timeout). Is node 0's launcher running, and do "
            "--master-addr/--master-port name its address and port?"
        ) from None


def _one_node(config: LaunchConfig, nproc: int, guardian: Guardian) -> tuple[LocalBoard, StoreHost]:
    host = LOOPBACK if config.standalone else config.master_addr
    door = bind_listener(host, 0 if config.standalone else config.master_port)
    store = StoreHost("local", {"workers_door": door}, guardian, timeout=config.rdzv_timeout)
    run_id = config.run_id or uuid.uuid4().hex
    layout = Layout(0, nproc, 0, 1, 0, run_id, host, store.ports["workers_door"])
    return LocalBoard(layout), store


def _start_store(config: LaunchConfig, me: str, guardian: Guardian, role: str,
                 sockets: dict[str, socket.socket], upstream: list) -> StoreHost:
    """A store helper in ``role`` with fresh doors on loopback (and ``sockets``)."""
    doors = {"launcher_door": bind_listener(LOOPBACK, 0), "workers_door": bind_listener(LOOPBACK, 0)}
    return StoreHost(role, {**doors, **sockets}, guardian, secret=config.job_secret, node=me,
                     timeout=config.rdzv_timeout, upstream=upstream)


def _client(config: LaunchConfig, interrupted: Callable[[], int | None], store: StoreHost,
            where: str) -> Store:
    """The launchers' store, through ``store``'s launcher door."""
    try:
        return Store(_tcp_store(store.ports["launcher_door"], config.rdzv_timeout,
                                lambda: _raise_if(interrupted)), where, _who(config))
    except Interrupted:
        store.kill()
        raise
    except RuntimeError as e:  # DistNetworkError, DistStoreError
        store.kill()  # no round will be served: give the ports back now
        raise RendezvousError(f"{_who(config)} could not reach its store helper ({e})") from None


def meet(config: LaunchConfig, nproc: int, interrupted: Callable[[], int | None],
         guardian: Guardian, note: Callable[[str], None]) -> tuple[Any, Any]:
    """Bind, host or reach the stores this node needs; return (board, store host). The
    board is not started yet (``board.start()`` registers with node 0).

    ``interrupted()`` returns a stop signal's number once one has arrived, else ``None``.
    """
    if not config.multi_node:
        return _one_node(config, nproc, guardian)
    running = running_at(config, lambda: _raise_if(interrupted))
    if running is not None:  # a job already runs there (its store moved): join it
        config = replace(config, master_addr=running[0], master_port=running[1])
    gate = None if running is not None else _gate_listener(config)
    standby = None
    if gate is None:
        _check_secret(config, interrupted)
        standby = bind_standby(config)
        addr, port = standby.getsockname()[:2]
    else:
        addr, port = config.master_addr.strip("[]"), config.master_port
    me = Node.me(config, nproc, gate is not None, addr, port)
    upstream = [config.master_addr.strip("[]"), config.master_port]
    store = _start_store(config, me.id, guardian, "door" if gate is None else "host",
                         {} if gate is None else {"gate": gate}, upstream)
    client = _client(config, interrupted, store, f"{config.master_addr}:{config.master_port}")
    raise_if = lambda: _raise_if(interrupted)  # noqa: E731
    args = (client, me, config, raise_if, store.ports["workers_door"], note)
    board = NodeBoard(*args) if gate is None else LeaderBoard(*args, open_store=store.open_round)
    mover = Mover(config, standby,
                  lambda role, sockets, up: _start_store(config, me.id, guardian, role, sockets, up),
                  lambda helper, where: _client(config, interrupted, helper, where), raise_if, note)
    moving = MovingBoard(board, store, mover)
    return moving, CurrentStore(moving)
