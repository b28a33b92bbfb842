"""The per-process diagnostics: collective logs per group, sync points, hang reports.

:class:`Diagnostics` is made by :func:`phalanx.init_process_group` and found with
:func:`phalanx.process_group.diagnostics`. Everything that issues a collective tells it:
``begin`` before, ``end`` after (``fail`` when a wait raised). A *sync point* is where the
ranks check that they agree: one tiny all-reduce (:mod:`~phalanx.diagnostics.syncpoint`: a
CRC of the point and of every collective since the previous point, equal on every rank or
not), issued before a script's own collectives (``phalanx.all_reduce`` and the others),
before each synchronising DDP forward, a checkpoint, a preemption check and a ZeRO step.
When the ranks disagree, every rank learns every rank's collectives since the last point and
raises :class:`~phalanx.errors.CollectiveMismatchError` naming the first one that differs and
where each rank issued it, before any payload of the wrong size can reach Gloo (which would
abort the process).
"""

from __future__ import annotations

import atexit
import json
import signal
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from .._logging import get_logger
from ..comm import all_gather_tensor
from ..errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    PhalanxError,
    RankExitedError,
    UsageError,
)
from . import syncpoint
from .hang import Watchdog, assemble, snapshot
from .log import CollectiveLog, Record, call_site, describe_tensors
from .straggler import DEFAULT_EVERY, assess

_log = get_logger("phalanx.diagnostics")

# Signal that interrupts a rank's main thread (a late rank outside any collective) to raise
# the final hang report: a real-time signal, which nothing in torch or the launcher uses
# (SIGUSR1/SIGUSR2 are preemption signals).
INTERRUPT_SIGNAL = signal.SIGRTMIN + 3

# What Gloo says when it gives up waiting (unbound_buffer.cc "Timed out waiting ... for recv")
# and when a peer is gone (pair.cc "Connection closed by peer", "Connection reset by peer").
_TIMEOUT_WORDS = ("Timed out", "timed out", "Timeout", "timeout")
_LOST_WORDS = ("Connection closed", "Connection reset", "Broken pipe", "Read error")


def _kind(error: BaseException) -> str | None:
    text = str(error)
    if any(w in text for w in _LOST_WORDS):
        return "lost"
    if any(w in text for w in _TIMEOUT_WORDS):
        return "timeout"
    return None


@dataclass
class _Check:
    """A sync point in flight."""

    what: str
    site: str
    since: list[str]  # the collectives before it, since the previous point
    payload: torch.Tensor
    work: Any
    record: Record
    group: Any
    world: int


