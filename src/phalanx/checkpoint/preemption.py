"""Preemption: a signal to any rank becomes one agreed stop, at a step boundary, on every rank.

Schedulers announce preemption with a signal (Slurm and Kubernetes send SIGTERM, Slurm's
``--signal`` often SIGUSR1) and kill the job a grace period later. ``phalanx run`` forwards the
signals it receives to every worker. A worker must not die on the spot (its peers would hang
in the next collective and the step in progress would be lost), nor stop on its own: a signal
may reach only some ranks, at different moments of the step. So the handler only raises a
flag, and at each step boundary the ranks all-reduce their flags: all of them see the same
answer at the same step, write one checkpoint together and exit with
:data:`phalanx.errors.PREEMPTED_EXIT_CODE`, which the launcher reports as preempted
(resumable), not failed.

Ctrl-C (SIGINT) is caught the same way by default: the ranks agree, checkpoint, and exit
with 130 (128 + SIGINT, what a shell reports for Ctrl-C), so an interrupted run loses nothing
and resumes like a preempted one. A second Ctrl-C stops at once (KeyboardInterrupt).
"""

from __future__ import annotations

import signal
from enum import IntEnum
from types import FrameType
from typing import Any, NoReturn, Sequence

import torch.distributed as dist

from .. import comm
from .._logging import get_logger
from ..diagnostics import ledger
from ..errors import PREEMPTED_EXIT_CODE
from ..ledger import syncpoint
from ..uneven import Joinable

_log = get_logger("phalanx.preemption")

# What a rank reports at a check, all-reduced with MAX: nothing, an interrupt (Ctrl-C), a
# preemption. A preemption outranks an interrupt: a job its scheduler preempts exits 75
# (resumable) even if someone pressed Ctrl-C as well.
_NOTHING, _INTERRUPT, _PREEMPT = 0, 1, 2
# Exit status after an agreed stop on Ctrl-C: 128 + SIGINT, as a shell reports it.
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT


class PreemptAction(IntEnum):
    """What a PreemptionHandler shadows on a rank that has joined (phalanx.join)."""

    CHECK = 1  # the others' should_stop(): the verdict's flags
    EXIT = 2  # the others' exit() (argument: the exit status)


