"""The ledger: every collective phalanx issues, recorded, checked and announced in one place.

One :class:`Ledger` serves a job's default process group (and the subgroups made from it):
it keeps a :class:`~phalanx.ledger.log.CollectiveLog` per group, runs the sync points where
the ranks compare what they issued (:mod:`~phalanx.ledger.syncpoint`), and, while a join runs,
announces each collective to the ranks that have joined. It knows nothing of what watches it:

* **observers** (:class:`Observer`, the hang reports of :mod:`phalanx.diagnostics`) are told
  when a wait fails and may turn the error into a better one;
* **a join** (:class:`JoinView`, :mod:`phalanx.uneven`) is told each sync point's verdict.

The call site, the same for every collective::

    with ledger.collective("ZeroRedundancyOptimizer.step", group=g, check=True, shadow=s) as c:
        c.wait(dist.broadcast(t, src, group=g, async_op=True))

``check=True`` puts a sync point first (the ranks agree, or every rank raises
:class:`~phalanx.errors.CollectiveMismatchError`); a DDP step's sync point may instead *ride*
the step's bucket (:meth:`Ledger.sync_point` with ``ride``: no collective of its own, the bucket
takes it with :meth:`Ledger.take_ride` and hands the sums to :meth:`Ledger.arrived`; any other
collective that comes first sends it alone); a failed wait inside raises what the
observers make of it (the hang report); the record ends with the block. A collective waited
for later (DDP's buckets, an overlapped meeting) keeps the :class:`Collective` and calls
:meth:`Collective.wait`, :meth:`Collective.guard` and :meth:`Collective.end` itself. A
disabled ledger (``init_process_group(diagnostics=False)``, one process) hands out collectives
that do nothing but wait.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Protocol, Sequence

import torch
import torch.distributed as dist

from ..errors import CollectiveMismatchError, UsageError, ranks_text
from . import syncpoint
from .log import CollectiveLog, Record, call_site, describe_tensors


# Whether torch can hand tensors to NumPy (the unanimous sums of a riding check compared as
# bytes, :meth:`Ledger.arrived`)
try:
    torch.zeros(1).numpy()
    _NUMPY = True
except (RuntimeError, TypeError):
    _NUMPY = False


def _unshadowable(op: str, verdict: syncpoint.Verdict, world: int) -> UsageError:
    """An active rank's words for a collective the joined ranks cannot take part in (they
    raise at the same point: :mod:`phalanx.uneven`), instead of waiting for them forever."""
    joined = [r for r in range(world) if r not in verdict.ranks]
    return UsageError(
        f"{op} inside phalanx.join: {ranks_text(joined)} "
        f"{'has' if len(joined) == 1 else 'have'} joined (out of "
        "inputs) and cannot take part in it. Give join every DistributedDataParallel, "
        "fully_shard root module, ZeroRedundancyOptimizer, Checkpointer and PreemptionHandler "
        "in use, and use phalanx's collectives")


class Observer(Protocol):
    """Told when a recorded collective's wait fails (see the module notes)."""

    def failed(self, record: Record, error: RuntimeError) -> RuntimeError | None:
        """The error to raise instead of ``error`` (``None``: ``error`` itself). ``record`` is
        still in flight: the ledger ends it afterwards."""


class JoinView(Protocol):
    """A running join, as the ledger sees it (:mod:`phalanx.uneven`)."""

    active: tuple[int, ...]  # the ranks still active at the last sync point
    world: int  # the join's ranks, active or not

    def index(self, obj: Any) -> int | None:
        """``obj``'s place among the joinables, or ``None``."""

    def seen(self, verdict: syncpoint.Verdict) -> None:
        """Every settled sync point's verdict (who is still active)."""

    def authoritative(self) -> int:
        """The rank whose state counts while ranks have joined."""


@dataclass(slots=True)
class _Check:
    """A sync point in flight, or, ``riding``, one that waits to ride the next bucket (then
    :meth:`Ledger.take_ride` hands it out as the :data:`Ride`)."""

    what: str
    site: str
    since: list[str]  # the collectives before it, since the previous point
    payload: Any  # riding: (fingerprint, head, unanimous sums, verdict, their bytes, head in NumPy); else the envelope
    work: Any
    collective: Collective | None  # riding: None until it goes out alone (_send_alone)
    group: Any
    world: int
    riding: bool = False
    plain: int = 0  # riding: the fingerprint it goes out with if it cannot ride after all
    announce: tuple[int, ...] = ()
    then: str = ""  # what it went out with: a bucket it rode, or the collective it came before
    record: Record | None = None  # its record in the log
    head: Any = None  # riding: this rank's head (a tensor of the envelope's dtype)


