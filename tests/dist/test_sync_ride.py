"""The forward's sync point riding the bucket's all-reduce (issue 34 item 4): a DDP step whose
gradients fit one small bucket issues one collective, as torch's DDP does, and trains as
torch's does; a model the bucket cannot carry the check for sends it alone; ranks that went
different ways (a lonely barrier, another model, a collective inside the forward) meet in
envelopes of one size and are named on every rank, which then go on in step; a rank that
left is named by the hang report while the others wait in the bucket that carries the check."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
from torch import nn

import phalanx
from phalanx.diagnostics import ledger
from phalanx.ledger import syncpoint
from tests.dist.test_comm_hooks import _all_reduces
from tests.harness import error_of, marked_line, run_ranks
from tests.oracle import magnitude, oracle_bound

ENVELOPE = ("float32", syncpoint.envelope_size(3))  # the same at world 2 and 3


def _line(marker: str) -> str:
    return marked_line(__file__, marker)


def _step(model, rank, step, width=20):
    torch.manual_seed(100 * step + rank)
    model(torch.randn(4, width)).square().mean().backward()  # a step


def _train(model, rank, steps=3, width=20):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        optimizer.zero_grad()
        _step(model, rank, step, width)
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _single(steps, world, width=20):
    """One process on every rank's batch (the mean of the ranks' losses)."""
    torch.manual_seed(0)
    model = nn.Linear(width, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        optimizer.zero_grad()
        losses = []
        for rank in range(world):
            torch.manual_seed(100 * step + rank)
            losses.append(model(torch.randn(4, width)).square().mean())
        (sum(losses) / world).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _collectives(rank, world_size):
    out = {}
    # 1. the tutorial's model: one collective a step, carrying the check; trains as torch's
    torch.manual_seed(0)
    ours = phalanx.DistributedDataParallel(nn.Linear(20, 1))
    torch.manual_seed(0)
    theirs = torch.nn.parallel.DistributedDataParallel(nn.Linear(20, 1))
    out["ride"] = _all_reduces(lambda: _step(ours, rank, 0))
    log = ledger().log(None)
    out["ride log"] = [r.op for r in list(log.records)[-2:]]
    ours_params, theirs_params = _train(ours, rank), _train(theirs, rank)
    single = _single(3, world_size)
    out["ours vs torch"] = all(torch.equal(a, b) for a, b in zip(ours_params, theirs_params))
    out["ours vs single"] = max((a - b).abs().max().item() for a, b in zip(ours_params, single))
    out["torch vs single"] = max((a - b).abs().max().item() for a, b in zip(theirs_params, single))
    out["magnitude"] = magnitude(single)
    # 2. models whose bucket cannot carry the check: it goes alone, first
    alone = {
        "buffers": nn.Sequential(nn.Linear(20, 4), nn.BatchNorm1d(4)),
        "too large": nn.Linear(20, 64),  # 1344 gradients: more than the envelope's room
    }
    for name, module in alone.items():
        out[name] = _all_reduces(lambda: _step(phalanx.DistributedDataParallel(module), rank, 0))
    buckets = phalanx.DistributedDataParallel(nn.Sequential(nn.Linear(20, 4), nn.Linear(4, 1)),
                                              bucket_cap_mb=1e-5)  # 10 bytes: three buckets
    out["several buckets"] = _all_reduces(lambda: _step(buckets, rank, 0))
    hooked = phalanx.DistributedDataParallel(nn.Linear(20, 1))
    hooked.register_comm_hook(None, phalanx.comm_hooks.bf16_compress_hook)
    out["comm hook"] = _all_reduces(lambda: _step(hooked, rank, 0))
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def collectives(request):
    return request.param, run_ranks(_collectives, request.param)


def test_a_step_with_one_small_bucket_issues_one_collective_carrying_the_check(collectives):
    _, results = collectives
    for out in results:
        assert out["ride"] == [ENVELOPE], out["ride"]
        # the log as before: the check, then the bucket (what the hang report numbers)
        assert out["ride log"] == ["check before DistributedDataParallel forward", "DDP bucket 0"]


def test_riding_trains_as_torchs_ddp(collectives):
    world, results = collectives
    for out in results:
        if world == 2:  # a sum of two terms is the same in any order: torch's, bit for bit
            assert out["ours vs torch"], out
        # Gloo sums an envelope in another order than the bucket alone: as close to one
        # process as torch's DDP
        assert out["ours vs single"] <= oracle_bound(out["torch vs single"], out["magnitude"]), out


def test_a_bucket_that_cannot_carry_the_check_leaves_it_alone_first(collectives):
    _, results = collectives
    for out in results:
        assert out["buffers"][0] == ENVELOPE and len(out["buffers"]) == 2, out["buffers"]  # + bucket
        assert out["too large"] == [ENVELOPE, ("float32", 1344 + 1)], out["too large"]
        assert out["several buckets"][0] == ENVELOPE and len(out["several buckets"]) == 4, out
        assert out["comm hook"][0] == ENVELOPE and len(out["comm hook"]) > 1, out["comm hook"]


def _in_step(rank):
    ok = torch.tensor([float(rank)])
    phalanx.all_reduce(ok)
    return ok.item()


def _mismatches(rank, world_size):
    out = {}
    torch.manual_seed(0)
    model = phalanx.DistributedDataParallel(nn.Linear(20, 1))
    other = phalanx.DistributedDataParallel(nn.Linear(20, 3))
    _step(model, rank, 0)
    # 1. a barrier on rank 0 alone while the others step
    try:
        if rank == 0:
            phalanx.barrier()  # lonely barrier
        else:
            _step(model, rank, 1)
    except phalanx.CollectiveMismatchError as e:
        out["barrier"] = str(e)
    out["barrier after"] = _in_step(rank)
    # 2. two models, one line: the check carries each one's bucket
    out["models"] = error_of(lambda: _step(model if rank == 0 else other, rank, 2))
    out["models after"] = _in_step(rank)
    # 3. a collective inside rank 0's step: its check goes alone, the others' rides
    def step_with_a_collective():
        loss = model(torch.randn(4, 20)).sum()  # forward
        if rank == 0:
            phalanx.all_reduce(torch.ones(1))  # inside the step
        loss.backward()

    out["inside"] = error_of(step_with_a_collective)
    out["inside after"] = _in_step(rank)
    # training goes on, every rank in step
    _step(model, rank, 3)
    out["params"] = [p.detach().tolist() for p in model.parameters()]
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def mismatches(request):
    return request.param, run_ranks(_mismatches, request.param)


def _others(world):
    return ("rank 1 is", "ranks 1, 2 are")[world - 2]


def test_a_lonely_barrier_meets_the_riding_step_and_is_named(mismatches):
    world, results = mismatches
    for out in results:
        assert out["barrier"] == (
            f"The ranks are at different collectives: rank 0 is at barrier ({_line('lonely barrier')}); "
            f"{_others(world)} at DistributedDataParallel forward ({_line('a step')}). A barrier "
            "waits for every rank of the group: one that some ranks skip (inside `if rank == 0:`) waits "
            "for ranks that never come; call it on every rank"), out["barrier"]


def test_two_models_at_one_line_are_told_apart_by_their_buckets(mismatches):
    world, results = mismatches
    at = f"DistributedDataParallel forward ({_line('a step')}), then DDP bucket 0 float32"
    for out in results:
        assert out["models"] == ("CollectiveMismatchError", (
            f"The ranks are at different collectives: rank 0 is at {at}[22]; {_others(world)} at "
            f"{at}[64]. " + syncpoint.OUT_OF_BATCHES)), out["models"]


def test_a_collective_inside_the_step_is_named_against_the_riding_ranks(mismatches):
    world, results = mismatches
    at = f"DistributedDataParallel forward ({_line('forward')}), then"
    for out in results:
        assert out["inside"] == ("CollectiveMismatchError", (
            f"The ranks are at different collectives: rank 0 is at {at} all_reduce float32[1]; "
            f"{_others(world)} at {at} DDP bucket 0 float32[22]. " + syncpoint.OUT_OF_BATCHES)), out["inside"]


def test_after_each_mismatch_the_ranks_are_in_step_and_train_on(mismatches):
    world, results = mismatches
    for out in results:
        for key in ("barrier after", "models after", "inside after"):
            assert out[key] == sum(range(world)), (key, out)
    for out in results[1:]:
        assert out["params"] == results[0]["params"]


def _leaves(rank, world_size):
    phalanx.init_process_group(backend="gloo", timeout=timedelta(seconds=10))
    torch.manual_seed(0)
    model = phalanx.DistributedDataParallel(nn.Linear(20, 1))
    _step(model, rank, 0)
    if rank == world_size - 1:
        os._exit(0)  # leaves mid-training, exit status 0
    start = time.monotonic()
    try:
        _step(model, rank, 1)
    except phalanx.RankExitedError as e:
        return str(e), e.culprits, time.monotonic() - start
    finally:
        phalanx.destroy_process_group()


def test_a_rank_that_leaves_is_named_while_the_others_wait_in_the_riding_bucket():
    results = run_ranks(_leaves, 3, init=False, timeout=60, return_exceptions=True)
    for rank in (0, 1):
        message, culprits, took = results[rank]
        assert culprits == [2] and took < 10, (took, message)
        assert "Rank 2 did not answer: gone" in message, message
        assert f"DDP bucket 0 float32[22] ({_line('a step')})" in message, message
