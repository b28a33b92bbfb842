"""The ledger on real ranks: every collective phalanx issues goes through it, on a group that
phalanx or torch made; a sync point never outwaits a collective's own timeout."""

from __future__ import annotations

import functools
import tempfile
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

import phalanx
from tests.harness import error_of, run_ranks

# Every collective torch.distributed offers a script (point-to-point ones too).
TORCH_COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather",
    "all_gather_into_tensor", "all_gather_coalesced", "all_gather_object", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "gather_object",
    "scatter", "scatter_object_list", "broadcast_object_list", "barrier", "monitored_barrier",
    "send", "recv", "isend", "irecv", "batch_isend_irecv",
)


def _spy_on_torch(seen: list, outside: list) -> None:
    """Wrap torch.distributed's collectives: each one a caller issues (not those torch's own
    ones call inside) notes the ledger record in flight, or where it came from if none."""
    from phalanx.diagnostics import ledger

    depth = [0]

    def wrap(name, fn):
        @functools.wraps(fn)
        def spied(*args, **kwargs):
            if depth[0] == 0:
                book = ledger()
                flying = [r for log in book.logs.values() for r in log.records if r.end is None]
                if flying:
                    seen.append(max(flying, key=lambda r: r.start).op)  # the newest
                else:
                    stack = traceback.extract_stack(limit=6)[:-1]
                    outside.append(f"{name} from " + " <- ".join(
                        f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in reversed(stack)))
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return spied

    for name in TORCH_COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name)))


def _representative_step(rank, world_size, directory):
    seen, outside = [], []
    _spy_on_torch(seen, outside)
    torch.manual_seed(0)
    model = phalanx.SyncBatchNorm.convert_sync_batchnorm(
        nn.Sequential(nn.Linear(8, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64),
                      nn.ReLU(), nn.Linear(64, 2)))
    ddp = phalanx.DistributedDataParallel(model, bucket_cap_mb=0.01)  # several buckets
    opt = phalanx.ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    saver = phalanx.Checkpointer(directory, ddp, opt)
    with phalanx.PreemptionHandler() as stopper:
        _steps(rank, ddp, opt, saver, stopper)
    return sorted(set(seen)), outside


def _steps(rank, ddp, opt, saver, stopper):
    for step in range(2):
        x = torch.randn(16, 8) + rank
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
        total = torch.tensor([float(step)])
        phalanx.all_reduce(total)
        if stopper.should_stop():
            break
        saver.save(epoch=0, step=step)


def test_every_collective_of_a_training_step_goes_through_the_ledger():
    with tempfile.TemporaryDirectory() as directory:
        results = run_ranks(_representative_step, 2, directory)
    for seen, outside in results:
        assert outside == [], "collectives issued outside the ledger:\n" + "\n".join(outside)
        for op in ("DDP bucket 0", "DDP bucket 1", "DDP buffer broadcast", "SyncBatchNorm forward",
                   "SyncBatchNorm backward", "ZeroRedundancyOptimizer.step", "Checkpointer.save",
                   "check before PreemptionHandler.should_stop", "all_reduce",
                   "check before DistributedDataParallel forward"):
            assert op in seen, (op, seen)


def _torch_group(rank, world_size, timeout_s=60.0):
    """The smallest migration: torch's own init_process_group (env://), phalanx's DDP."""
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def _batches(rank, n):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)) for _ in range(n)]


def _train(model, data):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _on_a_torch_made_group(rank, world_size):
    import copy

    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    _torch_group(rank, world_size)
    try:
        out = {}
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
        data = _batches(rank, 3 if rank == 0 else 6)
        theirs, ours = TorchDDP(copy.deepcopy(net)), phalanx.DistributedDataParallel(copy.deepcopy(net))
        with theirs.join():
            expected = _train(theirs, data)
        with ours.join():
            got = _train(ours, data)
        out["join"] = max((a - b).abs().max().item() for a, b in zip(got, expected))
        out["moved"] = max((a - b).abs().max().item() for a, b in zip(got, net.parameters()))
        # the classic: rank 0 steps while the others are at a barrier
        if rank == 0:
            out["mismatch"] = error_of(lambda: ours(torch.randn(4, 6)).sum().backward())  # ddp step
        else:
            out["mismatch"] = error_of(lambda: phalanx.barrier())  # barrier
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 3])
def test_diagnostics_and_join_on_a_group_torch_made(world_size):
    results = run_ranks(_on_a_torch_made_group, world_size, init=False)
    for out in results:
        assert out["join"] < 1e-6 and out["moved"] > 1e-2, out
        kind, message = out["mismatch"]
        assert kind == "CollectiveMismatchError", out["mismatch"]
        assert "rank 0 is at DistributedDataParallel forward (test_ledger.py:" in message, message
        assert "at barrier (test_ledger.py:" in message, message


