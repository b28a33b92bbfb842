"""The hang reports and the straggler reports: an observer of the ledger.

:class:`Diagnostics` watches one :class:`~phalanx.ledger.Ledger` (it is in the ledger's
``observers``): when a recorded collective's wait fails because it timed out or a peer left
(Gloo's words), every rank publishes its collective log and stacks to the store and the
report names the ranks that never arrived (:mod:`~phalanx.diagnostics.hang`); a rank that is
elsewhere, outside any collective, is interrupted by a real-time signal and raises the same
report. It also keeps the straggler settings and the last straggler report.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

from .._logging import get_logger
from ..comm import all_gather_tensor
from ..errors import CollectiveTimeoutError, PhalanxError, RankExitedError
from ..ledger import Ledger, syncpoint
from ..ledger.log import Record
from .hang import Watchdog, assemble, left_cleanly, snapshot
from .straggler import DEFAULT_EVERY, StepClock, assess, look_back

_log = get_logger("phalanx.diagnostics")

# Signal that interrupts a rank's main thread (a late rank outside any collective) to raise
# the final hang report: a real-time signal, which nothing in torch or the launcher uses
# (SIGUSR1/SIGUSR2 are preemption signals).
INTERRUPT_SIGNAL = signal.SIGRTMIN + 3

# How long rank 0 waits in destroy_process_group for the other ranks' step times (the look at
# the end): the ranks leave together after the last backward's all-reduce, within milliseconds;
# two seconds cover a loaded machine, and a rank that never comes costs rank 0 no more.
END_WAIT_S = 2.0
_END_PREFIX = "phalanx/diag/steps-at-end/"
_END_POLL_S = 0.02  # between rank 0's looks: one store round trip per rank, 20 ms at most lost

# What Gloo says when it gives up waiting (unbound_buffer.cc "Timed out waiting ... for recv")
# and when a peer is gone (pair.cc "Connection closed by peer", "Connection reset by peer").
_TIMEOUT_WORDS = ("Timed out", "timed out", "Timeout", "timeout")
_LOST_WORDS = ("Connection closed", "Connection reset", "Broken pipe", "Read error")


def _kind(error: BaseException) -> str | None:
    """``"lost"`` (a peer left), ``"timeout"``, or ``None`` (another error: left as it is) for
    a transport's error: Gloo's, read from its words, or the shared-memory backend's, marked
    ``transport``. The hang report itself (a :class:`PhalanxError`) is never reported again."""
    if isinstance(error, PhalanxError):
        if not getattr(error, "transport", False):
            return None
        return "lost" if isinstance(error, RankExitedError) else "timeout"
    text = str(error)
    if any(w in text for w in _LOST_WORDS):
        return "lost"
    if any(w in text for w in _TIMEOUT_WORDS):
        return "timeout"
    return None


class Diagnostics:
    """Hang and straggler reports for ``ledger``'s collectives (see the module notes).

    Args:
        ledger: the ledger watched; this adds itself to its observers.
        store: the job's store; the watchdog thread uses a clone of it.
        report_file: where to write the final report for ``phalanx run`` (``None``: nowhere).
        straggler_every: synchronising DDP steps per straggler report; ``0``: none. Default
            :data:`~phalanx.diagnostics.straggler.DEFAULT_EVERY`.
        leave_word: a rank that leaves with no error says so in the store (see :meth:`close`):
            where a launcher hosts it. Where rank 0 hosts it, rank 0 may have gone with it,
            and a store call to it makes c10d log a warning. Default ``False``.
    """

    def __init__(self, ledger: Ledger, store: Any, report_file: str | None = None,
                 straggler_every: int = DEFAULT_EVERY, leave_word: bool = False) -> None:
        self.ledger = ledger
        self.leave_word = leave_word
        self.rank = ledger.rank
        self.report_file = report_file
        self.failing = False
        self.straggler_every = straggler_every
        self.straggler: dict | None = None  # the last straggler report (straggler.assess)
        self._interrupt: BaseException | None = None
        self._main = threading.main_thread().ident
        self._previous_handler = None
        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(INTERRUPT_SIGNAL, self._interrupted)
        self._store = store
        self._clocks: list[weakref.ref] = []  # of the DDPs on the default group (look_back)
        self._watchdog = Watchdog(dist.PrefixStore("phalanx/diag/", _own_connection(store)),
                                  self.rank, lambda: snapshot(self.rank, ledger.logs), self._deliver)
        ledger.observers.append(self)

    # ---- hang reports -----------------------------------------------------------------------
    def failed(self, record: Record, error: RuntimeError) -> RuntimeError | None:
        """The hang report, when ``record``'s collective timed out or a peer left."""
        kind = _kind(error)  # the transport's, not ours
        if kind is None:
            return None
        self.failing = True
        waited = {"seq": record.seq, "desc": record.describe()}
        try:
            final = self._watchdog.wait_final(0)
            if final is None:
                ranks = (list(range(dist.get_world_size())) if record.group == "world"
                         else [int(r) for r in record.group.split()[1].split(",")])
                snaps, ended = self._watchdog.request(ranks)
                final = self._watchdog.settle(*assemble(
                    kind, self.rank, record.group, ranks, waited, snaps, self.ledger.timeout_s,
                    ended))
                self._watchdog.linger(len(snaps))
        except Exception as store_error:  # the store is gone too: report what this rank knows
            final = (f"{error}\n(no report from the other ranks: the store is unreachable: "
                     f"{store_error})", [])
        self._write(*final)
        cls = CollectiveTimeoutError if kind == "timeout" else RankExitedError
        return cls(final[0], culprits=final[1])

    def _write(self, text: str, culprits: list[int]) -> None:
        if self.report_file is None:
            return
        try:
            with open(self.report_file, "w") as f:
                json.dump({"report": text, "culprits": culprits, "rank": self.rank}, f)
        except OSError:
            pass  # a report that cannot be written must not hide the error itself

    def _deliver(self, text: str, culprits: list[int]) -> None:
        """Watchdog thread: another rank's report is final."""
        self._write(text, culprits)
        if self.failing or self.ledger.in_flight() or self._previous_handler is None:
            return  # this rank's own collective will fail and raise it
        self._interrupt = CollectiveTimeoutError(
            f"Rank {self.rank} was stopped: another rank gave up waiting for it.\n{text}",
            culprits=culprits)
        signal.pthread_kill(self._main, INTERRUPT_SIGNAL)

    def _interrupted(self, signum: int, frame: Any) -> None:
        error, self._interrupt = self._interrupt, None
        if error is not None:
            self.failing = True
            raise error

    # ---- straggler reports ------------------------------------------------------------------
    def new_clock(self, group: Any) -> StepClock:
        """A step clock for a DDP on ``group``; those on the default group are looked at again
        when it is destroyed (:meth:`look_back`)."""
        clock = StepClock(self.straggler_every)
        if group is None or group == dist.group.WORLD:
            self._clocks.append(weakref.ref(clock))
        return clock

    def look_back(self) -> dict | None:
        """At ``destroy_process_group``: the steps of the default group's DDPs since their last
        straggler report, compared by rank 0 for a gross straggler (see
        :func:`~.straggler.look_back`), which it logs. Through the store, not a collective: a
        rank that never comes costs rank 0 :data:`END_WAIT_S`, and nobody hangs. Returns, and
        keeps as :attr:`straggler`, rank 0's report, if any."""
        if self._store is None:
            return None
        clocks = [(i, ref()) for i, ref in enumerate(self._clocks)]
        mine = [[i, c.steps, len(c.window.compute), c.take()]
                for i, c in clocks if c is not None and c.pending()]
        if not mine:  # nothing since the last report (or no DDP): every rank alike
            return None
        store = dist.PrefixStore(_END_PREFIX, self._store)  # this connection: no new one to dial
        try:
            store.set(str(self.rank), json.dumps(mine))
            seen = _gather(store, dist.get_world_size()) if self.rank == 0 else {}
        except RuntimeError:  # the store is gone (rank 0's, with rank 0): nothing to report
            return None
        report = look_back(seen, dist.get_world_size())
        if report is not None:
            for line in report["lines"]:
                _log.warning("straggler, at the end (%d steps since the last report): %s",
                             report["window"], line)
            self.straggler = report
        return report

    def exchange_step_times(self, medians: list[float], steps: int, group: Any,
                            gross: bool = False) -> dict:
        """Every rank's straggler medians (a collective of the DDP's group); rank 0 logs the
        slow ones (``gross``: the first look, see :func:`~.straggler.assess`). Returns, and
        keeps as :attr:`straggler`, the report."""
        mine = torch.tensor(medians, dtype=torch.float64)
        everyone = torch.empty(dist.get_world_size(group) * len(medians), dtype=torch.float64)
        shadow = syncpoint.tensor_shadow(syncpoint.ALL_GATHER_INTO_TENSOR, mine)
        with self.ledger.collective("straggler report", (mine,), group, shadow=shadow):
            all_gather_tensor(everyone, mine, group=group)
        report = assess(everyone.view(-1, len(medians)).tolist(), steps, gross)
        if dist.get_rank() == 0:
            for line in report["lines"]:
                _log.warning("straggler: %s", line)
        self.straggler = report
        return report

    def close(self, cleanly: bool = False) -> None:
        """Stop watching; ``cleanly``: this rank leaves with no error, and says so to the
        store, for the report of a rank still waiting for it (the ranks ran uneven steps)."""
        self._store = None  # rank 0's store server goes with its group, port and all
        if cleanly and self.leave_word and not self.failing:
            try:
                self._watchdog.leave(left_cleanly(self.rank, self.ledger.logs))
            except RuntimeError:  # the store is gone (rank 0's, with rank 0): nobody to tell
                pass
        self._watchdog.close()
        if self._previous_handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(INTERRUPT_SIGNAL, self._previous_handler)
            self._previous_handler = None


def _gather(store: Any, world_size: int) -> dict[int, list]:
    """Rank 0: what every rank published at the end, those that came within END_WAIT_S;
    the keys are deleted (a next group on the same store starts clean)."""
    seen: dict[int, list] = {}
    deadline = time.monotonic() + END_WAIT_S
    while True:
        for rank in range(world_size):
            if rank not in seen and store.check([str(rank)]):
                seen[rank] = json.loads(store.get(str(rank)))
                store.delete_key(str(rank))
        if len(seen) == world_size or time.monotonic() > deadline:
            return seen
        time.sleep(_END_POLL_S)


def _own_connection(store: Any) -> Any:
    """A connection of the watchdog thread's own to ``store`` (a TCPStore's clone), or the
    store itself where c10d cannot clone it (a FileStore, a HashStore: thread-safe already)."""
    try:
        return store.clone()
    except RuntimeError:
        return store
