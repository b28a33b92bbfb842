"""Hang reports: when a collective waits past the watchdog limit, every rank says where it is.

The watchdog limit is the process group's timeout (``init_process_group(timeout=...)``,
``phalanx run --watchdog``): Gloo gives up on a collective after it and the waiting rank gets
a ``RuntimeError``; a peer that exits closes its connections and its peers get one at once.
Then:

1. The rank whose collective failed asks for a report: it adds to ``request`` in the job's
   store, publishes its own snapshot, and waits up to :data:`REPORT_WAIT_S` for the others'.
2. Every rank runs a watchdog thread that looks at ``request`` every :data:`POLL_S` seconds;
   when it appears, the thread publishes this rank's snapshot: its collective log, the Python
   stack of every thread, and the line its main thread is at.
3. The requester assembles the report: the ranks that never arrived at the collective it
   waited in (the late ones: the root cause), the ones waiting with it, where each rank is.
   It publishes the report as ``final`` (the first one published stands), and every rank
   raises it: the requester once every rank that sent a snapshot has read it (at most
   :data:`REPORT_WAIT_S`: the store may be hosted by the requester, and go with it); a rank
   outside any collective is interrupted by a signal to its main thread; a rank inside one
   raises it when that one fails in turn.
4. A rank that leaves with no error (its script ended, or it destroyed the group) says so in
   the store first, where a launcher hosts it (:meth:`Watchdog.leave`): a report that finds
   it gone names it as ended, not lost, and says why that happens (it ran out of batches
   before the others).
5. Each rank writes the report beside its torch elastic error file, where ``phalanx run``
   finds it and names the late rank as the root cause, not the rank that timed out first.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable

from ..errors import ranks_text
from ..ledger.syncpoint import OUT_OF_BATCHES

# How often every rank's watchdog thread looks for a request: one store round trip (~0.1 ms
# on a LAN) per second per rank is nothing, and a report still comes within seconds of a
# limit that is minutes long.
POLL_S = 1.0
# How long the requester waits for the other ranks' snapshots: two polls, and a second for
# formatting and sending the stacks.
REPORT_WAIT_S = 2 * POLL_S + 1.0
# Lines of each rank's collective log shown in the report.
TAIL = 6


def where(frame: Any) -> str:
    """``"train.py:45 in step"``: the innermost frame of ``frame``'s stack outside phalanx's and
    torch's plumbing (the caller's own code), or the innermost frame if all are plumbing."""
    from ..ledger.log import _is_plumbing

    torch_file = getattr(sys.modules.get("torch"), "__file__", None)
    torch_dir = os.path.dirname(torch_file) + os.sep if torch_file else None
    innermost = frame
    while frame is not None:
        if not _is_plumbing(frame.f_code.co_filename, torch_dir):
            break
        frame = frame.f_back
    frame = frame or innermost
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


def snapshot(rank: int, logs: dict[str, Any]) -> dict[str, Any]:
    """What this rank says in a report: its collectives per group, its threads' stacks, and
    the line its main thread is at."""
    frames = sys._current_frames()
    main = frames.get(threading.main_thread().ident)
    names = {t.ident: t.name for t in threading.enumerate()}
    stacks = "".join(
        f"  --- thread {names.get(ident, ident)} ---\n" + "".join(traceback.format_stack(frame))
        for ident, frame in frames.items() if ident != threading.get_ident()  # not this one
    )
    groups = {}
    for name, log in logs.items():
        flying = log.in_flight()
        last = log.records[-1] if log.records else None
        groups[name] = {
            "next_seq": log.next_seq,
            "in_flight": None if flying is None else {"seq": flying.seq, "desc": flying.describe()},
            "last": None if last is None else last.describe(),
            "tail": log.tail(TAIL),
        }
    return {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(),
            "where": where(main) if main is not None else "?", "stacks": stacks, "groups": groups}


def left_cleanly(rank: int, logs: dict[str, Any]) -> dict[str, Any]:
    """What a rank that leaves the job with no error (its script ended, or it destroyed the
    group) leaves behind for a report: its host, pid and last collective per group."""
    last = {name: log.records[-1].describe() if log.records else None
            for name, log in logs.items()}
    return {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "last": last}


def assemble(kind: str, me: int, group: str, ranks: list[int], waited: dict[str, Any],
             snaps: dict[int, dict[str, Any]], limit_s: float,
             ended: dict[int, dict[str, Any]] | None = None) -> tuple[str, list[int]]:
    """The report's text, and the ranks it blames (late, or silent), for a collective of
    ``group`` (global ``ranks``) that failed on rank ``me`` (``kind``: ``"timeout"`` or
    ``"lost"``, a peer's connection closed). ``waited`` is ``me``'s in-flight record;
    ``ended``: what the silent ranks that left with no error said (:func:`left_cleanly`)."""
    seq = waited["seq"]
    ended = ended or {}
    late, silent, with_me, lines = [], [], [], []
    for rank in ranks:
        snap = snaps.get(rank)
        if snap is None:
            silent.append(rank)
            if rank in ended:
                info = ended[rank]
                lines.append(f"  rank {rank} ({info['host']}, pid {info['pid']}): ended with no "
                             "error (its script ran to its end, or destroyed the group); its last "
                             f"collective was {info['last'].get(group) or 'none'}")
            else:
                lines.append(f"  rank {rank}: no answer within {REPORT_WAIT_S:g} s (exited, "
                             "killed, or stuck outside Python)")
            continue
        info = snap["groups"].get(group, {"next_seq": 0, "in_flight": None, "last": None})
        head = f"  rank {rank} ({snap['host']}, pid {snap['pid']}): at {snap['where']}"
        flying = info["in_flight"]
        if flying is not None and flying["seq"] == seq:
            with_me.append(rank)
            lines.append(f"{head}; in {flying['desc']}")
        elif info["next_seq"] <= seq:
            late.append(rank)
            last = info["last"] or "none yet"
            lines.append(f"{head}; never reached #{seq}: its last collective was {last}")
        else:
            where_now = flying["desc"] if flying else f"past it (next #{info['next_seq']})"
            lines.append(f"{head}; already {where_now}")
    if kind == "timeout":
        head = (f"Collective timed out: rank {me} waited {limit_s:g} s (the watchdog limit: "
                f"init_process_group(timeout=...), phalanx run --watchdog) in {waited['desc']}")
    else:
        head = f"A rank left the job: rank {me}'s peer closed its connection in {waited['desc']}"
    culprits = late or silent
    if late:
        head += f". Late: {ranks_text(late)} never reached it"
    elif silent and set(silent) <= set(ended):  # they ran fewer steps: no error, no crash
        head += (f". {ranks_text(silent).capitalize()} ended with no error while rank {me} "
                 f"still had collectives to do: the ranks ran different numbers of steps. "
                 + OUT_OF_BATCHES)
    elif silent:
        head += f". {ranks_text(silent).capitalize()} did not answer: gone"
    stacks = "".join(f"rank {r}:\n{snaps[r]['stacks']}" for r in culprits if r in snaps)
    text = "\n".join([head, "Where every rank is:", *lines])
    if stacks:
        text += f"\nStacks of the late {'rank' if len(late) == 1 else 'ranks'}:\n" + stacks.rstrip()
    return text, culprits


class Watchdog:
    """The thread that publishes this rank's snapshot when some rank asks for a report, and
    raises the final report in this rank (see the module notes).

    Args:
        store: the job's store, under a prefix of its own; cloned, so the thread has its own
            connection.
        rank: this process's global rank.
        snap: returns this rank's snapshot.
        deliver: called with the final report's text and blamed ranks when one arrives.
    """

    def __init__(self, store: Any, rank: int, snap: Callable[[], dict], deliver: Callable) -> None:
        self._store = store
        self._rank = rank
        self._snap = snap
        self._deliver = deliver
        self._store.delete_key(f"left/{rank}")  # said in an earlier group on this store
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="phalanx-watchdog", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        try:
            while not self._stop.wait(POLL_S):
                if self._store.check(["request"]):
                    self.publish()
                    final = self.wait_final(REPORT_WAIT_S + POLL_S)
                    if final is not None:
                        self._store.add("delivered", 1)
                        self._deliver(*final)
                    return
        except Exception:  # the store went away (the job is ending): nothing to report to
            return

    def publish(self) -> None:
        self._store.set(f"snap/{self._rank}", json.dumps(self._snap()))

    def wait_final(self, timeout: float) -> tuple[str, list[int]] | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._store.check(["final"]):
                final = json.loads(self._store.get("final"))
                return final["text"], final["culprits"]
            time.sleep(0.05)
        return None

    def leave(self, info: dict[str, Any]) -> None:
        """This rank leaves with no error (:func:`left_cleanly`): said before its connections
        close, for a report that finds it gone. The thread is stopped first (its connection)."""
        self.close()
        self._store.set(f"left/{self._rank}", json.dumps(info))

    def request(self, ranks: list[int]) -> tuple[dict[int, dict], dict[int, dict]]:
        """Ask every rank for its snapshot; return those that came within REPORT_WAIT_S, and
        what the ranks that left with no error said instead (:meth:`leave`)."""
        self._store.add("request", 1)
        self.publish()
        snaps: dict[int, dict] = {}
        ended: dict[int, dict] = {}
        deadline = time.monotonic() + REPORT_WAIT_S
        while True:
            for rank in ranks:
                for key, found in ((f"snap/{rank}", snaps), (f"left/{rank}", ended)):
                    if rank not in snaps and rank not in ended and self._store.check([key]):
                        found[rank] = json.loads(self._store.get(key))
            if len(snaps) + len(ended) == len(ranks) or time.monotonic() > deadline:
                return snaps, ended
            time.sleep(0.05)

    def settle(self, text: str, culprits: list[int]) -> tuple[str, list[int]]:
        """Publish the final report unless another rank's stands already; return the one that
        stands."""
        mine = json.dumps({"text": text, "culprits": culprits})
        final = json.loads(self._store.compare_set("final", "", mine))
        return final["text"], final["culprits"]

    def linger(self, readers: int) -> None:
        """Wait (at most :data:`REPORT_WAIT_S`) until ``readers`` watchdogs have read the final
        report, before this rank goes on to raise it and maybe exit with the store."""
        deadline = time.monotonic() + REPORT_WAIT_S
        while self._store.add("delivered", 0) < readers and time.monotonic() < deadline:
            time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(POLL_S + 1.0)