class Diagnostics:
    """This process's view of its collectives (see the module notes).

    Args:
        store: the job's store; the watchdog thread uses a clone of it.
        timeout_s: the watchdog limit (the process group's timeout), for the reports.
        report_file: where to write the final report for ``phalanx run`` (``None``: nowhere).
        check_group: a Gloo group over the world for sync points when the world is on NCCL
            (CPU tensors never synchronise the GPU). Default ``None``: the world itself.
        straggler_every: synchronising DDP steps per straggler report; ``0``: none. Default
            :data:`~phalanx.diagnostics.straggler.DEFAULT_EVERY`.
    """

    def __init__(self, store: Any, timeout_s: float, report_file: str | None = None,
                 check_group: dist.ProcessGroup | None = None,
                 straggler_every: int = DEFAULT_EVERY) -> None:
        self.rank = dist.get_rank()
        self.enabled = True  # False: every collective goes unchecked and unrecorded
        self.timeout_s = timeout_s
        self.report_file = report_file
        self._check_group = check_group
        self.logs: dict[str, CollectiveLog] = {}
        self._names: dict[int, str] = {}
        self.failing = False
        self.waited_s = 0.0  # seconds this process has spent waiting for collectives to end
        self.straggler_every = straggler_every
        self.straggler: dict | None = None  # the last straggler report (straggler.assess)
        self._pending: _Check | None = None  # a sync point started, not yet waited for
        self.join: Any = None  # while ranks have joined: the phalanx.join state
        self._last_work: Any = None
        self._interrupt: BaseException | None = None
        self._main = threading.main_thread().ident
        self._previous_handler = None
        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(INTERRUPT_SIGNAL, self._interrupted)
        self._watchdog = Watchdog(dist.PrefixStore("phalanx/diag/", store.clone()), self.rank,
                                  lambda: snapshot(self.rank, self.logs), self._deliver)

    # ---- the log ------------------------------------------------------------------------
    def joinable(self, obj: Any, action: int, *args: int) -> tuple[int, ...] | None:
        """While ranks have joined: the announcement that ``obj`` (a joinable of the running
        :mod:`phalanx.uneven`) shadows ``action``; else (or for an object not in the join)
        ``None``."""
        index = None if self.join is None else self.join.index(obj)
        return None if index is None else (syncpoint.JOINABLE, index, action, *args)

    def group_name(self, group: dist.ProcessGroup | None) -> str:
        if group is None or group is dist.group.WORLD:
            return "world"
        name = self._names.get(id(group))
        if name is None:
            ranks = dist.get_process_group_ranks(group)
            name = self._names[id(group)] = f"ranks {','.join(map(str, ranks))}"
        return name

    def log(self, group: dist.ProcessGroup | None) -> CollectiveLog:
        name = self.group_name(group)
        log = self.logs.get(name)
        if log is None:
            log = self.logs[name] = CollectiveLog()
        return log

    def begin(self, op: str, tensors: Sequence[Any], group: dist.ProcessGroup | None,
              site: str | None = None, shadow: tuple[int, ...] | None = None,
              announced: bool = False) -> Record:
        """Record a collective about to be issued; a sync point still pending is settled first
        (nothing goes out before the ranks are known to agree). While ranks have joined
        (:mod:`phalanx.uneven`), it is announced first, with ``shadow``: how a joined rank
        takes part in it (:data:`~phalanx.diagnostics.syncpoint.UNSHADOWABLE` if not given);
        ``announced``: the caller's own sync point announced it."""
        if self._pending is not None:
            self.settle()
        site = site or call_site(3)
        dtype, shape = describe_tensors(tensors)
        if self.join is not None and not announced:
            if self.group_name(group) != "world":
                raise UsageError(f"{op} on {self.group_name(group)} inside phalanx.join: a join "
                                 "announces collectives of the whole world only")
            self.sync_point(f"{op} {dtype}{list(shape)}", group, site=site,
                            announce=shadow or (syncpoint.UNSHADOWABLE,))
        return self.log(group).begin(op, dtype, shape, self.group_name(group), site)

    @staticmethod
    def end(record: Record) -> None:
        CollectiveLog.end(record)

    @contextmanager
    def collective(self, op: str, tensors: Sequence[Any], group: dist.ProcessGroup | None,
                   site: str | None = None, shadow: tuple[int, ...] | None = None,
                   announced: bool = False) -> Iterator[Record]:
        """Record the collective issued inside; a failure of it raises the hang report."""
        record = self.begin(op, tensors, group, site or call_site(3), shadow, announced)
        try:
            yield record
        except RuntimeError as e:
            raise self.fail(record, e) from e
        finally:
            if record.end is None:
                self.end(record)

    # ---- sync points ----------------------------------------------------------------------
    def sync_point(self, what: str, group: dist.ProcessGroup | None = None,
                   flags: Sequence[int] = (), site: str | None = None, wait: bool = True,
                   announce: tuple[int, ...] = ()) -> syncpoint.Verdict | None:
        """Every rank of ``group`` checks here that it agrees with the others on ``what`` and
        on the collectives since the last point (:mod:`~phalanx.diagnostics.syncpoint`).

        Args:
            flags: this rank's flags; the verdict says which some rank raised.
            wait: ``False`` only starts the check: the next collective recorded (or
                :meth:`settle`) waits for it, so its latency hides behind the work in
                between (a forward's, for DDP); ``None`` is returned. While ranks have
                joined, every check is waited for.
            announce: for ranks that have joined: how they take part in what follows.

        Returns:
            The :class:`~phalanx.diagnostics.syncpoint.Verdict` (with ``wait``).

        Raises:
            CollectiveMismatchError: on every rank, naming what each rank is at.
        """
        site = site or call_site(2)
        log = self.log(group)
        h = syncpoint.fingerprint(f"{what} {announce}", log.fingerprint)
        return self._meet(h, what, site, group, flags, announce, wait or self.join is not None)

    def probe(self, group: dist.ProcessGroup | None, flags: Sequence[int] = ()) -> syncpoint.Verdict:
        """A rank that has joined takes part in the next sync point of the others (zeros, but
        its ``flags``) and learns what they announce (:mod:`phalanx.uneven`)."""
        return self._meet(None, "joined: out of inputs", "", group, flags, (), True)

    def _meet(self, h: int | None, what: str, site: str, group: Any, flags: Sequence[int],
              announce: tuple[int, ...], wait: bool) -> syncpoint.Verdict | None:
        log = self.log(group)
        on = self._check_group if self._check_group is not None and group is None else group
        world = dist.get_world_size(on)
        payload = syncpoint.payload(h, announce, tuple(flags), dist.get_rank(on), world)
        record = self.begin(f"check before {what}", (), group, site, announced=True)
        try:
            work = dist.all_reduce(payload, group=on, async_op=True)
        except RuntimeError as e:
            raise self.fail(record, e) from e
        self._last_work = work  # see phalanx.comm.LastWorks: dropped by the main thread
        self._pending = _Check(what, site, log.since_check[:-1], payload, work, record, on, world)
        log.checked()  # the next fingerprint starts here, whatever the verdict
        return self.settle() if wait else None

    def settle(self) -> syncpoint.Verdict | None:
        """Wait for the pending sync point; raise on a mismatch; return its verdict."""
        check, self._pending = self._pending, None
        if check is None:
            return None
        self.wait(check.work, check.record)
        verdict = syncpoint.read(check.payload, check.world)
        if not verdict.agree:
            self._mismatch(check)
        if self.join is not None:
            self.join.seen(verdict)  # who is still active; raises for throw_on_early_termination
        return verdict

    def _mismatch(self, check: _Check) -> None:
        mine = {"rank": dist.get_rank(), "at": f"{check.what} ({check.site})", "since": check.since}
        everyone: list[Any] = [None] * dist.get_world_size(check.group)
        dist.all_gather_object(everyone, mine, group=check.group)
        raise CollectiveMismatchError(syncpoint.mismatch_message(everyone))

    def wait(self, work: Any, record: Record | None) -> None:
        """Wait for ``work`` (the collective ``record`` describes, if recorded), count the time
        in :attr:`waited_s`, and raise the hang report if it fails."""
        start = time.monotonic()
        try:
            work.wait()
        except RuntimeError as e:
            if record is None:
                raise
            raise self.fail(record, e) from e
        finally:
            self.waited_s += time.monotonic() - start
        if record is not None:
            self.end(record)

    def exchange_step_times(self, medians: list[float], steps: int,
                            group: dist.ProcessGroup | None) -> dict:
        """Every rank's straggler medians (a collective of the DDP's group); rank 0 logs the
        slow ones. Returns, and keeps as :attr:`straggler`, the report."""
        mine = torch.tensor(medians, dtype=torch.float64)
        everyone = torch.empty(dist.get_world_size(group) * len(medians), dtype=torch.float64)
        shadow = syncpoint.tensor_shadow(syncpoint.ALL_GATHER_INTO_TENSOR, mine)
        with self.collective("straggler report", (mine,), group, shadow=shadow):
            all_gather_tensor(everyone, mine, group=group)
        report = assess(everyone.view(-1, len(medians)).tolist(), steps)
        if dist.get_rank() == 0:
            for line in report["lines"]:
                _log.warning("straggler: %s", line)
        self.straggler = report
        return report

    # ---- failures -------------------------------------------------------------------------
    def fail(self, record: Record, error: RuntimeError) -> RuntimeError:
        """The error to raise for ``record``'s failed collective: the hang report when the
        collective timed out or a peer left, else ``error`` itself."""
        kind = None if isinstance(error, PhalanxError) else _kind(error)  # Gloo's, not ours
        if kind is None:
            CollectiveLog.end(record, failed=True)
            return error
        self.failing = True
        waited = {"seq": record.seq, "desc": record.describe()}
        try:
            final = self._watchdog.wait_final(0)
            if final is None:
                ranks = (list(range(dist.get_world_size())) if record.group == "world"
                         else [int(r) for r in record.group.split()[1].split(",")])
                snaps = self._watchdog.request(ranks)
                final = self._watchdog.settle(*assemble(kind, self.rank, record.group, ranks,
                                                        waited, snaps, self.timeout_s))
        except Exception as store_error:  # the store is gone too: report what this rank knows
            final = (f"{error}\n(no report from the other ranks: the store is unreachable: "
                     f"{store_error})", [])
        CollectiveLog.end(record, failed=True)  # in flight until now: so the snapshots say
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
        busy = any(log.in_flight() is not None for log in self.logs.values())
        if self.failing or busy or self._previous_handler is None:
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

    def close(self) -> None:
        if self._pending is not None:  # a forward's check nothing came after: finish it
            try:
                self.settle()
            except RuntimeError:
                pass  # leaving anyway: a last mismatch or a peer gone changes nothing now
        self._watchdog.close()
        if self._previous_handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(INTERRUPT_SIGNAL, self._previous_handler)
            self._previous_handler = None


