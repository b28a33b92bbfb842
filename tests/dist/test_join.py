"""Uneven inputs with phalanx.join: ranks that run out of batches shadow the others' steps,
on real ranks, against torch's join and against one process on the data actually consumed."""

from __future__ import annotations

import copy
import os
import signal

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import phalanx
from tests.harness import error_of, run_ranks
from tests.oracle import oracle_bound, triangle_bound

COUNTS = (5, 8, 11)  # batches of rank 0, 1, 2


def _batches(rank: int, n: int, features: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(4, features, generator=g), torch.randn(4, 2, generator=g)) for _ in range(n)]


def _train(model, optimizer, data):
    for x, y in data:
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _one_process(net, world, divide):
    """SGD on one process: step t's gradient is the sum over the ranks with a batch t of
    their losses' gradients, divided by ``world`` (``divide``) or by their number."""
    single = copy.deepcopy(net)
    opt = torch.optim.SGD(single.parameters(), lr=0.1, momentum=0.9)
    batches = [_batches(r, COUNTS[r]) for r in range(world)]
    for step in range(max(COUNTS[:world])):
        opt.zero_grad()
        active = [r for r in range(world) if step < COUNTS[r]]
        loss = sum(F.mse_loss(single(batches[r][step][0]), batches[r][step][1]) for r in active)
        (loss / (world if divide else len(active))).backward()
        opt.step()
    return _params(single)


def _distance(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _against_torch(rank, world_size):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    data = _batches(rank, COUNTS[rank])
    out = {}
    for divide in (True, False):
        theirs, ours = TorchDDP(copy.deepcopy(net)), phalanx.DistributedDataParallel(copy.deepcopy(net))
        with theirs.join(divide_by_initial_world_size=divide):
            _train(theirs, torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9), data)
        with ours.join(divide_by_initial_world_size=divide):
            _train(ours, torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9), data)
        single = _one_process(net, world_size, divide)
        out[divide] = {"vs_torch": _distance(_params(ours), _params(theirs)),
                       "vs_single": _distance(_params(ours), single),
                       "torch_vs_single": _distance(_params(theirs), single),
                       "magnitude": max(p.abs().max().item() for p in single)}
        out[f"moved {divide}"] = max((a - b).abs().max().item() for a, b in zip(_params(ours), net.parameters()))
    # after the join, the ranks are in step again: even training goes on
    _train(ours, torch.optim.SGD(ours.parameters(), lr=0.1), _batches(9, 2))
    out["after"] = [p.tolist() for p in _params(ours)]
    return out


def test_uneven_batches_train_equal_to_torchs_join_in_both_divide_modes():
    results = run_ranks(_against_torch, 3)
    for out in results:
        for divide in (True, False):  # as close to one process as torch's join, in this run
            res = out[divide]
            assert res["vs_single"] <= oracle_bound(res["torch_vs_single"], res["magnitude"]), (divide, res)
            assert res["vs_torch"] <= triangle_bound(res["vs_single"], res["torch_vs_single"],
                                                     res["magnitude"]), (divide, res)
        assert out["moved True"] > 1e-2 and out["moved False"] > 1e-2  # it did train
    assert results[0]["after"] == results[2]["after"]


def _reference_step(model, optimizer, step, world, divide, dtype=torch.float32):
    """One process: the batches of the ranks still active at ``step``, concatenated."""
    active = [r for r in range(world) if COUNTS[r] > step]
    parts = [[t.to(dtype) for t in _batches(r, COUNTS[r], 3)[step]] for r in active]
    x = torch.cat([p[0].view(4, 3, 1, 1).expand(4, 3, 2, 2) for p in parts])
    out = model(x).flatten(1)
    optimizer.zero_grad()
    loss = sum(F.mse_loss(out[4 * i:4 * i + 4], p[1]) for i, p in enumerate(parts))
    (loss / (world if divide else len(active))).backward()
    optimizer.step()


def _bn_net():
    torch.manual_seed(0)
    # no bias before the BatchNorm: its gradient is rounding noise, which Adam would amplify
    return nn.Sequential(nn.Conv2d(3, 4, 1, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 2))


