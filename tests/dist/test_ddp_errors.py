"""DDP errors: named, raised on every rank, and never a hang (run_ranks would report a hung rank);
after a backward that failed midway, the next one waits for its collectives and is exact."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import phalanx
from phalanx.ddp.reference import NaiveDDP
from tests.harness import error_of, run_ranks
from tests.oracle import reorder_bound

WORLD = 3


class Branchy(nn.Module):
    def __init__(self, branch_in: int = 16):
        super().__init__()
        self.trunk, self.branch, self.head = nn.Linear(6, 16), nn.Linear(branch_in, 16), nn.Linear(16, 3)

    def forward(self, x, use_branch=True):
        h = torch.tanh(self.trunk(x))
        if use_branch:
            h = h + self.branch(h)
        return self.head(h)


class InputSide(nn.Module):
    """An optional layer on the input side: its gradient comes after every other gradient."""

    def __init__(self):
        super().__init__()
        self.pre, self.trunk, self.head = nn.Linear(6, 6), nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x, use_pre=False):
        if use_pre:
            x = x + self.pre(x)
        return self.head(torch.tanh(self.trunk(x)))


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward failed on purpose")


class Midway(Branchy):
    """Its backward can fail after the head's and the branch's gradients, before the trunk's."""

    def forward(self, x, fail=False):
        h = torch.tanh(self.trunk(x))
        if fail:
            h = _FailingBackward.apply(h)
        return self.head(h + self.branch(h))


class _Watched:
    """A collective's Work that records whether anyone waited for it."""

    def __init__(self, work):
        self.work, self.waited = work, False

    def wait(self):
        self.waited = True
        return self.work.wait()


def _step(ddp, use_branch=True):
    ddp(torch.randn(4, 6), use_branch=use_branch).sum().backward()


def _construction_errors(rank, world_size):
    DDP = phalanx.DistributedDataParallel
    out = {}
    out["shape"] = error_of(DDP, Branchy(branch_in=16 if rank != 2 else 17))
    extra = Branchy()
    if rank == 1:
        extra.extra = nn.Linear(2, 2)
    out["count"] = error_of(DDP, extra)
    frozen = Branchy()
    frozen.head.bias.requires_grad_(rank != 1)
    out["frozen"] = error_of(DDP, frozen)
    out["settings"] = error_of(DDP, Branchy(), bucket_cap_mb=25 if rank == 0 else 5)
    out["refused_on_one_rank"] = error_of(DDP, Branchy(), bucket_cap_mb=-1 if rank == 2 else 25)
    bad = {
        "not_module": dict(module=lambda x: x),
        "cap_type": dict(bucket_cap_mb="25"),
        "cap_zero": dict(bucket_cap_mb=0),
        "flag_type": dict(find_unused_parameters="yes"),
        "cpu_device_ids": dict(device_ids=[0]),
        "two_device_ids": dict(device_ids=[0, 1]),
        "output_device_alone": dict(output_device=0),
        "group_type": dict(process_group="world"),
    }
    for name, kwargs in bad.items():
        out[name] = error_of(DDP, **{"module": Branchy(), **kwargs})
    all_frozen = Branchy().requires_grad_(False)
    out["all_frozen"] = error_of(DDP, all_frozen)
    out["empty_device_ids_ok"] = error_of(DDP, Branchy(), device_ids=[])
    return out


@pytest.fixture(scope="module")
def construction_errors():
    """Every rank's results of one group of WORLD ranks running _construction_errors."""
    return run_ranks(_construction_errors, WORLD, timeout=90)


def test_a_parameter_whose_shape_differs_across_ranks_is_named(construction_errors):
    for out in construction_errors:
        assert out["shape"] == ("RankMismatchError", (
            "DistributedDataParallel parameters, buffers and settings differ across ranks: ranks 2 "
            "disagree with rank 0 (8 vs 8 entries on rank 0 and rank 2). First difference at position 4: "
            "rank 0 has 'branch.weight' shape (16, 16) torch.float32, rank 2 has 'branch.weight' shape "
            "(16, 17) torch.float32"))


