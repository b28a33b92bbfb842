"""Diagnostics on real ranks: mismatched collectives named before Gloo aborts, hangs and lost
ranks reported with the late rank and every rank's place."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch

import phalanx
import phalanx.shm
from phalanx.diagnostics.monitor import END_WAIT_S
from tests.harness import error_of, marked_line, run_ranks

WATCHDOG_S = 10.0


def _line(marker: str) -> str:
    return marked_line(__file__, marker)


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


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def mismatches(request):
    """(world size, every rank's results) of one group of ranks running _mismatches."""
    return request.param, run_ranks(_mismatches, request.param)


def _the_others(world_size):
    """How a mismatch message names ranks 1.. of ``world_size``: "rank 1 is", "ranks 1, 2 are"."""
    many = world_size > 2
    return ", ".join(map(str, range(1, world_size))), "ranks" if many else "rank", "are" if many else "is"


def test_mismatched_shapes_raise_on_every_rank_naming_each(mismatches):
    world_size, results = mismatches
    others, plural, verb = _the_others(world_size)
    for out in results:
        assert out["shapes"] == ("CollectiveMismatchError", (
            "The ranks are at different collectives: rank 0 is at all_reduce float32[20] "
            f"({_line('shapes')}); {plural} {others} {verb} at all_reduce float32[12] "
            f"({_line('shapes')})"))


def test_mismatched_collectives_raise_on_every_rank_naming_each(mismatches):
    world_size, results = mismatches
    others, plural, verb = _the_others(world_size)
    for out in results:
        assert out["ops"] == ("CollectiveMismatchError", (
            "The ranks are at different collectives: rank 0 is at all_reduce float32[4] "
            f"({_line('op all_reduce')}); {plural} {others} {verb} at broadcast "
            f"float32[4] src=0 ({_line('op broadcast')})"))


def test_after_a_mismatch_the_ranks_are_in_step_again(mismatches):
    world_size, results = mismatches
    for out in results:
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


@pytest.mark.slow  # waits out the watchdog's limit
def test_a_rank_that_never_arrives_is_named_on_every_rank_within_the_limit():
    results = run_ranks(_extra_barrier, 2, init=False, timeout=60)
    for rank, (kind, message, culprits, took) in enumerate(results):
        assert kind == "CollectiveTimeoutError" and culprits == [1], message
        assert WATCHDOG_S - 1 < took < WATCHDOG_S + 6, took
        assert ("Collective timed out: rank 0 waited 10 s (the watchdog limit: "
                "init_process_group(timeout=...), phalanx run --watchdog) in #2 check before "
                f"barrier ({_line('extra barrier')})") in message
        assert "Late: rank 1 never reached it" in message
        assert f"rank 1 (" in message and f"at {_line('rank 1 is elsewhere')} in _extra_barrier" in message
        assert "never reached #2: its last collective was #1 all_reduce float32[1]" in message
        assert "Stacks of the late rank:" in message and "time.sleep" in message
    assert results[1][1].startswith("Rank 1 was stopped: another rank gave up waiting for it.")


def _early_exit(rank, world_size, shared_memory):
    phalanx.init_process_group(backend="gloo", timeout=timedelta(seconds=WATCHDOG_S),
                               shared_memory=shared_memory)
    if phalanx.shm.uses_shared_memory() != shared_memory:
        return ("transport", f"shared memory used: {not shared_memory}, asked: {shared_memory}",
                [], 0.0)
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


# Both transports: Gloo's closed connection and the shared-memory backend's own error (a
# peer's exit seen through its pidfd) reach the ledger, whose report names the rank.
@pytest.mark.parametrize("shared_memory", [False, True], ids=["gloo", "shm"])
def test_a_rank_that_exits_mid_training_is_named(shared_memory):
    results = run_ranks(_early_exit, 3, shared_memory, init=False, timeout=60,
                        return_exceptions=True)
    for rank in (0, 1):
        kind, message, culprits, took = results[rank]
        assert kind == "RankExitedError" and culprits == [2], message
        assert took < WATCHDOG_S, took
        assert "Rank 2 did not answer: gone" in message


def _uneven(rank, world_size):
    torch.manual_seed(0)
    model = phalanx.DistributedDataParallel(torch.nn.Linear(4, 2))
    out = {}
    try:
        for _ in range(3 + 2 * rank):  # rank 0 runs out of batches first
            model(torch.randn(8, 4)).sum().backward()  # ddp step
        phalanx.all_reduce(torch.ones(1))  # evaluation
    except phalanx.CollectiveMismatchError as e:
        out["error"] = str(e)
    # named before Gloo saw a bucket of the wrong size: the ranks can still talk
    out["after"] = phalanx.all_reduce(torch.ones(1)) or True
    return out


def test_a_rank_that_runs_out_of_batches_is_named_on_every_rank():
    for out in run_ranks(_uneven, 2):
        assert out["error"] == (
            "The ranks are at different collectives: rank 0 is at all_reduce float32[1] "
            f"({_line('evaluation')}); rank 1 is at DistributedDataParallel forward "
            f"({_line('ddp step')}). A rank that runs out of batches before the others stops "
            "joining DDP's steps: give every rank as many batches (DistributedSampler(drop_last="
            "True)) or wrap the loop in `with model.join():` (or phalanx.join; torch's "
            "torch.distributed.algorithms.Join)")
        assert out["after"]


def _diagnostics_lines() -> list[str]:
    """The messages phalanx's diagnostics log in this rank from now on."""
    import logging

    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logging.getLogger("phalanx.diagnostics").addHandler(Keep())
    return seen


def _straggling(rank, world_size, slow_rank):
    seen = _diagnostics_lines()
    phalanx.init_process_group(backend="gloo", straggler_every=10)
    try:
        torch.manual_seed(0)
        model = phalanx.DistributedDataParallel(torch.nn.Linear(16, 16))
        for _ in range(31):
            if rank == slow_rank:
                time.sleep(0.5)  # slow data loading on one rank
            model(torch.randn(32, 16)).sum().backward()
        return seen, phalanx.straggler_report()
    finally:
        phalanx.destroy_process_group()


@pytest.mark.parametrize("slow_rank", [pytest.param(1, marks=pytest.mark.slow), None])  # 1: 31 steps of 0.5 s
def test_a_slow_rank_is_named_although_every_step_takes_as_long(slow_rank):
    results = run_ranks(_straggling, 3 if slow_rank is None else 2, slow_rank, init=False)
    (lines, report), others = results[0], results[1:]
    assert report["steps"] == 30 and sorted(report["ranks"]) == list(range(len(results)))
    if slow_rank is None:
        assert report["slow"] == [] and lines == []
        return
    assert report["slow"] == [1]
    between = report["ranks"][1]["between"]
    assert 0.5 <= between < 0.7 and report["ranks"][0]["wait"] > 0.3, report
    assert len(lines) == 3  # one line per report: after 10, 20 and 30 steps
    assert lines[-1].startswith("straggler: rank 1 is ") and "slower than the median of the " \
        "other ranks, in time between steps (data, optimizer, logging): 0.5" in lines[-1]
    assert all(seen == [] for seen, _ in others)  # rank 0 logs; the others keep quiet


def _rank_zero_only(rank, world_size):
    torch.manual_seed(0)
    model = phalanx.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)))
    model(torch.randn(8, 4)).sum().backward()
    out = {}
    # 1. a barrier on rank 0 alone while the others train on
    try:
        if rank == 0:
            phalanx.barrier()  # lonely barrier
        else:
            model(torch.randn(8, 4)).sum().backward()  # training on
    except phalanx.CollectiveMismatchError as e:
        out["barrier"] = str(e)
    # 2. an evaluation through the DDP model on rank 0 alone, then a barrier everywhere
    try:
        if rank == 0:
            with torch.no_grad():
                model.eval()
                model(torch.randn(8, 4))  # evaluation through ddp
                model.train()
        phalanx.barrier()  # everyone's barrier
    except phalanx.CollectiveMismatchError as e:
        out["evaluation"] = str(e)
    return out