def _hang_on_a_torch_made_group(rank, world_size):
    _torch_group(rank, world_size, timeout_s=5.0)
    ddp = phalanx.DistributedDataParallel(nn.Linear(4, 2))
    start = time.monotonic()
    try:
        if rank == 0:
            ddp(torch.randn(3, 4)).sum().backward()
        else:
            time.sleep(15.0)  # elsewhere, far past the group's 5 s
        return ("no error", "", [], time.monotonic() - start)
    except phalanx.CollectiveTimeoutError as e:
        return (type(e).__name__, str(e), e.culprits, time.monotonic() - start)


@pytest.mark.slow  # waits out the group's timeout
def test_a_hang_is_reported_on_a_group_torch_made_within_its_timeout():
    results = run_ranks(_hang_on_a_torch_made_group, 2, init=False, timeout=90)
    for rank, (kind, message, culprits, took) in enumerate(results):
        assert kind == "CollectiveTimeoutError" and culprits == [1], (rank, kind, message)
        assert took < 14.0, took  # the group's 5 s and the report, not rank 1's 15 s sleep
    assert "rank 1" in results[0][1], results[0][1]


def _monitored_barrier(rank, world_size):
    phalanx.all_reduce(torch.ones(1))  # every rank is up
    if rank != 0:
        time.sleep(4.0)  # never arrives in time (the barrier's 1 s, and 3 s to spare)
        return None
    start = time.monotonic()
    error = error_of(lambda: phalanx.monitored_barrier(timeout=timedelta(seconds=1)))
    return error, time.monotonic() - start


@pytest.mark.slow  # waits out the barrier's timeout
def test_a_sync_point_never_outwaits_a_monitored_barriers_own_timeout():
    results = run_ranks(_monitored_barrier, 3, timeout=60)
    error, took = results[0]
    assert error[0] == "RuntimeError", error
    assert error[1].startswith("[Rank 0]: Rank 1 failed to pass monitoredBarrier in 1000 ms"), error
    assert took < 3.5, took  # the barrier's 1 s, not the sleeping ranks' 4 s


def _join_with_diagnostics_off(rank, world_size):
    phalanx.init_process_group(backend="gloo", diagnostics=False)
    try:
        ddp = phalanx.DistributedDataParallel(nn.Linear(4, 2))
        return error_of(lambda: ddp.join().__enter__())
    finally:
        phalanx.destroy_process_group()


def test_join_says_diagnostics_false_turned_its_ledger_off():
    for error in run_ranks(_join_with_diagnostics_off, 2, init=False):
        assert error == ("UsageError", "Join needs phalanx's ledger of collectives, which "
                         "init_process_group(diagnostics=False) turned off: its sync points "
                         "announce what joined ranks shadow. Leave diagnostics on (the default)")


def _overlapped_meeting_left_under_way(rank, world_size, finish):
    phalanx.init_process_group(backend="gloo")
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    local = phalanx.LocalSGD(model, opt, every=2, overlap=2)
    for _ in range(4):  # a meeting at step 4, to land at step 6
        opt.zero_grad()
        model(torch.randn(3, 4) + rank).sum().backward()
        local.step()
    if finish is True:
        local.finish_meeting()
    weights = [p.tolist() for p in model.parameters()]
    if finish == "failing":  # the script fails with the meeting under way; it leaves in a finally
        try:
            try:
                raise ValueError("the script's own error")
            finally:
                phalanx.destroy_process_group()
        except Exception as e:
            return (type(e).__name__, str(e)), weights, dist.is_initialized()
    return error_of(phalanx.destroy_process_group), weights, dist.is_initialized()


def test_leaving_with_an_overlapped_meeting_under_way_is_refused_on_every_rank():
    for error, _, initialised in run_ranks(_overlapped_meeting_left_under_way, 2, False, init=False):
        assert error is not None and error[0] == "UsageError", error
        assert error[1].startswith("destroy_process_group(): rank "), error
        assert "LocalSGD meeting" in error[1] and "finish_meeting()" in error[1], error
        assert not initialised  # the group is gone all the same
    finished = run_ranks(_overlapped_meeting_left_under_way, 2, True, init=False)
    assert [error for error, _, _ in finished] == [None, None]
    assert finished[0][1] == finished[1][1]  # every rank holds the average


@pytest.mark.slow
def test_leaving_in_a_finally_of_a_failing_script_keeps_its_error():
    """destroy_process_group() in a ``finally`` while the script's own exception propagates:
    that exception comes out, not the UsageError about the collectives it cut short (which
    would become the launcher's root cause), and the group is gone."""
    for error, _, initialised in run_ranks(_overlapped_meeting_left_under_way, 2, "failing", init=False):
        assert error == ("ValueError", "the script's own error"), error
        assert not initialised