class PreemptionHandler(Joinable):
    r"""Context manager that turns SIGTERM/SIGUSR1 (and Ctrl-C) into a stop agreed by every rank.

    Inside the ``with`` block the given signals set a flag instead of ending the process.
    :meth:`should_stop`, called by every rank at every step boundary, all-reduces the flags
    (one 1-element all-reduce, MAX) and answers the same on every rank: ``True`` from the first
    boundary at which any rank had received a signal. Then save a checkpoint (a collective)
    and call :meth:`exit`: status 75 (preempted, resumable), or 130 when the stop came from
    Ctrl-C (SIGINT) alone.

    .. note::
        **Cost.** One check is one all-reduce of a single number: a network round trip, no
        data to speak of (``benchmarks/bench_checkpoint.py`` measures it; under 1 ms on Gloo
        over loopback even on an oversubscribed 2-core machine), small against a training
        step, so the default checks at every step. With a process group on NCCL the flag
        travels on a Gloo group created for it (CPU tensors), so a check never synchronises
        the GPU. For very short steps pass ``check_every=N``: ranks then all-reduce only at
        every N-th call (they count calls identically, so they still agree), and a stop comes
        at most N - 1 steps later.

    .. note::
        Previous handlers are restored when the block exits, however it exits. A handler
        installed outside Python (C level, such as ``faulthandler.register``) is invisible to
        Python's ``signal`` module and is restored as the default action.

    .. note::
        **Ctrl-C.** SIGINT is among the default signals: a Ctrl-C (which ``phalanx run``
        forwards to every worker) checkpoints like SIGTERM, then :meth:`exit` ends with 130.
        A second SIGINT raises ``KeyboardInterrupt`` at once, for a run stuck before its next
        step boundary. Pass ``signals=(signal.SIGTERM, signal.SIGUSR1)`` to keep Ctrl-C's
        usual ``KeyboardInterrupt``.

    Args:
        signals (sequence of int, optional): signals to catch. Default
            ``(SIGTERM, SIGUSR1, SIGINT)``.
        group (ProcessGroup, optional): the ranks that must agree. Default ``None``: the world.
        check_every (int, optional): all-reduce at every ``check_every``-th call of
            :meth:`should_stop`. Default ``1``.

    .. warning::
        :meth:`should_stop` is a collective: every rank of ``group`` must call it the same
        number of times. Enter the block from the main thread (Python delivers signals there
        only); creating the handler on NCCL is itself a collective over the default group.

    Example::

        >>> ckpt = phalanx.Checkpointer("runs/exp1", model, optimizer, sampler=sampler)
        >>> with phalanx.PreemptionHandler() as preemption:
        ...     for epoch in range(start_epoch, n_epochs):
        ...         for batch in loader:
        ...             train_step(batch)
        ...             step += 1
        ...             if preemption.should_stop():
        ...                 ckpt.save(epoch, step)
        ...                 preemption.exit()      # SystemExit(75): "preempted, resumable"
    """

    def __init__(
        self,
        signals: Sequence[int] = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT),
        group: dist.ProcessGroup | None = None,
        check_every: int = 1,
    ) -> None:
        if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
            raise ValueError(f"Invalid check_every {check_every!r}, expected a positive integer")
        self.signals = tuple(dict.fromkeys(_signal(s) for s in signals))  # once each
        if not self.signals:
            raise ValueError("PreemptionHandler needs at least one signal, got none")
        self.check_every = check_every
        self.group = group
        self._distributed = dist.is_initialized() and dist.get_world_size(group) > 1
        self._flag_group = _cpu_group(group) if self._distributed else None
        self._previous: dict[signal.Signals, object] = {}
        self._received: signal.Signals | None = None
        self._caught: set[signal.Signals] = set()
        self._reported = False
        self._calls = 0
        self._stop = _NOTHING  # what stopped the ranks, once they agreed

    @property
    def received(self) -> signal.Signals | None:
        """The first signal this rank caught, or ``None``."""
        return self._received

    def __enter__(self) -> PreemptionHandler:
        try:
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()

    def _restore(self) -> None:
        try:
            for sig, previous in self._previous.items():
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        finally:
            self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only flags: the code this interrupts may be in the middle of anything.
        if signum == signal.SIGINT and signal.SIGINT in self._caught:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self._caught.add(signal.Signals(signum))
        if self._received is None:
            self._received = signal.Signals(signum)

    def join_flags(self) -> tuple[int, int]:
        """This rank's news as sync-point flags: a preemption signal, Ctrl-C (SIGINT)."""
        return int(bool(self._caught - {signal.SIGINT})), int(signal.SIGINT in self._caught)

    def join_shadow(self, action: int, verdict: Any) -> None:
        """Take part, on a rank that has joined (phalanx.join), in what the others do: the
        verdict of their check (``CHECK``), or their :meth:`exit` (``EXIT``)."""
        if action == PreemptAction.EXIT:
            raise SystemExit(verdict.announce[3])
        preempted, interrupted = verdict.flags
        self._stop = _PREEMPT if preempted else _INTERRUPT if interrupted else _NOTHING

    def _report(self) -> int:
        """This rank's news: a preemption signal, else an interrupt, else nothing."""
        if self._caught - {signal.SIGINT}:
            return _PREEMPT
        return _INTERRUPT if self._caught else _NOTHING

    def should_stop(self) -> bool:
        """Whether any rank received a signal, the same answer on every rank (collective).

        Once ``True`` it stays ``True`` without communicating again.
        """
        if self._stop:
            return True
        if self._received is not None and not self._reported:
            self._reported = True
            _log.info("received %s: stopping at the next agreed step boundary", self._received.name)
        self._calls += 1
        if self._calls % self.check_every:
            return False
        if self._distributed:
            book = ledger()
            if book.enabled:  # the check and the flags in one all-reduce
                group = None if self.group is None else self._flag_group
                verdict = book.sync_point("PreemptionHandler.should_stop", group, flags=self.join_flags(),
                                          announce=book.shadow(self, PreemptAction.CHECK) or (syncpoint.SYNC_ONLY,))
                self.join_shadow(PreemptAction.CHECK, verdict)
            else:
                self._stop = comm.all_reduce_max(self._report(), group=self._flag_group)
        else:
            self._stop = self._report()
        return bool(self._stop)

    @property
    def exit_code(self) -> int:
        """The status :meth:`exit` ends with: 130 when the agreed stop came from Ctrl-C
        (SIGINT) alone, else 75 (:data:`~phalanx.errors.PREEMPTED_EXIT_CODE`)."""
        return INTERRUPTED_EXIT_CODE if self._stop == _INTERRUPT else PREEMPTED_EXIT_CODE

    def exit(self) -> NoReturn:
        """End the process after the agreed stop: ``SystemExit(75)`` when preempted,
        ``SystemExit(130)`` after Ctrl-C (see :attr:`exit_code`). Ranks that have joined
        (phalanx.join) end with the same status."""
        book = ledger()
        if book.join is not None:
            book.sync_point("PreemptionHandler.exit", None if self.group is None else self._flag_group,
                            announce=book.shadow(self, PreemptAction.EXIT, self.exit_code) or (syncpoint.UNSHADOWABLE,))
        raise SystemExit(self.exit_code)


def _signal(value: int) -> signal.Signals:
    try:
        return signal.Signals(value)
    except ValueError:
        raise ValueError(
            f"Invalid signal {value!r}, expected a signal number such as signal.SIGTERM"
        ) from None


def _cpu_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``group``, or a Gloo group over the same ranks if ``group`` is on NCCL (GPU tensors)."""
    if dist.get_backend(group) != "nccl":
        return group
    members = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    return dist.new_group(ranks=members, backend="gloo")