# This process's diagnostics, or None. Like torch's default group, which it watches, it is
# process-wide: every collective of the process reports to it. Set by init_process_group.
_current: Diagnostics | None = None


def install(diagnostics: Diagnostics) -> None:
    global _current
    uninstall()
    _current = diagnostics
    # A script that ends without destroy_process_group() (an uncaught exception, say) must
    # still stop the watchdog thread before the interpreter finalises: a daemon thread coming
    # back from a store call then is killed inside C++ and the process aborts ("terminate
    # called without an active exception"; seen in 1 of 3 runs ending in a hang report).
    atexit.register(uninstall)


def uninstall() -> None:
    global _current
    atexit.unregister(uninstall)
    if _current is not None:
        _current.close()
        _current = None


def watched(op: str, tensors: Sequence[Any] = (), group: dist.ProcessGroup | None = None,
            check: bool = False, shadow: tuple[int, ...] | None = None) -> Any:
    """A context manager around a collective (or a few) that phalanx issues: recorded as
    ``op``, a hang inside it reported; with ``check``, a sync point first. ``shadow`` says how
    a rank that has joined takes part (:mod:`phalanx.uneven`). Does nothing without
    diagnostics."""
    if current() is None:
        return nullcontext()
    return watch(op, tensors, group, check, shadow).around()