def test_a_parameter_on_one_rank_only_is_named(construction_errors):
    for out in construction_errors:
        kind, message = out["count"]
        assert kind == "RankMismatchError"
        assert "ranks 1 disagree with rank 0 (8 vs 10 entries" in message
        assert "rank 0 has nothing, rank 1 has 'extra.weight' shape (2, 2) torch.float32" in message


def test_a_parameter_frozen_on_one_rank_only_is_named(construction_errors):
    for out in construction_errors:
        kind, message = out["frozen"]
        assert "rank 0 has 'head.bias' shape (3,) torch.float32, rank 1 has 'head.bias' shape (3,) torch.float32 frozen" in message


def test_settings_that_differ_across_ranks_are_named(construction_errors):
    for out in construction_errors:
        kind, message = out["settings"]
        assert kind == "RankMismatchError" and "ranks 1, 2 disagree with rank 0" in message
        assert "rank 0 has 'settings' bucket_cap_mb=25, broadcast_buffers=True" in message
        assert "rank 1 has 'settings' bucket_cap_mb=5," in message


def test_arguments_refused_on_one_rank_fail_every_rank(construction_errors):
    for out in construction_errors:
        kind, message = out["refused_on_one_rank"]
        assert kind == "RankMismatchError" and "ranks 2 disagree with rank 0" in message
        assert ("rank 0 has 'arguments' accepted, rank 2 has 'arguments' refused: bucket_cap_mb must be "
                "positive (MiB per bucket), got -1") in message


def test_bad_arguments_are_named(construction_errors):
    for out in construction_errors:
        assert out["not_module"] == ("TypeError", "module must be a torch.nn.Module, got function")
        assert out["cap_type"] == ("TypeError", "bucket_cap_mb must be a number of MiB or None, got str")
        assert out["cap_zero"] == ("ValueError", "bucket_cap_mb must be positive (MiB per bucket), got 0")
        assert out["flag_type"] == ("TypeError", "find_unused_parameters must be True or False, got 'yes'")
        assert out["group_type"] == (
            "TypeError", "process_group must be a torch.distributed ProcessGroup or None, got str")


def test_device_ids_that_do_not_fit_the_module_are_named(construction_errors):
    for out in construction_errors:
        assert out["cpu_device_ids"] == ("ValueError", (
            "device_ids=[0] is for a module on cuda:0, but the module's tensors are on cpu. For a CPU "
            "module (or one spread over devices) leave device_ids=None; otherwise move the module there "
            "first (module.to('cuda:0'))"))
        assert out["two_device_ids"] == (
            "ValueError", "device_ids must name exactly one device (this process's), got [0, 1]")
        assert out["output_device_alone"] == ("ValueError", "output_device=0 needs device_ids; got device_ids=None")
        assert out["empty_device_ids_ok"] is None


def test_a_module_with_nothing_to_train_is_refused(construction_errors):
    for out in construction_errors:
        assert out["all_frozen"][0] == "UsageError" and "at least one parameter that requires a gradient" in out["all_frozen"][1]


def _backward_errors(rank, world_size):
    out = {}
    torch.manual_seed(rank)
    ddp = phalanx.DistributedDataParallel(Branchy())
    out["everywhere"] = error_of(_step, ddp, use_branch=False)
    # The reducer is usable again afterwards, and averages correctly.
    torch.manual_seed(100 + rank)
    _step(ddp)
    grads = [p.grad.clone() for p in ddp.parameters()]
    gathered = [torch.zeros_like(grads[0]) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, grads[0])
    out["same_after"] = max((g - gathered[0]).abs().max().item() for g in gathered)
    out["one_rank"] = error_of(_step, ddp, use_branch=rank != 2)
    static = phalanx.DistributedDataParallel(Branchy(), static_graph=True)
    _step(static, use_branch=False)  # learned: the branch is unused
    _step(static, use_branch=False)
    out["static_changed"] = error_of(_step, static, use_branch=True)
    # rank 2 only: a gradient later than every other one (the last bucket was complete)
    late = phalanx.DistributedDataParallel(InputSide(), static_graph=True)
    late(torch.randn(4, 6)).sum().backward()  # learned: 'pre' is unused
    out["late_on_one_rank"] = error_of(lambda: late(torch.randn(4, 6), use_pre=rank == 2).sum().backward())
    out["failed_backward"] = _failed_backward(rank)
    return out


