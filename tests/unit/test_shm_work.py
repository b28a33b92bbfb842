"""The shared-memory backend's work handle (phalanx.shm.worker.ShmWork): its wait's timeout, and
its life while only C++ holds it."""

import gc
import threading
import time
import weakref
from datetime import timedelta

import pytest
import torch

from phalanx.shm import worker
from phalanx.shm.worker import ShmWork, Worker


def test_wait_honours_its_timeout_then_the_collective_still_completes():
    work = ShmWork([torch.ones(2)])
    safety = threading.Timer(10.0, work.finish, (None,))  # a wait that ignores its timeout
    safety.start()  # returns after 10 s instead of never, and the test fails, not hangs
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"Operation timed out! .*wait\(timeout=0.2 s\)"):
        work.wait(timedelta(seconds=0.2))
    took = time.monotonic() - start
    assert 0.2 <= took < 5.0, took
    with pytest.raises(RuntimeError, match="Operation timed out"):
        work.wait(0.05)  # seconds, as a number
    assert not work.is_completed()
    safety.cancel()
    threading.Timer(0.1, work.finish, (None,)).start()
    assert work.wait(timedelta(seconds=30)) is True  # done well within it: no error
    assert work.is_completed() and work.is_success()


def test_a_zero_or_absent_timeout_waits_until_done():
    for timeout in (None, timedelta(0), 0):  # torch's kNoTimeout is zero
        work = ShmWork([])
        threading.Timer(0.3, work.finish, (None,)).start()
        start = time.monotonic()
        assert work.wait(timeout) is True
        assert time.monotonic() - start >= 0.25, timeout


def test_a_work_wait_raises_the_collectives_error_not_a_timeout():
    work = ShmWork([])
    work.finish(ValueError("ranks disagree"))
    with pytest.raises(ValueError, match="ranks disagree"):
        work.wait(timedelta(seconds=1))


def test_a_work_lives_until_claimed_as_cxx_holds_only_the_cxx_object():
    """pybind11 keeps a Python subclass's methods only while its Python object lives: a work
    that only C++ holds (torch's DDP reducer) must stay alive here until C++ has called
    get_future(), or among the last few waited ones after wait()."""
    worker._UNCLAIMED.clear()
    worker._WAITED.clear()
    done = ShmWork([torch.zeros(1)], True)
    pending = ShmWork([torch.zeros(1)])
    refs = [weakref.ref(done), weakref.ref(pending)]
    del done, pending
    gc.collect()
    assert all(r() is not None for r in refs), "a work died while C++ may still hold it"
    future = refs[0]().get_future()  # the last call C++ makes: the work may go
    assert future.done() and future.value()[0].tolist() == [0.0]
    gc.collect()
    assert refs[0]() is None
    refs[1]().finish(None)
    assert refs[1]().wait() is True  # a wait: C++ may still ask for the future
    gc.collect()
    assert refs[1]() is not None and refs[1]().get_future().done()
    for _ in range(worker.WAITED_KEPT):  # ... until enough later works were waited for
        ShmWork([], True).wait()
    gc.collect()
    assert refs[1]() is None


def test_works_nobody_claims_are_let_go_past_the_bound():
    worker._UNCLAIMED.clear()
    first = weakref.ref(ShmWork([], True))
    for _ in range(worker.UNCLAIMED_KEPT):
        ShmWork([], True)
    gc.collect()
    assert first() is None and len(worker._UNCLAIMED) == worker.UNCLAIMED_KEPT
    worker._UNCLAIMED.clear()


def test_the_worker_runs_a_blocking_call_inline_and_keeps_its_work_for_cxx():
    w = Worker("test-shm-worker")
    try:
        ran = []
        work = w.submit(lambda: ran.append(1), [torch.ones(1)], async_op=False)
        assert ran == [1] and work.is_completed()
        ref = weakref.ref(work)
        del work
        gc.collect()
        assert ref() is not None and ref().get_future().value()[0].item() == 1.0
    finally:
        w.close()


def _cxx_get_future(work):
    """``work.get_future()`` as C++ asks for it: from a frame that does not name it."""
    return getattr(work, "get" + "_future")()


def test_cxx_gets_a_tensor_list_future_and_a_real_error():
    """C++ (torch's reducer, its FP16_COMPRESS hook) reads a future's value as a TensorList
    and its error as an error: a Python-made future has a PyObject value and holds an
    exception as its value. Done works' futures are complete at once (the reducer reads join's
    divide factor right after waiting); pending ones complete when the work does."""
    t = torch.ones(2)
    done = ShmWork([t], True)
    future = _cxx_get_future(done)
    assert future.done() and future.value()[0] is t
    assert _cxx_get_future(done) is future  # one per work
    assert done.get_future() is not future  # Python's own: completed by this module
    failed = ShmWork([t], True, ValueError("rank 1 exited"))
    with pytest.raises(RuntimeError, match="ValueError: rank 1 exited"):
        _cxx_get_future(failed).wait()
    for error in (None, ValueError("mismatch")):
        pending = ShmWork([[t, t]])
        future = _cxx_get_future(pending)
        assert not future.done()
        pending.finish(error)
        if error is None:
            assert future.wait() == [[t, t]]
        else:
            with pytest.raises(RuntimeError, match="ValueError: mismatch"):
                future.wait()
    assert _cxx_get_future(ShmWork([], True)).value() == []  # a barrier's


_EXIT_RIGHT_AFTER_WAITING = """
import torch
from phalanx.shm.worker import ShmWork
works = [ShmWork([torch.ones(4)]) for _ in range(10)]
futures = [w.get_future() for w in works] + [getattr(w, "get" + "_future")() for w in works]
for w in works:
    w.finish(None)
for f in futures:
    f.wait()
"""


def test_exiting_right_after_waiting_for_futures_does_not_abort():
    """A future's completion gives the GIL up while its callbacks run (its waiter returns
    then) and takes it back after; a daemon thread doing so once the interpreter finalises is
    ended inside C++: "terminate called without an active exception" (2-4 of 12 such runs
    before the exit waited for the completer)."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    runs = [subprocess.Popen([sys.executable, "-c", _EXIT_RIGHT_AFTER_WAITING], env=env,
                             stderr=subprocess.PIPE, text=True) for _ in range(6)]
    for run in runs:
        _, err = run.communicate(timeout=120)
        assert run.returncode == 0, (run.returncode, err[-2000:])
