"""Diagnostics on real ranks: mismatched collectives named before Gloo aborts, hangs and lost
ranks reported with the late rank and every rank's place."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch

import phalanx
from tests.harness import error_of, run_ranks

WATCHDOG_S = 10.0


def _line(marker: str) -> str:
    """``test_diagnostics.py:N`` of the line in this file that ends with ``# marker``."""
    with open(__file__) as f:
        for number, text in enumerate(f, 1):
            if text.rstrip().endswith(f"# {marker}"):
                return f"test_diagnostics.py:{number}"
    raise LookupError(marker)


def _mismatches(rank, world_size):
    out = {}
    t = torch.ones(20 if rank == 0 else 12)
    out["shapes"] = error_of(lambda: phalanx.all_reduce(t))  # shapes
    if rank == 0:
        out["ops"] = error_of(lambda: phalanx.all_reduce(torch.ones(4)))  # op all_reduce
    else:
        out["ops"] = error_of(lambda: phalanx.broadcast(torch.ones(4), src=0))  # op broadcast
    # after a mismatch is named, the ranks are still in step: training can go on
    ok = torch.tensor([float(rank)])
    phalanx.all_reduce(ok)
    out["after"] = ok.item()
    out["async"] = phalanx.all_reduce(torch.ones(2), async_op=True).wait()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_mismatched_collectives_raise_on_every_rank_naming_each(world_size):
    results = run_ranks(_mismatches, world_size)
    others = ", ".join(map(str, range(1, world_size)))
    plural = "ranks" if world_size > 2 else "rank"
    verb = "are" if world_size > 2 else "is"
    for out in results:
        assert out["shapes"] == ("CollectiveMismatchError", (
            "The ranks are at different collectives: rank 0 is at all_reduce float32[20] "
            f"({_line('shapes')}); {plural} {others} {verb} at all_reduce float32[12] "
            f"({_line('shapes')})"))
        assert out["ops"] == ("CollectiveMismatchError", (
            "The ranks are at different collectives: rank 0 is at all_reduce float32[4] "
            f"({_line('op all_reduce')}); {plural} {others} {verb} at broadcast "
            f"float32[4] src=0 ({_line('op broadcast')})"))
        assert out["after"] == sum(range(world_size)) and out["async"]


def _extra_barrier(rank, world_size):
    phalanx.init_process_group(backend="gloo", timeout=timedelta(seconds=WATCHDOG_S))
    phalanx.all_reduce(torch.ones(1))
    start = time.monotonic()
    try:
        if rank == 0:
            phalanx.barrier()  # extra barrier
        else:
            time.sleep(3 * WATCHDOG_S)  # rank 1 is elsewhere
        return ("no error", time.monotonic() - start)
    except phalanx.CollectiveTimeoutError as e:
        return (type(e).__name__, str(e), e.culprits, time.monotonic() - start)
    finally:
        phalanx.destroy_process_group()


def test_a_rank_that_never_arrives_is_named_on_every_rank_within_the_limit():
    results = run_ranks(_extra_barrier, 2, init=False, timeout=60)
    for rank, (kind, message, culprits, took) in enumerate(results):
        assert kind == "CollectiveTimeoutError" and culprits == [1], message
        assert WATCHDOG_S - 1 < took < WATCHDOG_S + 6, took
        assert ("Collective timed out: rank 0 waited 10 s (the watchdog limit: "
                "init_process_group(timeout=...), phalanx run --watchdog) in #2 check before "
                f"barrier ({_line('extra barrier')})") in message
        assert "Late: rank(s) 1 never reached it" in message
        assert f"rank 1 (" in message and f"at {_line('rank 1 is elsewhere')} in _extra_barrier" in message
        assert "never reached #2: its last collective was #1 all_reduce float32[1]" in message
        assert "Stacks of the late rank(s):" in message and "time.sleep" in message
    assert results[1][1].startswith("Rank 1 was stopped: another rank gave up waiting for it.")


def _early_exit(rank, world_size):
    phalanx.init_process_group(backend="gloo", timeout=timedelta(seconds=WATCHDOG_S))
    phalanx.all_reduce(torch.ones(1))
    if rank == world_size - 1:
        import os

        os._exit(0)  # leaves mid-training, exit status 0
    start = time.monotonic()
    try:
        phalanx.all_reduce(torch.ones(1))
    except phalanx.RankExitedError as e:
        return (type(e).__name__, str(e), e.culprits, time.monotonic() - start)
    finally:
        phalanx.destroy_process_group()


def test_a_rank_that_exits_mid_training_is_named():
    results = run_ranks(_early_exit, 3, init=False, timeout=60, return_exceptions=True)
    for rank in (0, 1):
        kind, message, culprits, took = results[rank]
        assert kind == "RankExitedError" and culprits == [2], message
        assert took < WATCHDOG_S, took
        assert "Rank(s) 2 did not answer: gone" in message