def _sync_bn_and_zero(rank, world_size):
    out = {}
    for divide in (True, False):
        for kind in ("sync_bn", "zero"):
            net = _bn_net()
            reference = copy.deepcopy(net)
            net = phalanx.SyncBatchNorm.convert_sync_batchnorm(net)  # the reference: one BatchNorm
            ddp = phalanx.DistributedDataParallel(net)
            make = (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)) if kind == "sync_bn" else \
                (lambda p: torch.optim.Adam(p, lr=0.01))
            opt = make(ddp.parameters()) if kind == "sync_bn" else \
                phalanx.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=0.01)
            data = [(x.view(4, 3, 1, 1).expand(4, 3, 2, 2), y) for x, y in _batches(rank, COUNTS[rank], 3)]
            with phalanx.join(ddp, opt, divide_by_initial_world_size=divide):
                for x, y in data:
                    opt.zero_grad()
                    F.mse_loss(ddp(x).flatten(1), y).backward()
                    opt.step()
            truth = copy.deepcopy(reference).double()  # the one process in float64
            for model, dtype in ((reference, torch.float32), (truth, torch.float64)):
                ref_opt = make(model.parameters())
                for step in range(max(COUNTS[:world_size])):
                    _reference_step(model, ref_opt, step, world_size, divide, dtype)
            exact = [t.double() for t in truth.state_dict().values()]
            out[kind, divide] = {
                "ours": _distance([t.double() for t in net.state_dict().values()], exact),
                "torch": _distance([t.double() for t in reference.state_dict().values()], exact),
                "magnitude": max(t.abs().max().item() for t in truth.state_dict().values()
                                 if t.is_floating_point())}  # (not the batch count)
    return out


def test_sync_batchnorm_and_zero_under_join_equal_one_process_on_the_data_consumed():
    """As close to the float64 truth as torch's float32 one process (tests.oracle); phalanx's
    path rounds in more stages (each rank's statistics and gradients, their all-reduces):
    twice the multiple, as in test_sync_batchnorm."""
    for out in run_ranks(_sync_bn_and_zero, 3, timeout=180):
        for key, res in out.items():
            assert res["ours"] <= oracle_bound(res["torch"], res["magnitude"], factor=4.0), (key, res)


def _early(rank, world_size):
    torch.manual_seed(0)
    ddp = phalanx.DistributedDataParallel(nn.Linear(6, 2))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)

    def run():
        with ddp.join(throw_on_early_termination=True):
            _train(ddp, opt, [(x, y) for x, y in _batches(rank, 2 + 2 * rank)])

    return error_of(run)


def test_throw_on_early_termination_names_the_rank_on_every_rank():
    for rank, error in enumerate(run_ranks(_early, 3)):
        torch_words = ("Rank 0 exhausted all inputs. " if rank == 0 else
                       "Detected at least one rank that exhausted inputs. Throwing across all ranks. ")
        assert error == ("EarlyTerminationError", torch_words +
                         "Rank 0 ran out of inputs before the others (throw_on_early_termination="
                         "True); ranks 1, 2 still had some. Give every rank as many batches, or "
                         "let the ranks join (the default)")


def _preempted(rank, world_size, directory, signal_at):
    torch.manual_seed(0)
    ddp = phalanx.DistributedDataParallel(nn.Linear(6, 2))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    ckpt = phalanx.Checkpointer(directory, ddp, opt)
    state = ckpt.load()
    start = 0 if state is None else state.step
    data = _batches(rank, (3, 8)[rank])
    with phalanx.PreemptionHandler() as preemption, phalanx.join(ddp, opt_dummy := ckpt, preemption):
        for step in range(start, len(data)):
            x, y = data[step]
            opt.zero_grad()
            F.mse_loss(ddp(x), y).backward()
            opt.step()
            if step + 1 == signal_at:
                os.kill(os.getpid(), signal.SIGTERM)  # the scheduler preempts rank 1
            if preemption.should_stop():
                ckpt.save(0, step + 1)
                preemption.exit()
    del opt_dummy
    return [p.tolist() for p in _params(ddp)]


def test_a_preemption_after_a_rank_joined_saves_once_exits_75_and_resumes_exactly(tmp_path):
    whole = run_ranks(_preempted, 2, str(tmp_path / "whole"), None)
    stopped = run_ranks(_preempted, 2, str(tmp_path / "cut"), 5, return_exceptions=True)
    assert [(e.type, e.message) for e in stopped] == [("SystemExit", "75")] * 2
    assert sorted(os.listdir(tmp_path / "cut")) == ["ckpt-000000000005.ckpt"]
    resumed = run_ranks(_preempted, 2, str(tmp_path / "cut"), None)
    assert resumed == whole
