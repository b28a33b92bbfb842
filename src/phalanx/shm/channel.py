"""The step every shared-memory collective is made of: write, arrive, wait for all, read.

Each member owns a control block (its arrival count and the header of the collective it is
in) and a data slot in each of two halves of the staging area. Step ``s`` uses half
``s % 2``: a member writes its slot of that half, publishes the header, then its arrival
count ``s``, and waits until every member has arrived at ``s``; then it reads any slot of
that half. A member writes half ``s % 2`` again only at step ``s + 2``, after every member
arrived at ``s + 1``, that is after every member finished reading step ``s``: one wait per
step is all the synchronisation there is.

Ordering: data and header are stored before the arrival count by the same thread, and read
after it; x86-64's total store order keeps those stores, and those loads, in program order,
which is why a group uses shared memory only on x86-64 (:func:`phalanx.shm.segment.identity`).

Waiting: a member looks at the peer's arrival count a few times, then, on the caller's thread
(a blocking collective), yields the CPU at each look for up to 2 ms (the lowest latency), then
sleeps in the kernel on the count (a futex) without Python's GIL, woken by the peer's arrival.
The group's worker thread (asynchronous collectives, DDP's buckets) sleeps at once: a thread
that yields in a loop takes the GIL back at every look and starves the training thread of it.
A member about to sleep raises its flag; a member that arrives wakes the peers whose flag is
up. No wake-up is missed: the arriving member stores its count, then a full barrier (a locked
instruction: :func:`_fence`), then reads the flags; the sleeping one stores its flag, then the
kernel's ``futex_wait`` takes a full barrier before it compares the count with the one the
member saw (Linux's futex ordering, barrier "A"). Of two such store-barrier-load sequences one
sees the other's store: the sleeper finds the count changed and does not sleep, or the arriving
member sees the flag and wakes it. So a sleep lasts until the peer arrives, or until the next
liveness check (below): a thread waiting for a late peer wakes once, not every few ms.

While waiting, a member checks every ~50 ms that each member it waits for still lives (a
pidfd per peer, readable once that process has exited): a peer killed at any point makes
every survivor raise within about that, naming it. The group's timeout bounds any wait.
"""

from __future__ import annotations

import ctypes
import os
import select
import threading
import time
from typing import Callable

import torch

from ..errors import CollectiveMismatchError, CollectiveTimeoutError, RankExitedError, ranks_text
from .segment import Segment

# The first page holds the token; control blocks start at the second (4096: a page).
_CONTROL_OFFSET = 4096
# One control block per member, 128 bytes: two 64-byte cache lines, so that no two members
# write the same line, nor a line the adjacent-line prefetcher pairs with another's.
_BLOCK_BYTES = 128
_BLOCK_WORDS = _BLOCK_BYTES // 8
# Header words: two per collective (see :func:`phalanx.shm.ops.header`); one header per half,
# at words 1 and 9 of the block (a member may publish step s + 1's header while another still
# reads step s's).
HEADER_WORDS = 2
_HEADER_AT = (1, 9)
# Word 4 of a block: raised while that member sleeps on a peer's arrival count (the futex).
_SLEEPING_AT = 4
# Liveness checks every 50 ms while waiting: a dead peer is named within about that.
_LIVENESS_S = 0.05
# Waiting starts with a few looks without a system call (when the group has no more members
# than this process has CPUs), then yields the CPU at each look; after 2 ms it sleeps on the
# futex until woken (the group's worker thread sleeps at once), which spares a machine with more
# ranks than cores. A longer spin (300 looks, ~30 us) measured slower on a loaded 2-core
# machine: a peer that shares the spinner's core waits for the spin to end.
_SPIN_LOOKS = 20
_YIELD_S = 0.002
# The longest sleep on the futex before looking again: the liveness checks' period (no wake-up
# is missed: see the module's notes).
_SLEEP_S = _LIVENESS_S

# futex(2) on x86-64 (the only architecture a group uses shared memory on): FUTEX_WAIT through a
# foreign call that releases the GIL, FUTEX_WAKE through one that keeps it (it never blocks).
# Not FUTEX_PRIVATE: the word is in memory shared between processes.
_SYS_FUTEX, _FUTEX_WAIT, _FUTEX_WAKE = 202, 0, 1
_futex_wait = ctypes.CDLL(None, use_errno=True).syscall
_futex_wait.restype = ctypes.c_long
_futex_wait.argtypes = (ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint,
                        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)
_futex_wake = ctypes.PyDLL(None, use_errno=True).syscall
_futex_wake.restype = ctypes.c_long
_futex_wake.argtypes = (ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)


