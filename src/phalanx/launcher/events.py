"""What wakes the launcher's single thread: signals, and output from the workers' pipes.

The launcher never blocks on one thing: it waits in one ``select`` on every worker's stdout
and stderr plus the signal wake-up socket (``signal.set_wakeup_fd``), with the monitor
interval as timeout. SIGCHLD is caught too, so a worker's death wakes it at once.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
from typing import Iterable

from .config import STDERR, STDOUT

# The launcher stops on these, forwarding them to every worker: torchrun's --signals-to-handle
# default, also what workers learn from TORCHELASTIC_SIGNALS_TO_HANDLE.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
# These are only passed on: schedulers use them to announce preemption (Slurm's --signal).
FORWARD_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
# One read from a pipe: the kernel's default pipe capacity on Linux.
_READ_BYTES = 64 * 1024


class SignalInbox:
    """Signals received by the launcher, for the main loop to act on.

    A context manager: entering installs the handlers and the wake-up socket; leaving
    restores the previous handlers and wake-up fd, whatever happens.
    """

    def __init__(self) -> None:
        self._received: list[int] = []
        self._stop: int | None = None
        self._previous: dict[int, object] = {}
        self._old_wakeup = -1
        self._reader, self._writer = socket.socketpair()

    def __enter__(self) -> "SignalInbox":
        for sock in (self._reader, self._writer):
            sock.setblocking(False)
        try:
            self._old_wakeup = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
            for signum in (*STOP_SIGNALS, *FORWARD_SIGNALS, signal.SIGCHLD):
                self._previous[signum] = signal.signal(signum, self._handle)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)
            signal.set_wakeup_fd(self._old_wakeup)
        finally:
            self._previous.clear()
            self._reader.close()
            self._writer.close()

    def _handle(self, signum: int, frame: object) -> None:
        if signum == signal.SIGCHLD:
            return  # waking the loop (through the wake-up fd) is all it is for
        self._received.append(signum)
        if signum in STOP_SIGNALS and self._stop is None:
            self._stop = signum

    def fileno(self) -> int:
        return self._reader.fileno()

    def drain_wakeups(self) -> None:
        try:
            while self._reader.recv(4096):
                pass
        except BlockingIOError:
            pass

    def take(self) -> list[int]:
        """The signals received since the last call, oldest first."""
        out, self._received[:] = list(self._received), []
        return out

    def pending_stop(self) -> int | None:
        """The first stop signal received, if any (not consumed)."""
        return self._stop


class Pump:
    """Moves output from the workers' pipes to their :class:`~.output.WorkerOutput` while
    waiting for the next event."""

    def __init__(self, inbox: SignalInbox) -> None:
        self._inbox = inbox
        self._selector = selectors.DefaultSelector()
        self._selector.register(inbox, selectors.EVENT_READ, None)

    def add(self, worker) -> None:
        for stream, pipe in ((STDOUT, worker.popen.stdout), (STDERR, worker.popen.stderr)):
            os.set_blocking(pipe.fileno(), False)
            self._selector.register(pipe, selectors.EVENT_READ, (worker, stream))

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for output or a signal; handle what came.

        The pipes of workers that have exited are read first, to the end: a failed worker's
        last words (its traceback) come before what the others write about its absence.
        """
        ready = [key for key, _ in self._selector.select(max(timeout, 0.0))]
        ready.sort(key=lambda key: key.data is not None and key.data[0].returncode is None)
        for key in ready:
            if key.data is None:
                self._inbox.drain_wakeups()
            else:
                self._read(key, until_empty=key.data[0].returncode is not None)

    def _read(self, key: selectors.SelectorKey, until_empty: bool = False) -> None:
        worker, stream = key.data
        while True:
            try:
                data = os.read(key.fd, _READ_BYTES)
            except BlockingIOError:
                return
            if not data:  # every writer closed it
                self._selector.unregister(key.fileobj)
                key.fileobj.close()
                return
            worker.output.feed(stream, data)
            if not until_empty:
                return

    def drain(self, workers: Iterable) -> None:
        """Read everything the ``workers`` have written so far, without waiting for more."""
        wanted = {id(w) for w in workers}
        for key in list(self._selector.get_map().values()):
            if key.data is not None and id(key.data[0]) in wanted:
                self._read(key, until_empty=True)

    def remove(self, workers: Iterable) -> None:
        """Drain, then forget the ``workers``' pipes (a child of theirs may hold them open)."""
        workers = list(workers)
        self.drain(workers)
        wanted = {id(w) for w in workers}
        for key in list(self._selector.get_map().values()):
            if key.data is not None and id(key.data[0]) in wanted:
                self._selector.unregister(key.fileobj)
                key.fileobj.close()

    def close(self) -> None:
        self._selector.close()
