"""Issue order, off the caller's thread: each group's collectives run one at a time on a
worker thread of its own, in the order they were issued, and each returns a :class:`ShmWork`
at once; a blocking call with nothing queued before it runs on the caller's thread (no hand-off).

A collective that breaks the group (a peer died, a mismatch, a timeout) fails every one
queued after it, and every later one, with the same error.
"""

from __future__ import annotations

import threading
from collections import deque
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist
from torch.futures import Future

from .channel import BrokenGroupError


class ShmWork(dist._Work):
    """The handle of one collective: ``wait()`` returns once it is done (raising its error),
    ``get_future()`` completes with ``result`` then."""

    def __init__(self, result: list[Any]) -> None:
        super().__init__()
        self._result = result
        self._future: Future = Future()
        self._done = threading.Event()
        self._error: BaseException | None = None

    def finish(self, error: BaseException | None) -> None:
        self._error = error
        if error is None:
            self._future.set_result(self._result)
        else:
            self._future.set_exception(error)
        self._done.set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[Any]:
        self.wait()
        return self._result

    def get_future(self) -> Future:
        return self._future


class Worker:
    """Runs one group's collectives in issue order (see the module's notes)."""

    def __init__(self, name: str) -> None:
        self._cv = threading.Condition()
        self._queue: deque[tuple[Callable[[], None], ShmWork]] = deque()
        self._busy = False
        self._closed = False
        self._broken: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, run: Callable[[], None], result: list[Any], async_op: bool) -> ShmWork:
        work = ShmWork(result)
        with self._cv:
            if self._closed:
                raise RuntimeError("phalanx_shm: the process group has been destroyed")
            if async_op or self._busy or self._queue:
                self._queue.append((run, work))
                self._cv.notify_all()
                return work
            self._busy = True
        self._execute(run, work)
        return work

    def _execute(self, run: Callable[[], None], work: ShmWork) -> None:
        error = self._broken
        if error is None:
            try:
                run()
            except BrokenGroupError as e:
                error = self._broken = e.args[0]
            except Exception as e:  # noqa: BLE001 - handed to whoever waits on the work
                error = e
        with self._cv:
            self._busy = False
            self._cv.notify_all()
        work.finish(error)

    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._busy or not self._queue:
                    if self._closed and not self._busy and not self._queue:
                        return
                    self._cv.wait()
                run, work = self._queue.popleft()
                self._busy = True
            self._execute(run, work)

    def close(self) -> None:
        """Finish what is queued, then stop the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()
