"""PreemptionHandler in one process: signals become a flag, handlers come back, bad input."""

import os
import signal

import pytest

from phalanx.checkpoint import PreemptionHandler
from phalanx.errors import PREEMPTED_EXIT_CODE


def test_signal_sets_the_flag_and_previous_handlers_return():
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: seen.append("user handler"))
    try:
        before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
        with PreemptionHandler() as preemption:
            assert not preemption.should_stop() and preemption.received is None
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGTERM)  # the first signal is the one reported
            assert preemption.received == signal.SIGUSR1
            assert preemption.should_stop() and preemption.should_stop()  # stays true
            with pytest.raises(SystemExit) as info:
                preemption.exit()
            assert info.value.code == PREEMPTED_EXIT_CODE
        assert {s: signal.getsignal(s) for s in before} == before
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == ["user handler"]  # the process survived SIGTERM, and the old handler runs
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_ctrl_c_checkpoints_like_sigterm_then_exits_130_and_a_second_one_stops_at_once():
    with PreemptionHandler() as preemption:
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt: a flag
        assert preemption.received == signal.SIGINT and preemption.should_stop()
        assert preemption.exit_code == 130
        with pytest.raises(SystemExit) as info:
            preemption.exit()
        assert info.value.code == 130
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    with PreemptionHandler() as preemption:  # a preemption signal outranks Ctrl-C: resumable
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.should_stop() and preemption.exit_code == PREEMPTED_EXIT_CODE
    with pytest.raises(KeyboardInterrupt):  # configurable: without SIGINT, Ctrl-C is as usual
        with PreemptionHandler(signals=(signal.SIGTERM, signal.SIGUSR1)):
            os.kill(os.getpid(), signal.SIGINT)


def test_handlers_are_restored_when_the_block_raises_and_check_every_counts_calls():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError, match="boom"):
        with PreemptionHandler(signals=[signal.SIGTERM] * 2, check_every=3) as preemption:
            os.kill(os.getpid(), signal.SIGTERM)
            assert [preemption.should_stop() for _ in range(4)] == [False, False, True, True]
            raise RuntimeError("boom")
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("kwargs, message", [
    ({"check_every": 0}, "Invalid check_every 0, expected a positive integer"),
    ({"check_every": True}, "Invalid check_every True, expected a positive integer"),
    ({"signals": []}, "PreemptionHandler needs at least one signal, got none"),
    ({"signals": [12345]}, "Invalid signal 12345, expected a signal number such as signal.SIGTERM"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PreemptionHandler(**kwargs)