def test_the_hint_fits_a_lonely_barrier_and_a_lonely_evaluation():
    for out in run_ranks(_rank_zero_only, 2):
        assert out["barrier"].endswith(
            "A barrier waits for every rank of the group: one that some ranks skip (inside "
            "`if rank == 0:`) waits for ranks that never come; call it on every rank"), out["barrier"]
        assert f"rank 0 is at barrier ({_line('lonely barrier')})" in out["barrier"]
        assert out["evaluation"].endswith(
            "A forward through the DDP model broadcasts rank 0's buffers (BatchNorm statistics), a "
            "collective: to evaluate on some ranks only, call `model.module`, or evaluate on every "
            "rank"), out["evaluation"]
        assert (f"rank 0 is at DistributedDataParallel forward without gradients "
                f"({_line('evaluation through ddp')})") in out["evaluation"]


def _gross_straggler(rank, world_size):
    seen = _diagnostics_lines()
    model = phalanx.DistributedDataParallel(torch.nn.Linear(16, 16))
    for _ in range(6):
        if rank == 1:
            time.sleep(0.3)  # a rank far slower than the other
        model(torch.randn(32, 16)).sum().backward()
    return seen


def test_a_gross_straggler_is_named_after_a_handful_of_steps():
    lines, quiet = run_ranks(_gross_straggler, 2)  # the default window: 200 steps
    assert len(lines) == 1 and lines[0].startswith("straggler: rank 1 is "), lines
    assert "in time between steps (data, optimizer, logging): 0.3" in lines[0], lines
    assert quiet == []



