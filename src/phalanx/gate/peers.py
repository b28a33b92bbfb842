"""Who is on the other end of a local TCP connection: the process that owns the socket.

A door (see :mod:`phalanx.gate.relay`) lets in only connections made by processes it knows:
its launcher and that launcher's workers (or, for a process without a launcher, the process
itself). Linux lists every TCP socket of the network namespace in ``/proc/net/tcp`` and
``/proc/net/tcp6`` with its addresses and inode, and ``/proc/PID/fd`` links each open socket
to ``socket:[inode]``; a process may read the links of its own user's processes only, which is
what is needed. No new protocol and no privileges: the kernel's own bookkeeping.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Iterable

_ESTABLISHED = "01"  # the kernel's TCP_ESTABLISHED, as /proc/net/tcp writes st


def _hex_address(family: int, host: str, port: int) -> str:
    """An address as /proc/net/tcp{,6} writes it: the address's 32-bit words in host byte
    order (little-endian here), then the port, all in upper-case hex."""
    packed = socket.inet_pton(family, host)
    words = struct.unpack(f"<{len(packed) // 4}I", packed)
    return "".join(f"{w:08X}" for w in words) + f":{port:04X}"


def _table(family: int) -> list[list[str]]:
    name = "/proc/net/tcp6" if family == socket.AF_INET6 else "/proc/net/tcp"
    with open(name) as f:
        return [line.split() for line in f.readlines()[1:]]


def _forms(family: int, host: str, port: int) -> list[tuple[int, str]]:
    """Where a socket with this address may be listed: an IPv4 address also appears in
    ``/proc/net/tcp6``, v4-mapped, for an IPv6 socket (torch's sockets are IPv6 ones)."""
    forms = [(family, _hex_address(family, host, port))]
    if family == socket.AF_INET:
        forms.append((socket.AF_INET6, _hex_address(socket.AF_INET6, f"::ffff:{host}", port)))
    return forms


def peer_inode(conn: socket.socket) -> int | None:
    """The inode of the socket at the other end of ``conn``, a connection within this host
    (``None`` when the other end is not a socket of this network namespace)."""
    peers_at = _forms(conn.family, *conn.getpeername()[:2])
    locals_at = dict(_forms(conn.family, *conn.getsockname()[:2]))
    for family, peer in peers_at:
        for fields in _table(family):
            if fields[1] == peer and fields[2] == locals_at[family]:
                return int(fields[9])
    return None


def established_to(port: int, family: int = socket.AF_INET) -> int:
    """How many established connections to local ``port`` there are (accepted or waiting in
    its backlog): the server side of each, counted once."""
    suffix = f":{port:04X}"
    return sum(1 for f in _table(family) if f[1].endswith(suffix) and f[3] == _ESTABLISHED)


def owner(inode: int, pids: Iterable[int]) -> int | None:
    """The first of ``pids`` that holds the socket ``inode`` open, else ``None``."""
    target = f"socket:[{inode}]"
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or another user's
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    return pid
            except OSError:
                continue
    return None


def descendants(root: int) -> list[int]:
    """``root`` and every process below it, by parent pid (``/proc/PID/stat``)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # "pid (comm) state ppid ...": comm may hold spaces and parentheses
                ppid = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def connected_by(conn: socket.socket, pids: Iterable[int]) -> int | None:
    """The process among ``pids`` that made the connection ``conn`` was accepted from."""
    inode = peer_inode(conn)
    return None if inode is None else owner(inode, pids)