def _failed_backward(rank):
    """A backward that raises midway, with buckets in flight; the next iteration is exact."""
    torch.manual_seed(rank)
    ddp = phalanx.DistributedDataParallel(Midway(), bucket_cap_mb=1e-5)  # a bucket per tensor
    torch.manual_seed(rank)
    naive = NaiveDDP(Midway())
    strategy, launched = ddp._runtime.reducer.bucket_comm, []
    real_launch = strategy.launch

    def watched_launch(b, flat):
        launched.append(_Watched(real_launch(b, flat)))
        return launched[-1]

    strategy.launch = watched_launch
    x = torch.randn(4, 6) * (rank + 1)
    out = {"error": error_of(lambda: ddp(x, fail=True).sum().backward()), "launched": len(launched)}
    out["waited_by_backward"] = sum(w.waited for w in launched)
    ddp.zero_grad()
    loss = ddp(x).sum()  # its prepare() must wait for the failed backward's all-reduces
    out["waited_by_forward"] = sum(w.waited for w in launched[: out["launched"]])
    loss.backward()
    naive(x).sum().backward()
    largest = torch.stack([q.grad.abs().max() for q in naive.parameters()]).max()  # this rank's own
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    naive.sync_gradients()
    out["diff"] = max((p.grad - q.grad).abs().max().item() for p, q in zip(ddp.parameters(), naive.parameters()))
    out["bound"] = reorder_bound(largest.item(), dist.get_world_size())  # another order of the same sum
    return out


@pytest.fixture(scope="module")
def backward_errors():
    return run_ranks(_backward_errors, WORLD, timeout=90)


def test_a_failed_backward_is_waited_for_and_the_next_one_is_exact(backward_errors):
    for out in backward_errors:
        failed = out["failed_backward"]
        assert failed["error"] == ("RuntimeError", "backward failed on purpose")
        # head and branch: 4 one-tensor buckets in flight when the trunk's backward failed
        assert (failed["launched"], failed["waited_by_backward"]) == (4, 0)
        assert failed["waited_by_forward"] == 4
        assert failed["diff"] <= failed["bound"], failed


def test_unused_parameter_errors_name_them_on_every_rank(backward_errors):
    for out in backward_errors:
        assert out["everywhere"] == ("UnusedParametersError", (
            "Parameters received no gradient in this backward pass while find_unused_parameters=False "
            "(rank 0: 'branch.bias', 'branch.weight'; rank 1: 'branch.bias', 'branch.weight'; rank 2: "
            "'branch.bias', 'branch.weight'). Pass find_unused_parameters=True to DistributedDataParallel, "
            "or make every parameter take part in the loss (or freeze it with requires_grad=False)"))
        assert out["same_after"] == 0.0
        kind, message = out["one_rank"]
        assert kind == "UnusedParametersError"
        assert "(rank 2: 'branch.bias', 'branch.weight')." in message
        kind, message = out["static_changed"]
        assert kind == "UnusedParametersError"
        assert "rank 0: 'branch.bias', 'branch.weight'" in message
        assert "static_graph=True assumed them unused, as in the first iteration, but the graph changed" in message
        # every rank raises, though only rank 2's gradient came late, after all the others
        assert out["late_on_one_rank"] == ("UnusedParametersError", (
            "Gradients arrived for parameters after their bucket was settled (rank 2: 'pre.bias', "
            "'pre.weight'): static_graph=True assumed them unused, as in the first iteration, but "
            "the graph changed"))
