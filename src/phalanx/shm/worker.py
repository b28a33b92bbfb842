"""Issue order, off the caller's thread: each group's collectives run one at a time on a
worker thread of its own, in the order they were issued, and each returns a :class:`ShmWork`
at once. A blocking call with nothing queued or running before it runs on the caller's thread
(no hand-off) and returns a work already complete.

A collective that breaks the group (a peer died, a mismatch, a timeout) fails every one
queued after it, and every later one, with the same error.

The per-call path is kept short (small collectives take tens of microseconds): a work holds a
plain lock that is released when it completes (no ``Event``), and its ``Future`` is made only
when someone asks for it (``get_future``), so a blocking call builds neither.

Two futures, one per kind of caller. A Python caller (a comm hook, ``dist.all_reduce(...,
async_op=True).get_future()``) gets a ``torch.futures.Future`` completed by this module: its
value is the result list, its error the collective's own exception. C++ callers (torch's DDP
reducer and its built-in hooks, join) read a future's value as an ``IValue`` and its error as a
C++ error, and a Python-made future has neither: its value is a ``PyObject`` (the FP16_COMPRESS
hook asserts a TensorList) and ``set_exception`` stores the exception *as its value*, so C++
saw a failed collective succeed, and the reducer took element 0 of the empty tensor list it
extracted from the exception. C++ gets :func:`cxx_future` instead: a future TorchScript makes,
of type ``List[Tensor]`` (``List[List[Tensor]]`` for a list all-gather), completed with the
result list or with a real error when the Python one completes.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections import deque
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.futures import Future

from .channel import BrokenGroupError

# Guards the hand-over of a work's Future between the thread that completes the work and one
# asking for the Future (each must see the other's step, never both set it).
_FUTURE_LOCK = threading.Lock()

# Works kept alive for C++. A work handed to C++ (torch's DDP reducer, its join, functional
# collectives) is held there only as the C++ object: once Python drops the last reference to
# it, pybind11 forgets the Python methods, and C++'s later getFuture() (or wait()) reaches
# c10d's base Work: "Work::getFuture not implemented" (or a wait that never ends). So a work
# is kept here until it is claimed: until get_future() (the last call anyone makes on a work),
# or, after wait() (which torch's reducer may follow with getFuture()), among the last
# WAITED_KEPT waited works. Both bounded, so that works nobody waits for (an async_op=True
# collective whose work the caller dropped) are let go eventually.
_UNCLAIMED: dict[int, "ShmWork"] = {}
UNCLAIMED_KEPT = 1024
WAITED_KEPT = 16
# Seconds the process waits at exit for futures still being completed (_Completer.settle).
SETTLE_S = 2.0
_WAITED: deque["ShmWork"] = deque(maxlen=WAITED_KEPT)


class ShmWork(dist._Work):
    """The handle of one collective: ``wait()`` returns once it is done (raising its error),
    ``get_future()`` completes with ``result`` then."""

    def __init__(self, result: list[Any], done: bool = False,
                 error: BaseException | None = None) -> None:
        super().__init__()
        self._result = result
        self._future: Future | None = None
        self._cxx_future: Future | None = None
        self._error = error
        self._done = done
        # Held until the work completes: wait() acquires and releases it.
        self._pending: Any = None
        if not done:
            self._pending = threading.Lock()
            self._pending.acquire()
        _UNCLAIMED[id(self)] = self
        if len(_UNCLAIMED) > UNCLAIMED_KEPT:
            try:
                del _UNCLAIMED[next(iter(_UNCLAIMED))]
            except (KeyError, RuntimeError, StopIteration):
                pass  # another thread took it (or changed the dict) meanwhile: none is lost

    def finish(self, error: BaseException | None) -> None:
        """Complete the work (the worker thread's call, once)."""
        self._error = error
        with _FUTURE_LOCK:
            self._done = True
            future = self._future
        if future is not None:
            _COMPLETER.complete(future, self._result, error)
        self._pending.release()

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Until the collective is done; its error, if any, is raised. ``timeout`` (a
        ``timedelta`` or seconds; ``None`` or zero: none, as torch's ``kNoTimeout``) bounds
        this wait only: past it, a ``RuntimeError`` as torch's ``Work.wait`` raises, and the
        collective goes on (the group's own timeout still bounds it)."""
        if not self._done:
            seconds = (timeout.total_seconds() if isinstance(timeout, timedelta)
                       else float(timeout or 0))
            if not self._pending.acquire(timeout=seconds if seconds > 0 else -1):
                raise RuntimeError(
                    f"phalanx_shm: Operation timed out! The collective was still running "
                    f"after wait(timeout={seconds:g} s); it goes on, bounded by the group's "
                    "own timeout: wait() again for it")
            self._pending.release()
        if _UNCLAIMED.pop(id(self), None) is not None:
            _WAITED.append(self)
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._done and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[Any]:
        self.wait()
        return self._result

    def get_future(self) -> Future:
        """The work's future: completed with the result list (a list of tensors, of lists of
        tensors for a list all-gather) or the collective's error. Asked by C++, a future whose
        value C++ can read (:func:`cxx_future`)."""
        _UNCLAIMED.pop(id(self), None)
        if _asked_by_cxx():
            with _FUTURE_LOCK:
                typed, done = self._cxx_future, self._done
            if typed is None:
                # A work already done gets a future already complete: C++ may read its value
                # at once (the reducer reads the divide factor of join's forward work so,
                # right after waiting for the work).
                typed = (self._cxx_future_done() if done
                         else cxx_future(self._python_future(), self._result))
                with _FUTURE_LOCK:
                    typed = self._cxx_future = self._cxx_future or typed
            return typed
        return self._python_future()

    def _cxx_future_done(self) -> Future:
        """:func:`cxx_future` of a work already done, complete now (no hop through a pool)."""
        if self._error is not None:
            failed = Future()
            failed.set_exception(self._error)
            return failed.then(_checked)  # a callback on a completed future runs at once
        try:  # complete, of the type torch infers for the result (what torch.jit.fork does)
            return torch._C.fork(_same, self._result)
        except RuntimeError:  # no type to infer: an empty list (barrier's), read by no C++
            return self._python_future()

    def _python_future(self) -> Future:
        with _FUTURE_LOCK:
            future = self._future
            if future is not None:
                return future
            future = self._future = Future()
            done = self._done
        if done:
            _complete(future, self._result, self._error)
        return future


def _asked_by_cxx() -> bool:
    """Whether ``get_future``'s caller is C++ (torch's ``PyWork::getFuture``, called by the
    reducer, its built-in hooks, join) rather than Python code: Python code that calls
    ``get_future`` names it; C++ enters from whatever Python frame was running when this
    thread went into C++ (``loss.backward()``'s engine call), or from none at all."""
    try:
        caller = sys._getframe(2)  # 0: this, 1: get_future, 2: its caller
    except ValueError:  # no Python frame under get_future: C++ called it on a thread of its own
        return True
    return "get_future" not in caller.f_code.co_names


# TorchScript makes the only futures of a given element type whose completion Python can
# trigger: a forked function waits for a future and returns the tensors it was given. Its
# future's type is the function's return type, and its value the IValue of that type; an
# error in the awaited future ends the forked function with that error.
_CXX_SOURCE = """
def _tensors_when(done: Future[int], tensors: List[Tensor]) -> List[Tensor]:
    torch.jit.wait(done)
    return tensors

def tensors(done: Future[int], tensors: List[Tensor]) -> Future[List[Tensor]]:
    return torch.jit.fork(_tensors_when, done, tensors)

def _tensor_lists_when(done: Future[int], lists: List[List[Tensor]]) -> List[List[Tensor]]:
    torch.jit.wait(done)
    return lists

def tensor_lists(done: Future[int], lists: List[List[Tensor]]) -> Future[List[List[Tensor]]]:
    return torch.jit.fork(_tensor_lists_when, done, lists)
"""
_CXX_LOCK = threading.Lock()
_cxx: Any = None  # the compiled _CXX_SOURCE (torch.jit.CompilationUnit), made at first use


def _same(result: list[Any]) -> list[Any]:
    return result


def _checked(future: Future) -> Any:
    """A callback that raises the collective's error: ``then`` turns it into a C++ error."""
    return future.value()


def cxx_future(future: Future, result: list[Any]) -> Future:
    """A future that completes when ``future`` (a Python-made one, completed with ``result``
    or an exception) does, with ``result`` as C++ reads it (``List[Tensor]``, or
    ``List[List[Tensor]]``), or with its error as a C++ error. Its callbacks run on torch's
    inter-op thread pool: only C++ gets it (its callbacks never block)."""
    global _cxx
    with _CXX_LOCK:
        if _cxx is None:
            _cxx = torch.jit.CompilationUnit(_CXX_SOURCE)
    signal = future.then(_checked)
    if all(isinstance(t, torch.Tensor) for t in result):
        return _cxx.tensors(signal, result)
    if all(isinstance(ts, list) and all(isinstance(t, torch.Tensor) for t in ts) for ts in result):
        return _cxx.tensor_lists(signal, result)
    return signal  # (no collective returns another result; this one still fails in C++)


def _complete(future: Future, result: list[Any], error: BaseException | None) -> None:
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


class _Completer:
    """Completes the futures of works done on a worker thread, off that thread: completing a
    future runs its callbacks, and a callback may issue a collective of the same group and wait
    for it (torch's PowerSGD hook does), which only the worker can run. A job never waits for a
    busy completer: with none idle, a new thread is started (as many as callbacks block at once)."""

    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._jobs: deque[tuple[Future, list[Any], BaseException | None]] = deque()
        self._idle = 0
        self._running = 0  # futures being completed now

    def complete(self, future: Future, result: list[Any], error: BaseException | None) -> None:
        with self._cv:
            self._jobs.append((future, result, error))
            if len(self._jobs) > self._idle:
                threading.Thread(target=self._loop, name="phalanx_shm-futures",
                                 daemon=True).start()
            else:
                self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._idle += 1
                while not self._jobs:
                    self._cv.wait()
                self._idle -= 1
                future, result, error = self._jobs.popleft()
                self._running += 1
            try:
                _complete(future, result, error)
            finally:
                with self._cv:
                    self._running -= 1
                    if not self._running and not self._jobs:
                        self._cv.notify_all()  # settle() may wait for this

    def settle(self, timeout: float = SETTLE_S) -> None:
        """Wait until no future is being completed (at most ``timeout`` seconds). At exit:
        completing a future releases the GIL while its callbacks run (the caller's wait()
        returns meanwhile) and takes it back after; a daemon thread that takes the GIL back
        once the interpreter is finalising is ended inside C++, which aborts the process
        ("terminate called without an active exception", seen in 2 of 12 runs of a script
        exiting right after waiting for ten futures)."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._running or self._jobs:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cv.wait(left)


_COMPLETER = _Completer()
# A forked child has none of the parent's threads: it starts with no completer thread either.
os.register_at_fork(after_in_child=_COMPLETER.__init__)
atexit.register(_COMPLETER.settle)  # (runs before the interpreter finalises)


class Worker:
    """Runs one group's collectives in issue order (see the module's notes)."""

    def __init__(self, name: str) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._queue: deque[tuple[Callable[[], None], ShmWork]] = deque()
        self._busy = False
        self._closed = False
        self._broken: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        self.ident = self._thread.ident

    def submit(self, run: Callable[[], None], result: list[Any], async_op: bool) -> ShmWork:
        with self._cv:
            if self._closed:
                raise RuntimeError("phalanx_shm: the process group has been destroyed")
            if async_op or self._busy or self._queue:
                work = ShmWork(result)
                self._queue.append((run, work))
                self._cv.notify()
                return work
            self._busy = True
        return ShmWork(result, True, self._run(run))

    def _run(self, run: Callable[[], None]) -> BaseException | None:
        """Run one collective (this thread holds the group: ``_busy``); its error, if any."""
        error = self._broken
        if error is None:
            try:
                if torch.is_grad_enabled():  # the caller's thread: writes outside autograd,
                    with torch.no_grad():    # as Gloo's (a no_grad view of a parameter...)
                        run()
                else:
                    run()
            except BrokenGroupError as e:
                error = self._broken = e.args[0]
            except Exception as e:  # noqa: BLE001 - handed to whoever waits on the work
                error = e
        with self._cv:
            self._busy = False
            if self._queue or self._closed:
                self._cv.notify()
        return error

    def _loop(self) -> None:
        torch.set_grad_enabled(False)  # this thread's own mode: collectives write outside autograd
        while True:
            with self._cv:
                while self._busy or not self._queue:
                    if self._closed and not self._busy and not self._queue:
                        return
                    self._cv.wait()
                run, work = self._queue.popleft()
                self._busy = True
            work.finish(self._run(run))

    def close(self) -> None:
        """Finish what is queued, then stop the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()
