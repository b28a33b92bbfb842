"""The store helper's rounds (phalanx.launcher.storehost.Rounds): a store opened on a thread,
so that a close is answered without waiting for torch's import (issue 25 item 10)."""

from __future__ import annotations

import threading
import time

import pytest

from phalanx.launcher import storehost
from phalanx.launcher.storehost import Rounds


def _wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not in time"
        time.sleep(0.01)


def test_open_soon_serves_a_fresh_store_and_connections_wait_for_it():
    rounds = Rounds(timeout=30.0)
    rounds.open_soon()
    sock = rounds.connect()  # waits for the thread's store
    try:
        assert rounds.current is not None and sock.fileno() >= 0
    finally:
        sock.close()
        rounds.close()
    assert rounds.current is None


def test_a_close_overtaking_the_open_is_answered_at_once_and_the_late_store_never_served(
        monkeypatch):
    made, release = [], threading.Event()
    real = storehost.InnerStore

    def slow_store(timeout, warn):  # as slow as a first import of torch, until released
        release.wait(30)
        made.append(real(timeout, warn))
        return made[-1]

    monkeypatch.setattr(storehost, "InnerStore", slow_store)
    rounds = Rounds(timeout=0.5)
    rounds.open_soon()
    began = time.monotonic()
    rounds.close()
    assert time.monotonic() - began < 5  # did not wait for the store being made (30 s)
    release.set()
    _wait_for(lambda: made)
    # the late store is closed unused: a connection waits its 0.5 s and finds no store
    with pytest.raises(TimeoutError, match="no round's store opened in time"):
        rounds.connect()
    assert rounds.current is None
    rounds.open_soon()  # the next round gets a store of its own
    _wait_for(lambda: len(made) == 2 and rounds.current is made[1])
    rounds.close()


def test_the_store_lingers_until_each_launcher_named_checked_out_or_is_gone():
    """Node 0's store at the end of the job: a launcher that checked out and then left (its
    gone mark too) must not stand in for one that has not read the job's end yet (a count of
    check-outs against the launchers not gone let the store go early)."""
    import torch.distributed as dist

    from phalanx.launcher.membership import checked_out_key, gone_key

    class Rdzv:
        store = dist.HashStore()

    rdzv = Rdzv()
    rdzv.store.set(checked_out_key("left"), "1")  # checked out, then exited: both marks
    rdzv.store.set(gone_key("left"), "exited")
    rdzv.store.set(gone_key("died"), "exited")  # never checked out: nobody to wait for
    late = threading.Timer(0.5, lambda: rdzv.store.set(checked_out_key("slow"), "1"))
    began = time.monotonic()
    late.start()
    storehost._linger(rdzv, ["left", "died", "slow"])
    waited = time.monotonic() - began
    assert 0.5 <= waited < storehost.LINGER_S, waited
    began = time.monotonic()
    storehost._linger(rdzv, [])  # nobody else: at once
    assert time.monotonic() - began < 0.5
