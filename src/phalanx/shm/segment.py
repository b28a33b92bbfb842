"""The shared segment of one group: created, checked to be one host's, attached, anonymous.

Rank 0 of the group creates an anonymous ``memfd`` (never a name in any filesystem), sets it
to mode 0600 and writes a random token into it. Every member publishes its identity through
the group's store; only when all identities agree does each other member open the segment
through ``/proc/<rank 0's pid>/fd/<fd>`` and check the token (the probe). The result of every
member's probe is exchanged, so all members decide alike: shared memory, or plain Gloo.

Once every member has mapped it, rank 0 closes its descriptor: the segment lives exactly as
long as some member maps it, and nothing is left behind however the job ends.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import platform
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

# The token rank 0 writes and every member checks: 16 random bytes (os.urandom).
TOKEN_BYTES = 16
# Where the token lies: the first bytes of the segment, before the control blocks.
TOKEN_OFFSET = 0


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _namespace(kind: str) -> int:
    try:
        return os.stat(f"/proc/self/ns/{kind}").st_ino
    except OSError:
        return -1


def identity() -> dict[str, object]:
    """What makes two processes share memory: one kernel boot on one host, one PID namespace
    (so pids and ``/proc`` mean the same), an x86-64 CPU (the ordering argument of
    :mod:`phalanx.shm.channel` relies on its total store order). One network namespace too:
    processes in different ones are treated as different hosts (containers of one machine, or
    the two namespaces ``phalanx bench`` uses to emulate a slow link between hosts)."""
    pid_ns = _namespace("pid")
    return {
        "host": socket.gethostname(),
        "boot": _read("/proc/sys/kernel/random/boot_id"),
        "pid_ns": pid_ns,
        "net_ns": _namespace("net"),
        "machine": platform.machine(),
        "memfd": hasattr(os, "memfd_create") and hasattr(os, "pidfd_open"),
    }


def _usable(ids: list[dict[str, object]]) -> bool:
    first = ids[0]
    return (all(i == first for i in ids) and bool(first["boot"]) and first["memfd"] is True
            and first["machine"] in ("x86_64", "AMD64") and first["pid_ns"] != -1)


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long)
_LIBC.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_MAP_FAILED = ctypes.c_void_p(-1).value


class Mapping:
    """A shared mapping of a file that keeps no descriptor open (Python's ``mmap`` keeps a
    duplicate, through which another process of the user could reopen the segment from
    ``/proc/<pid>/fd``); ``buffer`` exposes its bytes."""

    def __init__(self, fd: int, nbytes: int) -> None:
        address = _LIBC.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if address in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), "mmap of the shared segment failed")
        self.address, self.nbytes = address, nbytes
        self.buffer = (ctypes.c_ubyte * nbytes).from_address(address)

    def close(self) -> None:
        """Unmap (only once no tensor or view of :attr:`buffer` is left)."""
        if self.address:
            _LIBC.munmap(self.address, self.nbytes)
            self.address = 0


@dataclass
class Segment:
    """A mapped segment and the pids of the group's members (``pids[r]`` is rank r's)."""

    mm: Mapping
    pids: list[int]


def _exchange(store: dist.Store, key: str, rank: int, size: int, value: object,
              timeout: timedelta) -> list[object]:
    store.set(f"{key}/{rank}", json.dumps(value))
    keys = [f"{key}/{r}" for r in range(size)]
    store.wait(keys, timeout)
    return [json.loads(store.get(k)) for k in keys]


def open_segment(store: dist.Store, rank: int, size: int, nbytes: int,
                 timeout: timedelta) -> Segment | None:
    """Collective over the group's store: the mapped segment when every member is on this
    host and could map it, else ``None`` on every member."""
    ids = _exchange(store, "shm/identity", rank, size, identity(), timeout)
    if not _usable(ids):  # type: ignore[arg-type]
        return None
    fd = -1
    if rank == 0:
        fd = os.memfd_create(f"phalanx-shm-{os.urandom(8).hex()}", os.MFD_CLOEXEC)
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, nbytes)
        token = os.urandom(TOKEN_BYTES)
        os.pwrite(fd, token, TOKEN_OFFSET)
        where = {"pid": os.getpid(), "fd": fd, "token": token.hex()}
    try:
        if rank == 0:
            store.set("shm/where", json.dumps(where))
        else:
            store.wait(["shm/where"], timeout)
            where = json.loads(store.get("shm/where"))
        mm = _attach(rank, where, nbytes)
        ok = _exchange(store, "shm/attached", rank, size, mm is not None, timeout)
    finally:
        if fd >= 0:
            os.close(fd)  # every member has mapped it (or given up): only mappings keep it
    if not all(ok):
        if mm is not None:
            mm.close()
        return None
    pids = _exchange(store, "shm/pid", rank, size, os.getpid(), timeout)
    return Segment(mm, [int(p) for p in pids])  # type: ignore[arg-type]


def _attach(rank: int, where: dict, nbytes: int) -> Mapping | None:
    """Map the segment rank 0 created, if this process can open it and its token matches."""
    path = f"/proc/{where['pid']}/fd/{where['fd']}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC) if rank else os.dup(where["fd"])
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size != nbytes:
            return None
        mm = Mapping(fd, nbytes)
    finally:
        os.close(fd)
    if bytes(mm.buffer[TOKEN_OFFSET:TOKEN_OFFSET + TOKEN_BYTES]) != bytes.fromhex(where["token"]):
        mm.close()
        return None
    return mm