def _short_run(rank, world_size, steps, slow_rank):
    """A DDP run of ``steps`` steps, ``slow_rank`` sleeping 0.4 s before each: what this rank
    logged, and how long its destroy_process_group took."""
    seen = _diagnostics_lines()
    phalanx.init_process_group(backend="gloo")  # the default window: 200 steps
    model = phalanx.DistributedDataParallel(torch.nn.Linear(16, 16))
    for _ in range(steps):
        if rank == slow_rank:
            time.sleep(0.4)  # a rank far slower than the others
        model(torch.randn(32, 16)).sum().backward()
    began = time.monotonic()
    phalanx.destroy_process_group()
    return seen, time.monotonic() - began


@pytest.fixture(scope="module")
def short_runs():
    """Every rank's (lines, destroy seconds): rank 1 of 2 slow over 3 steps (shorter than the
    first look) and over 8 (a first look after 5, then 3 steps); 3 even ranks over 8 steps."""
    return {"slow3": run_ranks(_short_run, 2, 3, 1, init=False),
            "slow8": run_ranks(_short_run, 2, 8, 1, init=False),
            "even8": run_ranks(_short_run, 3, 8, None, init=False)}


def test_a_gross_straggler_of_a_short_run_is_named_once_at_destroy(short_runs):
    end = "straggler, at the end (3 steps since the last report): rank 1 is "
    (three, _), quiet = short_runs["slow3"]
    assert len(three) == 1 and three[0].startswith(end), three
    assert "in time between steps (data, optimizer, logging): 0.4" in three[0], three
    assert quiet[0] == []  # rank 0 logs; the others keep quiet
    # 8 steps: the first look after 5 names it, the look at the end the 3 steps after
    (eight, _), quiet = short_runs["slow8"]
    assert len(eight) == 2 and eight[0].startswith("straggler: rank 1 is "), eight
    assert eight[1].startswith(end), eight
    assert quiet[0] == []
    assert [lines for lines, _ in short_runs["even8"]] == [[], [], []]


def test_the_look_at_the_end_is_quick_when_every_rank_comes(short_runs):
    # the ranks leave together: rank 0 does not wait the END_WAIT_S it gives a missing one
    seconds = [s for results in short_runs.values() for _, s in results]
    assert max(seconds) < END_WAIT_S, seconds
