"""Reaching the store helper listens for stop signals between attempts (a TCPStore client
alone retries for its whole timeout, deaf to them: a launcher told to stop during the
rendezvous waited out --rdzv-timeout)."""

from __future__ import annotations

import time

import pytest

from phalanx.launcher.rendezvous import Interrupted, _tcp_store
from tests.harness import free_port


def test_a_stop_signal_ends_the_attempts_to_reach_the_store_helper():
    port = free_port()  # nothing listens there
    began = time.monotonic()

    def interrupted():
        if time.monotonic() - began > 1.0:
            raise Interrupted(15)

    with pytest.raises(Interrupted):
        _tcp_store(port, 60.0, interrupted)
    assert time.monotonic() - began < 5.0  # not the 60 s timeout


def test_with_no_signal_it_gives_up_after_its_timeout():
    began = time.monotonic()
    with pytest.raises(RuntimeError):
        _tcp_store(free_port(), 2.0, lambda: None)
    assert 1.5 < time.monotonic() - began < 6.0
