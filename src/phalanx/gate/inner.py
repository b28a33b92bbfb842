"""The real store: torch's ``TCPStore`` on loopback, which only the gate and doors can reach.

A ``TCPStore`` server accepts whoever connects; it has no hook to check a client. So it
listens on loopback only, and once its own client (a ``TCPStore`` server always connects to
itself) is in, its listening socket requires TCP-MD5 signatures (RFC 2385, the kernel's
``TCP_MD5SIG``, as BGP routers use) with a random key only this process knows, from every
IPv4 peer: the kernel drops any other process's connection attempt before the store sees a
byte. The gate and the doors sign their connections with that key (:meth:`InnerStore.connect`).

Before the key is set, someone could slip in; the store is then checked to have exactly its
own client, and made again otherwise. A kernel built without TCP-MD5 (``CONFIG_TCP_MD5SIG``)
leaves the loopback store reachable by this host's processes: a warning says so.
"""

from __future__ import annotations

import os
import secrets
import socket
import struct
from datetime import timedelta
from typing import Any, Callable

from .listen import LOOPBACK, listen
from .peers import established_to

# <linux/tcp.h>: TCP_MD5SIG takes one peer address, TCP_MD5SIG_EXT also a prefix length.
_TCP_MD5SIG, _TCP_MD5SIG_EXT, _TCP_MD5SIG_FLAG_PREFIX = 14, 32, 1
_SOCKADDR_STORAGE = 128  # sizeof(struct sockaddr_storage)
_KEY_BYTES = 32  # of the 80 TCP_MD5SIG_MAXKEYLEN allows
# A store with a stranger in it is made again; three strangers in a row is an attack.
_ATTEMPTS = 3


def _md5sig(key: bytes, address: str, prefix: int | None) -> bytes:
    """A ``struct tcp_md5sig``: the peer (address, or a prefix of addresses), the key."""
    peer = struct.pack("=H", socket.AF_INET) + b"\0\0" + socket.inet_aton(address)
    flags = 0 if prefix is None else _TCP_MD5SIG_FLAG_PREFIX
    return (peer.ljust(_SOCKADDR_STORAGE, b"\0")
            + struct.pack("=BBHi", flags, prefix or 0, len(key), 0) + key.ljust(80, b"\0"))


def _require_signatures(listener: socket.socket, key: bytes) -> bool:
    """Make ``listener`` drop every IPv4 connection not signed with ``key``; False when the
    kernel cannot."""
    try:
        listener.setsockopt(socket.IPPROTO_TCP, _TCP_MD5SIG_EXT, _md5sig(key, "0.0.0.0", 0))
    except OSError:
        return False
    return True


class InnerStore:
    """A ``TCPStore`` server on loopback that only signed connections reach (see the module
    docstring). :attr:`store` is the server's own client.

    Args:
        timeout: the store's operation timeout, in seconds.
        warn: called with a message when this kernel cannot require signatures.
    """

    def __init__(self, timeout: float, warn: Callable[[str], None]) -> None:
        import torch.distributed as dist  # only the processes hosting a store pay for torch

        self._key = secrets.token_bytes(_KEY_BYTES)
        for _ in range(_ATTEMPTS):
            listener = listen(LOOPBACK, 0)
            self.port = listener.getsockname()[1]
            self.store: Any = dist.TCPStore(
                LOOPBACK, self.port, None, True, timedelta(seconds=timeout),
                wait_for_workers=False, master_listen_fd=os.dup(listener.fileno()))
            self.signed = _require_signatures(listener, self._key)
            listener.close()  # the server listens on its own copy, which keeps the key
            if not self.signed:
                warn(f"this kernel has no TCP-MD5 (CONFIG_TCP_MD5SIG): the store on "
                     f"{LOOPBACK}:{self.port} is open to every process of this host")
                return
            if established_to(self.port) == 1:  # its own client, and no one else
                return
            self.close()
        raise RuntimeError(f"someone connected to the store on {LOOPBACK} before it was "
                           f"locked, {_ATTEMPTS} times in a row")

    def connect(self) -> socket.socket:
        """A connection to the store, signed with its key."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            if self.signed:
                sock.setsockopt(socket.IPPROTO_TCP, _TCP_MD5SIG, _md5sig(self._key, LOOPBACK, None))
            sock.connect((LOOPBACK, self.port))
        except BaseException:
            sock.close()
            raise
        return sock

    def close(self) -> None:
        """Stop the server: its connections close, its keys are gone."""
        self.store = None  # torch stops the server when its last reference goes