class Watch:
    """:func:`watched` for collectives waited for later, outside any ``with``: recorded as ``op``
    from :func:`watch` (with ``check``: a sync point first) to :meth:`end`; a failure of a
    wait inside :meth:`failing` raises the hang report. Does nothing without diagnostics."""

    def __init__(self, diag: Diagnostics | None, record: Record | None) -> None:
        self._diag, self._record = diag, record

    @contextmanager
    def failing(self) -> Iterator[None]:
        """Around a wait for the collectives: a failure raises the hang report."""
        try:
            yield
        except RuntimeError as e:
            if self._record is None:
                raise
            raise self._diag.fail(self._record, e) from e

    def end(self) -> None:
        if self._record is not None and self._record.end is None:
            self._diag.end(self._record)

    @contextmanager
    def around(self) -> Iterator[Record | None]:
        """The collectives issued and waited for inside, then the end of the record."""
        try:
            with self.failing():
                yield self._record
        finally:
            self.end()


def watch(op: str, tensors: Sequence[Any] = (), group: dist.ProcessGroup | None = None,
          check: bool = False, shadow: tuple[int, ...] | None = None) -> Watch:
    """Start a :class:`Watch`: call it just before issuing the collectives it records
    (arguments as for :func:`watched`)."""
    diag = current()
    if diag is None:
        return Watch(None, None)
    site = call_site(2)
    if check:
        diag.sync_point(op, group, site=site, announce=shadow or (syncpoint.UNSHADOWABLE,))
    return Watch(diag, diag.begin(op, tensors, group, site, shadow, announced=check))


def current() -> Diagnostics | None:
    """This process's :class:`Diagnostics`, or ``None`` (no process group of several ranks, or
    switched off with ``current().enabled = False``)."""
    return _current if _current is not None and _current.enabled else None