# A full memory barrier: a lock-prefixed instruction (glibc's and musl's pthread_spin_trylock are
# one ``lock cmpxchg`` on x86-64, which fences whatever it finds; the unlock keeps the lock free,
# so no implementation may skip the atomic for a lock it sees taken). x86-64 reorders a store
# with a later load of another address; this orders the arrival before the look at the flags.
_spin_init, _spin_trylock, _spin_unlock = (
    ctypes.PyDLL(None)[name] for name in ("pthread_spin_init", "pthread_spin_trylock",
                                          "pthread_spin_unlock"))
_spin_init.argtypes = (ctypes.c_void_p, ctypes.c_int)
_spin_trylock.argtypes = _spin_unlock.argtypes = (ctypes.c_void_p,)
_FENCE_LOCK = ctypes.c_int(0)  # a pthread_spinlock_t: an int
_FENCE_ADDRESS = ctypes.addressof(_FENCE_LOCK)
_spin_init(_FENCE_ADDRESS, 0)


def _fence() -> None:
    """A full memory barrier (stores before it are visible before loads after it)."""
    _spin_trylock(_FENCE_ADDRESS)
    _spin_unlock(_FENCE_ADDRESS)


class _Timespec(ctypes.Structure):
    _fields_ = (("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long))


_SLEEP = _Timespec(0, int(_SLEEP_S * 1e9))
# Typed views of the slots kept per (dtype, shape), for the one-step collectives: at most this
# many shapes (then the cache starts again), so no call that repeats a shape builds any.
_VIEWS_KEPT = 256


class BrokenGroupError(RuntimeError):
    """Internal: marks errors after which the group cannot be used again."""


def layout(size: int, capacity: int) -> tuple[int, int]:
    """``(data offset, total bytes)`` of a segment for ``size`` members of ``capacity`` bytes."""
    control = -(-size * _BLOCK_BYTES // 4096) * 4096
    data = _CONTROL_OFFSET + control
    return data, data + 2 * size * capacity


class Channel:
    """The steps of one group over its segment (see the module's notes)."""

    def __init__(self, segment: Segment, rank: int, size: int, capacity: int,
                 timeout_s: float, describe: Callable[[tuple[int, ...]], str]) -> None:
        self.rank, self.size, self.capacity = rank, size, capacity
        self.timeout_s = timeout_s
        self._describe = describe
        self._mm = segment.mm
        self._bytes = memoryview(segment.mm.buffer).cast("B")
        self._words = self._bytes[_CONTROL_OFFSET:].cast("q")
        data, total = layout(size, capacity)
        self._data = torch.frombuffer(segment.mm.buffer, dtype=torch.uint8, offset=data,
                                      count=total - data)
        self.seq = 0
        self._base = rank * _BLOCK_WORDS
        self._peers = [r * _BLOCK_WORDS for r in range(size) if r != rank]
        self._spin = _SPIN_LOOKS if size <= len(os.sched_getaffinity(0)) else 0
        words_at = segment.mm.address + _CONTROL_OFFSET
        self._address = [ctypes.c_void_p(words_at + 8 * r * _BLOCK_WORDS) for r in range(size)]
        self._sleep = ctypes.byref(_SLEEP)
        # The thread that must not yield in a loop (the group's worker); set by the group.
        self.worker_ident: int | None = None
        self._views: dict[tuple, tuple] = {}
        self._pidfds: dict[int, int] = {}
        self._poll = select.poll()
        for r, pid in enumerate(segment.pids):
            if r != rank:
                try:
                    fd = os.pidfd_open(pid)
                except ProcessLookupError:
                    raise RankExitedError(f"phalanx_shm: rank {r} (pid {pid}) exited while "
                                          "the group was being created", [r]) from None
                self._pidfds[fd] = r
                self._poll.register(fd, select.POLLIN)

    def slot(self, rank: int, seq: int | None = None) -> torch.Tensor:
        """Member ``rank``'s bytes in the half of step ``seq`` (default: the next step)."""
        half = (self.seq + 1 if seq is None else seq) % 2
        start = (half * self.size + rank) * self.capacity
        return self._data[start:start + self.capacity]

    def views(self, dtype: torch.dtype, shape: torch.Size) -> tuple[list[torch.Tensor], ...]:
        """Every member's slot in each half, as a tensor of ``dtype`` and ``shape`` (which must
        fit the capacity): ``views(...)[half][rank]``. Kept, so a repeated shape costs a look-up."""
        key = (dtype, shape)
        found = self._views.get(key)
        if found is None:
            if len(self._views) >= _VIEWS_KEPT:
                self._views.clear()
            nbytes = shape.numel() * dtype.itemsize
            found = self._views[key] = tuple(
                [self._data[(half * self.size + r) * self.capacity:][:nbytes].view(dtype).view(shape)
                 for r in range(self.size)] for half in (0, 1))
        return found

    def scatter_views(self, dtype: torch.dtype, numel: int,
                      per: int) -> tuple[tuple[torch.Tensor, list[torch.Tensor]], ...]:
        """For a reduce-scatter of ``numel`` elements a member, whose pieces lie ``per``
        elements apart in each slot: per half, this member's slot as ``(size, numel)`` and
        every member's piece for this member. Kept like :meth:`views`."""
        key = (dtype, numel, per)
        found = self._views.get(key)
        if found is None:
            if len(self._views) >= _VIEWS_KEPT:
                self._views.clear()
            nbytes = self.size * per * dtype.itemsize
            halves = []
            for half in (0, 1):
                slots = [self._data[(half * self.size + r) * self.capacity:][:nbytes]
                         .view(dtype).view(self.size, per)[:, :numel] for r in range(self.size)]
                halves.append((slots[self.rank], [s[self.rank] for s in slots]))
            found = self._views[key] = tuple(halves)
        return found

    def step(self, w0: int, w1: int) -> None:
        """Publish the header ``(w0, w1)``, arrive at the next step and wait for every member,
        then check that they all published the same header. The caller wrote its slot of the
        next step's half (:meth:`slot`, :meth:`views`) before."""
        seq = self.seq + 1
        words = self._words
        at = _HEADER_AT[seq & 1]
        base = self._base
        words[base + at] = w0
        words[base + at + 1] = w1
        words[base] = seq
        self.seq = seq
        peers = self._peers
        _fence()  # the arrival visible before the flags are read: no wake-up missed
        for b in peers:
            if words[b + _SLEEPING_AT]:
                _futex_wake(_SYS_FUTEX, self._address[self.rank], _FUTEX_WAKE, 0x7FFFFFFF,
                            None, None, 0)
                break
        for b in peers:
            if words[b] < seq:
                self._wait(b, seq)
        for b in peers:
            if words[b + at] != w0 or words[b + at + 1] != w1:
                raise BrokenGroupError(CollectiveMismatchError(self._mismatch(at)))

    def _wait(self, b: int, seq: int) -> None:
        """Until the member whose block starts at word ``b`` has arrived at ``seq``."""
        words = self._words
        for _ in range(self._spin):
            if words[b] >= seq:
                return
        start = time.monotonic()
        next_check = start + _LIVENESS_S
        yield_until = start + (_YIELD_S if threading.get_ident() != self.worker_ident else 0.0)
        sleeping = self._base + _SLEEPING_AT
        address = self._address[b // _BLOCK_WORDS]
        now = start
        while True:
            if now < yield_until:
                os.sched_yield()
            else:  # until the peer arrives (it wakes this thread) or the next liveness check
                words[sleeping] = 1
                seen = words[b]
                if seen < seq:
                    _futex_wait(_SYS_FUTEX, address, _FUTEX_WAIT, seen & 0xFFFFFFFF, self._sleep,
                                None, 0)
                words[sleeping] = 0
            if words[b] >= seq:
                return
            now = time.monotonic()
            if now >= next_check:
                next_check = now + _LIVENESS_S
                self._check_alive()
                if now - start > self.timeout_s:
                    late = [p // _BLOCK_WORDS for p in self._peers if words[p] < seq]
                    raise BrokenGroupError(CollectiveTimeoutError(
                        f"phalanx_shm: rank {self.rank} waited {self.timeout_s:g} s (the group's "
                        f"timeout) in collective #{seq} for {ranks_text(late)}, which never "
                        "arrived", late, transport=True))

    def _check_alive(self) -> None:
        dead = sorted(self._pidfds[fd] for fd, _ in self._poll.poll(0))
        if dead:
            raise BrokenGroupError(RankExitedError(
                f"phalanx_shm: {ranks_text(dead)} exited (killed or crashed) while rank "
                f"{self.rank} waited for it in a collective", dead, transport=True))

    def _mismatch(self, at: int) -> str:
        words = self._words
        headers = [tuple(words[r * _BLOCK_WORDS + at:r * _BLOCK_WORDS + at + HEADER_WORDS])
                   for r in range(self.size)]
        groups: dict[tuple[int, ...], list[int]] = {}
        for r, h in enumerate(headers):
            groups.setdefault(h, []).append(r)
        said = "; ".join(f"{ranks_text(rs)} called {self._describe(h)}" for h, rs in groups.items())
        return f"phalanx_shm: ranks called different collectives at collective #{self.seq}: {said}"

    def close(self) -> None:
        for fd in self._pidfds:
            os.close(fd)
        self._pidfds.clear()
        self._data = torch.empty(0, dtype=torch.uint8)
        self._views.clear()
        self._words.release()
        self._bytes.release()
        # Unmapping while a view of a slot may live on (a result's future, a traceback) would
        # leave it pointing at nothing: the mapping goes with the process instead.
