"""The collective log: what this rank's collectives were, where they came from, how they went.

Every collective phalanx issues, and every one a script calls through ``phalanx.all_reduce``
and its siblings, is recorded here: a sequence number, the op, dtype and shape, the group,
the script's own line that led to it (the first frame outside phalanx, torch and the
standard library's plumbing), and when it started and ended. The last
:data:`LOG_CAPACITY` records are kept; a running fingerprint (CRC-32 over op, dtype, shape
and group) summarises the ones since the last sync point, for the ranks to compare.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import time
import zlib
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable

# Enough to see what led up to a hang or a mismatch (a DDP step is a handful of collectives:
# buckets, a buffer broadcast, SyncBatchNorm's two per layer), small enough to send to the
# store and print in full: 64 records of about 100 bytes each.
LOG_CAPACITY = 64

# A call site is the first frame outside these: phalanx, torch, the standard library.
_PHALANX = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep


def _is_plumbing(path: str, torch_dir: str | None) -> bool:
    return _fixed_plumbing(path, torch_dir) or _inductor_generated(path)


def _inductor_generated(path: str) -> bool:
    """Code inductor wrote (a compiled graph calling phalanx's op), in its cache directory
    (which inductor pins in the environment when it first writes there)."""
    cache = _inductor_dir(os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
    return cache is not None and path.startswith(cache)


@functools.lru_cache(maxsize=4)
def _inductor_dir(cache: str | None) -> str | None:
    return None if cache is None else os.path.join(os.path.abspath(cache), "")


# A memo of a pure function of the path (a hang report walks every thread's stack); bounded by
# the number of source files
@functools.lru_cache(maxsize=4096)
def _fixed_plumbing(path: str, torch_dir: str | None) -> bool:
    return (path.startswith(_PHALANX) or path.startswith("<")
            or (torch_dir is not None and path.startswith(torch_dir))
            or (path.startswith(_STDLIB) and "site-packages" not in path))


def call_site(depth: int = 2, caller: Any = None) -> str:
    """``"train.py:41"``: the first frame, from ``depth`` frames up, outside phalanx, torch and
    the standard library; ``"?"`` if there is none. ``caller``: what tells this call apart from
    others (default: the code of the frame ``depth`` up)."""
    # Every DDP step asks twice (its forward's check, its bucket's record). Walking the stack
    # makes a frame object of every frame it passes (torch's module call frames among them),
    # which costs more than the rest of a tiny step's check: so each caller remembers how far
    # up its site was and what was there (code and instruction), and looks there first, making
    # that one frame only; a walk is made when it finds something else.
    #
    # A walk memoises each file's verdict (None: plumbing, else its base name) per torch
    # directory, and each site found, by its code and instruction. A file's verdict is worked
    # out when its frame is first seen, from the inductor cache of that moment (read from the
    # environment only then, and only once inductor is imported: no code of its before);
    # inductor pins its cache in the environment before it writes a file there, so a file it
    # wrote is judged with it
    torch_file = getattr(sys.modules.get("torch"), "__file__", None)
    names = _SITE_NAMES.get(torch_file)
    if names is None:
        names = _SITE_NAMES[torch_file] = {}
    known = _LAST_SITE.get(caller if caller is not None else sys._getframe(depth).f_code)
    if known is not None and known[4] is names:
        try:
            frame = sys._getframe(depth + known[0])
        except ValueError:  # a shorter stack
            frame = None
        if frame is not None and frame.f_code is known[1] and frame.f_lasti == known[2]:
            return known[3]
    frame, up = sys._getframe(depth), 0
    if caller is None:
        caller = frame.f_code
    while frame is not None:
        code = frame.f_code
        try:
            name = names[code.co_filename]
        except KeyError:
            name = names[code.co_filename] = _site_name(code.co_filename, torch_file)
        if name is not None:
            at = (code, frame.f_lasti)
            site = _SITES.get(at)
            if site is None:
                if len(_SITES) >= 4096:  # a script's few lines that issue collectives
                    _SITES.clear()
                site = _SITES[at] = f"{name}:{frame.f_lineno}"
            if len(_LAST_SITE) >= 4096:
                _LAST_SITE.clear()
            _LAST_SITE[caller] = (up, code, at[1], site, names)
            return site
        frame, up = frame.f_back, up + 1
    return "?"


# the caller (its code, or what it says) -> (how many frames up its site was, that frame's code and instruction, the
# site, the verdicts it was found with)
_LAST_SITE: dict[Any, tuple[int, Any, int, str, dict]] = {}
# torch's __file__ -> {source file: its base name, or None for plumbing}
_SITE_NAMES: dict[str | None, dict[str, str | None]] = {}
# (code, instruction) -> "file.py:line"
_SITES: dict[tuple[Any, int], str] = {}


def _site_name(path: str, torch_file: str | None) -> str | None:
    if _fixed_plumbing(path, _torch_dir(torch_file)) or (
            "torch._inductor" in sys.modules and _inductor_generated(path)):
        return None
    return os.path.basename(path)


@functools.lru_cache(maxsize=2)
def _torch_dir(torch_file: str | None) -> str | None:
    return os.path.dirname(torch_file) + os.sep if torch_file else None


def describe_tensors(tensors: Iterable[Any]) -> tuple[str, tuple[int, ...]]:
    """``(dtype, shape)`` of what a collective moves: one tensor's, or for several, the first
    one's dtype and ``(n, total elements)``; ``("-", ())`` for none."""
    tensors = [t for t in tensors if hasattr(t, "dtype")]
    if not tensors:
        return "-", ()
    dtype = str(tensors[0].dtype).removeprefix("torch.")
    if len(tensors) == 1:
        return dtype, tuple(tensors[0].shape)
    return dtype, (len(tensors), sum(t.numel() for t in tensors))


@dataclass(slots=True)
class Record:
    """One collective as this rank issued it. ``end`` is ``None`` while it is in flight."""

    seq: int
    op: str
    dtype: str
    shape: tuple[int, ...]
    group: str
    site: str
    start: float
    end: float | None = None
    failed: bool = False

    def signature(self) -> str:
        """What must be identical on every rank: op, dtype, shape, group."""
        return f"{self.op} {self.dtype}{list(self.shape)} on {self.group}"

    def describe(self, now: float | None = None) -> str:
        """``"#12 all_reduce float32[20] (train.py:41), waiting 10.0 s"``."""
        shape = "" if self.dtype == "-" else f" {self.dtype}{list(self.shape)}"
        group = "" if self.group == "world" else f" on {self.group}"
        if self.end is not None:
            state = "failed" if self.failed else f"done in {self.end - self.start:.3f} s"
        else:
            state = f"waiting {(now or time.monotonic()) - self.start:.1f} s"
        return f"#{self.seq} {self.op}{shape}{group} ({self.site}), {state}"


class CollectiveLog:
    """This rank's last collectives and the fingerprint of those since the last sync point.

    Args:
        capacity: records kept. Default :data:`LOG_CAPACITY`.
    """

    def __init__(self, capacity: int = LOG_CAPACITY) -> None:
        self.records: deque[Record] = deque(maxlen=capacity)
        self.next_seq = 0
        self.fingerprint = 0  # CRC-32 of the signatures since the last sync point
        self.since_check: list[str] = []  # those signatures, described (for a mismatch report)
        # (op, dtype, shape, group, site) -> the signature's bytes and its description
        self._signed: dict[tuple[Any, ...], tuple[bytes, str]] = {}

    def begin(self, op: str, dtype: str, shape: tuple[int, ...], group: str, site: str,
              counted: bool = True) -> Record:
        """Record a collective issued now; ``counted``: in the fingerprint (a sync point's own
        collective is not: the fingerprint restarts at it)."""
        record = Record(self.next_seq, op, dtype, shape, group, site, time.monotonic())
        self.next_seq += 1
        self.records.append(record)
        if counted:
            key = (op, dtype, shape, group, site)
            known = self._signed.get(key)
            if known is None:  # a loop issues the same few collectives from the same lines
                if len(self._signed) >= 256:
                    self._signed.clear()
                signature = record.signature()
                known = self._signed[key] = (signature.encode(), f"{signature} ({site})")
            self.fingerprint = zlib.crc32(known[0], self.fingerprint)
            self.since_check.append(known[1])
        return record

    @staticmethod
    def end(record: Record, failed: bool = False) -> None:
        record.end = time.monotonic()
        record.failed = failed

    def checked(self) -> None:
        """A sync point passed: the next fingerprint starts afresh."""
        self.fingerprint = 0
        self.since_check = []

    def in_flight(self) -> Record | None:
        """The oldest collective still in flight, if any."""
        return next((r for r in self.records if r.end is None), None)

    def tail(self, n: int = 8) -> list[str]:
        """The last ``n`` records, described."""
        now = time.monotonic()
        return [r.describe(now) for r in list(self.records)[-n:]]