# A sync point riding a bucket's all-reduce (:meth:`Ledger.take_ride`): its ``head`` goes in
# front of the bucket's gradients, the summed head comes back to :meth:`Ledger.arrived`.
Ride = _Check


class Collective:
    """One recorded collective (or a few, recorded as one): see :meth:`Ledger.collective`."""

    __slots__ = ("_ledger", "record", "_observed")

    def __init__(self, ledger: Ledger | None, record: Record | None, observed: bool = True) -> None:
        self._ledger, self.record, self._observed = ledger, record, observed

    def wait(self, work: Any) -> Any:
        """Wait for ``work``; a failure raises what the observers make of it. Returns
        ``work.wait()``'s value."""
        if self._ledger is None:
            return work.wait()
        start = time.monotonic()
        try:
            return work.wait()
        except RuntimeError as e:  # as guard() does (inline: a DDP step waits here every step)
            better = self.failure(e)
            if better is e:
                raise
            raise better from e
        finally:
            self._ledger.waited_s += time.monotonic() - start

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Around code that may wait for this collective (a launch that waits for earlier
        ones): a failure raises what the observers make of it."""
        try:
            yield
        except RuntimeError as e:
            better = self.failure(e)
            if better is e:
                raise  # the error itself, its traceback and cause intact
            raise better from e

    def failure(self, error: RuntimeError) -> RuntimeError:
        """What to raise for ``error``, raised by code that waited for this collective (as
        :meth:`guard` raises it; ``error`` itself, or the observers' word raised from it)."""
        if self.record is None:
            return error
        return self._ledger.failure(self.record, error, self._observed)

    def end(self) -> None:
        record = self.record
        if record is not None and record.end is None:
            record.end = time.monotonic()  # CollectiveLog.end, inline: every bucket ends here

    # A collective is under way while something holds it: dropped (a failed backward's buckets,
    # the meeting of a LocalSGD thrown away), it is over, whatever became of its results.
    __del__ = end

    def __enter__(self) -> Collective:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if isinstance(exc, RuntimeError) and self.record is not None and self.record.end is None:
                better = self._ledger.failure(self.record, exc, self._observed)
                if better is not exc:
                    raise better from exc
        finally:
            self.end()


class Ledger:
    """The collectives of one job's default process group: see the module notes.

    Args:
        timeout_s: the group's timeout (the watchdog limit of the observers).
        check_group: a Gloo group over the world for sync points when the world is on NCCL
            (CPU tensors never synchronise the GPU). Default ``None``: the world itself.
        enabled: ``False``: nothing is recorded or checked (collectives only wait).
    """

    def __init__(self, timeout_s: float, check_group: Any = None, enabled: bool = True) -> None:
        self.timeout_s = timeout_s
        self.enabled = enabled
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.observers: list[Observer] = []
        self.join: JoinView | None = None  # while a join runs
        self.logs: dict[str, CollectiveLog] = {}
        self.waited_s = 0.0  # seconds this process has spent waiting for collectives to end
        self._check_group = check_group
        self._names: dict[int, str] = {}
        # per group (by id, as _names): its name and log, its (rank, size); a DDP step asks each
        # twice. Each entry holds the group too: its id is not reused while the entry exists
        self._logs_of: dict[int, tuple[Any, str, CollectiveLog]] = {}
        self._sizes: dict[int, tuple[Any, int, int]] = {}
        # (what, announce, ride, since, group's id) -> a riding check, worked out once
        # (_prepare_ride): a training loop's steps ask the same, step after step
        self._rides: dict[tuple[Any, ...], list[Any]] = {}
        self._pending: _Check | None = None  # a sync point started, not yet waited for
        self._last_work: Any = None

    # ---- the log --------------------------------------------------------------------------
    def group_name(self, group: Any) -> str:
        if group is None or group is dist.group.WORLD:
            return "world"
        name = self._names.get(id(group))
        if name is None:
            ranks = dist.get_process_group_ranks(group)
            name = self._names[id(group)] = f"ranks {','.join(map(str, ranks))}"
        return name

    def log(self, group: Any) -> CollectiveLog:
        return self._named_log(group)[1]

    def _named_log(self, group: Any) -> tuple[str, CollectiveLog]:
        """``group``'s name and log."""
        found = self._logs_of.get(id(group))
        if found is None:
            name = self.group_name(group)
            log = self.logs.get(name)
            if log is None:
                log = self.logs[name] = CollectiveLog()
            found = self._logs_of[id(group)] = (group, name, log)
        return found[1], found[2]

    def _rank_size(self, group: Any) -> tuple[int, int]:
        """This process's rank in ``group`` and the group's size."""
        found = self._sizes.get(id(group))
        if found is None:
            found = self._sizes[id(group)] = (group, dist.get_rank(group), dist.get_world_size(group))
        return found[1], found[2]

    def in_flight(self) -> bool:
        return any(log.in_flight() is not None for log in self.logs.values())

    def shadow(self, obj: Any, action: int, *args: int) -> tuple[int, ...] | None:
        """While a join runs: the announcement that joinable ``obj`` shadows ``action`` (with
        ``args``); ``None`` outside a join or for an object not in it."""
        index = None if self.join is None else self.join.index(obj)
        return None if index is None else (syncpoint.JOINABLE, index, int(action), *args)

    def collective(self, op: str, tensors: Sequence[Any] = (), group: Any = None, *,
                   check: bool = False, shadow: tuple[int, ...] | None = None,
                   site: str | None = None, announced: bool = False,
                   diagnosed: bool = False, described: tuple[str, tuple[int, ...]] | None = None) -> Collective:
        """Record a collective about to be issued (see the module notes).

        Args:
            op: how the log names it.
            tensors: what it moves (the log's dtype and shape).
            check: a sync point first: every rank of ``group`` agrees it is here.
            shadow: how a rank that has joined takes part (an announcement of
                :mod:`~phalanx.ledger.syncpoint`); default: it cannot (it raises).
            site: the script's line that led here; default: found from the stack.
            announced: the caller's own sync point announced it already.
            diagnosed: its failure says what went wrong already (``monitored_barrier`` names
                the ranks that did not arrive): the observers are not asked.
            described: ``tensors``' dtype and shape as :func:`~phalanx.ledger.log.describe_tensors`
                gives them, worked out before (the tensors need not be passed then).
        """
        if not self.enabled:
            return Collective(None, None)
        site = site or call_site(2)
        if check:
            self.sync_point(op, group, site=site, announce=shadow or (syncpoint.UNSHADOWABLE,))
            announced = True
        if self._pending is not None:
            self.settle(then=op)  # nothing goes out before the ranks are known to agree
        dtype, shape = described or (("-", ()) if tensors == () else describe_tensors(tensors))
        if self.join is not None and not announced:
            if self.group_name(group) != "world":
                raise UsageError(f"{op} on {self.group_name(group)} inside phalanx.join: a join "
                                 "announces collectives of the whole world only")
            verdict = self.sync_point(f"{op} {dtype}{list(shape)}", group, site=site,
                                      announce=shadow or (syncpoint.UNSHADOWABLE,))
            if shadow is None and verdict is not None and verdict.count < dist.get_world_size(group):
                raise _unshadowable(op, verdict, dist.get_world_size(group))
        found = self._logs_of.get(id(group))  # _named_log, inline: every DDP bucket comes here
        name, log = self._named_log(group) if found is None else found[1:]
        return Collective(self, log.begin(op, dtype, shape, name, site), not diagnosed)

    def _check_record(self, what: str, group: Any, site: str) -> tuple[Collective, CollectiveLog]:
        """The record of a sync point's own collective, and ``group``'s log. The sync point
        restarts the log's fingerprint: the record is not counted in it."""
        if self._pending is not None:
            self.settle(then=f"check before {what}")
        name, log = self._named_log(group)
        record = log.begin(f"check before {what}", "-", (), name, site or call_site(2), counted=False)
        return Collective(self, record), log

    def failure(self, record: Record, error: RuntimeError, observed: bool = True) -> RuntimeError:
        """What to raise for ``record``'s failed wait: the first observer's word (when
        ``observed``), else ``error``; ``record`` ends, failed."""
        try:
            for observer in self.observers if observed else ():
                better = observer.failed(record, error)
                if better is not None:
                    return better
            return error
        finally:
            CollectiveLog.end(record, failed=True)

    # ---- sync points ----------------------------------------------------------------------
    def sync_point(self, what: str, group: Any = None, *, flags: Sequence[int] = (),
                   site: str | None = None, wait: bool = True,
                   announce: tuple[int, ...] = (), ride: str = "") -> syncpoint.Verdict | None:
        """Every rank of ``group`` checks here that it agrees with the others on ``what`` and
        on the collectives since the last point (:mod:`~phalanx.ledger.syncpoint`).

        Args:
            flags: this rank's flags; the verdict says which some rank raised.
            wait: ``False`` only starts the check: the next collective recorded (or
                :meth:`settle`) waits for it, so its latency hides behind the work in
                between (a forward's, for DDP); ``None`` is returned. While a join runs,
                every check is waited for.
            announce: for ranks that have joined: how they take part in what follows.
            ride: (with ``wait=False``) the signature of the collective the check may ride
                instead of going out alone (``"DDP bucket 0 float32[22]"``, in the fingerprint:
                ranks that would sum different buckets never agree): the bucket that takes it
                (:meth:`take_ride`) carries it; any other collective (or :meth:`settle`) sends
                it alone first. Outside a join, on a group that is its own check group,
                without flags. Default ``""``: the check goes alone.

        Returns:
            The :class:`~phalanx.ledger.syncpoint.Verdict` (with ``wait``); ``None`` when the
            ledger is disabled.

        Raises:
            CollectiveMismatchError: on every rank, naming what each rank is at.
        """
        if not self.enabled:
            return None
        site = site or call_site(2)
        wait = wait or self.join is not None
        if ride and not wait and not flags and (self._check_group is None or group is not None):
            # (rides_on, inline: every DDP step comes here.) A check that rides is told apart
            # from one that went alone: a rank whose bucket carries it never agrees with a rank
            # that sent it alone (its gradients would be summed with the other's zeros)
            if self._pending is not None:
                self.settle(then=f"check before {what}")
            found = self._logs_of.get(id(group))
            log = self._named_log(group)[1] if found is None else found[2]
            key = (what, announce, ride, log.fingerprint, id(group))
            prepared = self._rides.get(key)
            if prepared is None:
                if len(self._rides) >= 64:  # a loop's few kinds of step; never grows without end
                    self._rides.clear()
                prepared = self._rides[key] = self._prepare_ride(what, announce, ride, log.fingerprint, group)
            plain, world, payload, name, op, check = prepared
            # its record (log.begin, inline) is not counted in the fingerprint, which restarts
            # here whatever the verdict (a new list); a Collective for it is made only if it goes
            # alone
            record = Record(log.next_seq, op, "-", (), name, site, time.monotonic())
            log.next_seq += 1
            log.records.append(record)
            if check is None or not check.riding:
                check = prepared[5] = _Check(what, site, log.since_check, payload, None, None, group, world, True,
                                             plain, announce, ride, record, payload[1])
            else:  # the last such step's, done with: taken and summed in that backward's end
                check.site, check.since, check.record = site, log.since_check, record
            self._pending = check
            log.fingerprint, log.since_check = 0, []
            return None
        return self._meet(syncpoint.fingerprint(f"{what} {announce}", self.log(group).fingerprint), what, site,
                          group, flags, announce, wait)

    def rides_on(self, group: Any) -> bool:
        """Whether a check of ``group`` may ride its collectives: it is its own check group."""
        return self._check_group is None or group is not None

    def _prepare_ride(self, what: str, announce: tuple[int, ...], ride: str, since: int,
                      group: Any) -> list[Any]:
        """A riding check's fingerprint alone (if it goes alone after all), the group's size,
        its payload: (fingerprint riding, this rank's head, the unanimous sums, their verdict,
        the sums' bytes, the head as a NumPy array), the group's name, the check's record's op,
        and a place for the check (made at the first such step, then reused while it rides)."""
        h = syncpoint.fingerprint(f"{what} {announce} riding {ride}", since)
        rank, world = self._rank_size(group)
        mine = syncpoint.head(h, announce, (), rank, world)
        everyone = torch.tensor(syncpoint.unanimous(h, announce, world), dtype=syncpoint.envelope_dtype(world))
        head = torch.tensor(mine, dtype=everyone.dtype)
        payload = (h, head, everyone, syncpoint.read(everyone, world),
                   everyone.numpy().tobytes() if _NUMPY else None, head.numpy() if _NUMPY else None)
        return [syncpoint.fingerprint(f"{what} {announce}", since), world, payload, self.group_name(group),
                f"check before {what}", None]

    def take_ride(self, group: Any) -> Ride | None:
        """The pending check, if it waits to ride a collective of ``group``: the caller puts
        :attr:`Ride.head` in front of its own all-reduce (SUM) of :func:`~.syncpoint.envelope_size`
        values of :func:`~.syncpoint.envelope_dtype` (the collective it was told of, see
        :meth:`sync_point`) and hands the summed head to :meth:`arrived` before it issues
        anything else."""
        check = self._pending
        if check is None or not check.riding or check.group is not group:
            return None
        self._pending = None
        check.record.end = time.monotonic()  # it goes out with the bucket, whose record follows it
        return check

    def arrived(self, ride: Ride, summed: Any, raw: Any = None) -> syncpoint.Verdict:
        """The ridden all-reduce is done: ``summed`` holds the summed heads (the envelope's
        first :func:`~.syncpoint.head_size` values); ``raw``, if given, is its memory as a NumPy
        array (compared as bytes, in one call). Raises
        :class:`~phalanx.errors.CollectiveMismatchError` on every rank when they disagree."""
        unanimous, verdict, unanimous_bytes = ride.payload[2:5]
        if (raw.tobytes() == unanimous_bytes) if raw is not None else torch.equal(summed, unanimous):
            return verdict
        verdict = syncpoint.read(summed, ride.world)
        if not verdict.agree:
            # the bucket went out here, the others' collective there: neither counts in the
            # history the ranks compare next (as a mismatch at a check of its own leaves it)
            self.log(ride.group).checked()
            self._mismatch(ride)
        return verdict

    def probe(self, group: Any, flags: Sequence[int] = ()) -> syncpoint.Verdict:
        """A rank that has joined takes part in the next sync point of the others (zeros, but
        its ``flags``) and learns what they announce (:mod:`phalanx.uneven`)."""
        return self._meet(None, "joined: out of inputs", "", group, flags, (), True)

    def _meet(self, h: int | None, what: str, site: str, group: Any, flags: Sequence[int],
              announce: tuple[int, ...], wait: bool) -> syncpoint.Verdict | None:
        on = self._check_group if self._check_group is not None and group is None else group
        rank, world = self._rank_size(on)
        payload = syncpoint.payload(h, announce, tuple(flags), rank, world)
        check, log = self._check_record(what, group, site)
        with check.guard():
            work = dist.all_reduce(payload, group=on, async_op=True)
        self._last_work = work  # see phalanx.comm.LastWorks: dropped by the main thread
        self._pending = _Check(what, site, log.since_check, payload, work, check, on, world)
        log.checked()  # the next fingerprint starts here, whatever the verdict (a new list)
        return self.settle() if wait else None

    def settle(self, then: str = "") -> syncpoint.Verdict | None:
        """Wait for the pending sync point (one waiting to ride goes out alone first, before
        ``then``); raise on a mismatch; return its verdict."""
        check, self._pending = self._pending, None
        if check is None:
            return None
        if check.riding:
            self._send_alone(check, then)
        check.collective.wait(check.work)
        check.collective.end()
        verdict = syncpoint.read(check.payload, check.world)
        if not verdict.agree:
            self._mismatch(check)
        if self.join is not None:
            self.join.seen(verdict)  # who is still active; raises for throw_on_early_termination
        return verdict

    def _send_alone(self, check: _Check, then: str) -> None:
        """A check that waited to ride goes out on its own (another collective came first)."""
        check.payload = syncpoint.payload(check.plain, check.announce, (), dist.get_rank(check.group),
                                          check.world)
        check.then = then.removeprefix("check before ") or "its check alone"
        check.collective = Collective(self, check.record)
        with check.collective.guard():
            check.work = dist.all_reduce(check.payload, group=check.group, async_op=True)
        self._last_work = check.work
        check.riding = False

    def _mismatch(self, check: _Check) -> None:
        mine = {"rank": dist.get_rank(), "at": f"{check.what} ({check.site})", "since": check.since,
                "then": check.then}
        everyone: list[Any] = [None] * dist.get_world_size(check.group)
        dist.all_gather_object(everyone, mine, group=check.group)
        raise CollectiveMismatchError(syncpoint.mismatch_message(everyone))

    def close(self) -> list[Record]:
        """The job is ending: finish a forward's check nothing came after; return the
        collectives still under way (begun, never ended: their results never land)."""
        if self._pending is not None:
            try:
                self.settle()
            except RuntimeError:
                pass  # leaving anyway: a last mismatch or a peer gone changes nothing now
        return [r for log in self.logs.values() for r in log.records if r.end is None]
