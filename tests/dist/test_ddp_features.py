"""DDP behaviour around the edges: buffers with two forwards, pass-through, state_dict, world size 1."""

from __future__ import annotations

import logging
from collections import namedtuple
from contextlib import nullcontext
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import phalanx
from phalanx.ddp.reference import NaiveDDP
from tests.harness import run_ranks


class Scaled(nn.Module):
    """A buffer used in the computation (saved for backward) and a BatchNorm (saves its stats)."""

    def __init__(self, rank: int):
        super().__init__()
        self.lin = nn.Linear(6, 8, bias=False)
        self.bn = nn.BatchNorm1d(8)
        self.register_buffer("scale", torch.full((8,), 1.0 + rank))

    def forward(self, x):
        return self.bn(self.lin(x)) * self.scale


def _two_forwards(rank, world_size):
    torch.manual_seed(rank)
    model = Scaled(rank)
    ddp = phalanx.DistributedDataParallel(model)
    torch.manual_seed(rank)
    naive = NaiveDDP(Scaled(rank))
    x1, x2 = torch.randn(4, 6), torch.randn(4, 6)
    scale_before = model.scale
    loss = ddp(x1).pow(2).sum() + ddp(x2).pow(2).sum()  # the second forward broadcasts buffers
    loss.backward()  # torch's DDP: "modified by an inplace operation" on ranks other than 0
    (naive(x1).pow(2).sum() + naive(x2).pow(2).sum()).backward()
    naive.sync_gradients()
    diff = max((a.grad - b.grad).abs().max().item() for a, b in zip(ddp.parameters(), naive.parameters()))
    replaced = model.scale is not scale_before
    # A plain step afterwards: buffers are copied in place again.
    scale_now = model.scale
    ddp(x1).sum().backward()
    return {"diff": diff, "replaced": replaced, "in_place_after": model.scale is scale_now,
            "scale": model.scale.tolist(), "later": _later_forwards(rank)}


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def _later_forwards(rank):
    """A synchronising forward, then one inside no_sync() or under no_grad, then ONE backward.

    The later forward must not cancel the averaging: phalanx's gradients equal torch DDP's,
    which averages here, and differ from the local ones. With find_unused_parameters a
    parameter only the no_sync() forward reaches is averaged too (torch raises there).
    """
    x1, x2 = torch.randn(4, 6) * (rank + 1), torch.randn(4, 6)
    out = {}
    for later in ("no_sync", "no_grad"):
        grads = []
        for wrap in (phalanx.DistributedDataParallel, TorchDDP, None):  # None: this rank alone
            model = _mlp() if wrap is None else wrap(_mlp())
            loss = model(x1).pow(2).sum()
            if later == "no_grad":
                context = torch.no_grad()
            else:
                context = nullcontext() if wrap is None else model.no_sync()
            with context:
                extra = model(x2).pow(2).sum()
            (loss + extra if later == "no_sync" else loss).backward()
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        out[later] = ((grads[0] - grads[1]).abs().max().item(), (grads[0] - grads[2]).abs().max().item())
    torch.manual_seed(0)
    ddp = phalanx.DistributedDataParallel(TwoHeads(), find_unused_parameters=True)
    x1, x2 = x1[:, :3], x2[:, :3]
    loss = ddp(x1)[0].sum()  # reaches the trunk and the left head
    with ddp.no_sync():
        loss = loss + ddp(x2)[1].sum()  # and the right head
    loss.backward()
    torch.manual_seed(0)
    naive = NaiveDDP(TwoHeads())
    (naive(x1)[0].sum() + naive(x2)[1].sum()).backward()
    naive.sync_gradients()
    out["walked"] = max((p.grad - q.grad).abs().max().item() for p, q in zip(ddp.parameters(), naive.parameters()))
    return out


@pytest.fixture(scope="module")
def two_forwards():
    """Every rank's results of one group of 2 ranks running _two_forwards (the tests below)."""
    return run_ranks(_two_forwards, 2)


def test_two_forwards_then_backward_with_broadcast_buffers(two_forwards):
    for rank, out in enumerate(two_forwards):
        assert out["diff"] < 1e-6
        assert out["replaced"] == (rank != 0)  # only receivers must not write into saved tensors
        assert out["in_place_after"] is True
        assert out["scale"] == [1.0] * 8


@pytest.mark.parametrize("name", ["no_sync", "no_grad"])
def test_a_later_forward_under_no_sync_or_no_grad_keeps_the_averaging(two_forwards, name):
    for out in two_forwards:
        later = out["later"]
        vs_torch, vs_local = later[name]
        assert vs_torch < 1e-6 and vs_local > 1e-3, (name, later[name])


def test_a_parameter_only_the_no_sync_forward_reaches_is_averaged(two_forwards):
    for out in two_forwards:
        later = out["later"]
        assert later["walked"] < 1e-6


@dataclass
class Pair:
    first: torch.Tensor
    rest: dict


Named = namedtuple("Named", "a b")


class Echo(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.seen = None

    def forward(self, x, *extra, kind="tuple", flag=None):
        self.seen = (len(extra), kind, flag)
        y = self.lin(x)
        if kind == "tuple":
            return y, (y * 2, [y * 3])
        if kind == "dict":
            return {"y": y, "n": 5}
        if kind == "named":
            return Named(y, None)
        return Pair(y, {"z": y.sum(), "label": "text"})


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk, self.left, self.right = nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        return self.left(h), self.right(h)


def _output_left_out_of_the_loss(rank):
    """find_unused_parameters: the walk says 'right' is reachable, but the loss ignores it."""
    torch.manual_seed(rank)
    ddp = phalanx.DistributedDataParallel(TwoHeads(), find_unused_parameters=True)
    torch.manual_seed(rank)
    naive = NaiveDDP(TwoHeads())
    x = torch.randn(5, 3) * (rank + 1)
    ddp(x)[0].sum().backward()
    naive(x)[0].sum().backward()
    naive.sync_gradients()
    pairs = list(zip(ddp.parameters(), naive.parameters()))
    same = all(torch.allclose(a.grad, b.grad, atol=1e-7) for a, b in pairs if b.grad is not None)
    return same, [name for name, p in ddp.module.named_parameters() if p.grad is None]


def _logged_plan():
    """The bucket plan DDP logs at DEBUG (on rank 0 only)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    root = logging.getLogger("phalanx")
    level = root.level
    root.setLevel(logging.DEBUG)
    root.addHandler(handler)
    try:
        phalanx.DistributedDataParallel(Echo(), bucket_cap_mb=1e-5)  # a bucket per tensor
    finally:
        root.setLevel(level)
        root.removeHandler(handler)
    return [r.getMessage() for r in records]


def _pass_through(rank, world_size):
    out = {"left_out": _output_left_out_of_the_loss(rank), "logged": _logged_plan()}
    ddp = phalanx.DistributedDataParallel(Echo(), find_unused_parameters=True)
    x = torch.randn(2, 3)
    for kind in ("tuple", "dict", "named", "dataclass"):
        result = ddp(x, 1, 2, kind=kind, flag=rank)
        out[kind] = type(result).__name__
        first = result[0] if kind in ("tuple", "named") else result["y"] if kind == "dict" else result.first
        first.sum().backward()
    out["seen"] = ddp.module.seen
    out["pair_extra"] = ddp(x, kind="dataclass").rest["label"]
    out["keys"] = list(ddp.state_dict())
    ddp.eval()
    out["eval"] = (ddp.training, ddp.module.training, ddp.module.lin.training)
    ddp.train()
    out["train"] = ddp.module.lin.training
    state = {k: torch.full_like(v, 7) for k, v in ddp.state_dict().items()}
    ddp.load_state_dict(state)
    out["loaded"] = ddp.module.lin.weight.flatten().tolist()[:2]
    # no_sync restores the attribute even when the body raises
    try:
        with ddp.no_sync():
            out["inside"] = ddp.require_backward_grad_sync
            raise KeyError("body failed")
    except KeyError:
        pass
    out["after"] = ddp.require_backward_grad_sync
    # a no-grad forward (evaluation) between training steps changes nothing
    with torch.no_grad():
        ddp(x)
    ddp(x)[0].sum().backward()
    out["grad_ok"] = ddp.module.lin.weight.grad is not None
    return out


@pytest.fixture(scope="module")
def pass_through():
    """Every rank's results of one group of 2 ranks running _pass_through (the tests below)."""
    return run_ranks(_pass_through, 2)


def test_outputs_and_arguments_pass_through(pass_through):
    for rank, out in enumerate(pass_through):
        assert (out["tuple"], out["dict"], out["named"], out["dataclass"]) == ("tuple", "dict", "Named", "Pair")
        assert out["seen"] == (2, "dataclass", rank)
        assert out["pair_extra"] == "text"


def test_state_dict_keys_and_loading_are_torchs(pass_through):
    for out in pass_through:
        assert out["keys"] == ["module.count", "module.lin.weight", "module.lin.bias"]  # as torch's DDP
        assert out["loaded"] == [7.0, 7.0]


def test_train_and_eval_modes_reach_the_module(pass_through):
    for out in pass_through:
        assert out["eval"] == (False, False, False) and out["train"] is True


def test_no_sync_restores_the_flag_when_its_body_raises(pass_through):
    for out in pass_through:
        assert (out["inside"], out["after"]) == (False, True)


def test_a_no_grad_forward_between_steps_changes_nothing(pass_through):
    for out in pass_through:
        assert out["grad_ok"]


def test_an_output_left_out_of_the_loss_leaves_its_parameters_without_gradients(pass_through):
    for out in pass_through:
        assert out["left_out"] == (True, ["right.weight", "right.bias"])


def test_the_bucket_plan_is_logged_at_debug_on_rank_0(pass_through):
    for rank, out in enumerate(pass_through):
        assert out["logged"] == ([] if rank else [
            "bucket plan, in launch order:\n"
            "bucket 0: 0.00 MiB torch.float32 on cpu: lin.bias\n"
            "bucket 1: 0.00 MiB torch.float32 on cpu: lin.weight"])


def _alone(rank, world_size):
    torch.manual_seed(0)
    model = Echo()
    ddp = phalanx.DistributedDataParallel(model, bucket_cap_mb=1)
    x = torch.randn(2, 3)
    same = torch.equal(ddp(x)[0], model(x)[0])
    hooks = [p._post_accumulate_grad_hooks for p in model.parameters()]
    with ddp.no_sync():
        ddp(x)[0].sum().backward()
    return {"same": same, "hooks": hooks, "plan": ddp.bucket_plan, "grad": model.lin.bias.grad.tolist()}


def test_world_size_one_is_the_bare_module():
    [out] = run_ranks(_alone, 1)
    assert out["same"] and out["plan"] == []
    assert out["hooks"] == [None, None]  # nothing installed on the parameters
    assert out["grad"] == [2.0, 2.0, 2.0]


def _on_gpus(rank, world_size):
    phalanx.init_process_group(backend="nccl")
    try:
        torch.manual_seed(rank)
        model = nn.Linear(4, 2).cuda(rank)
        ddp = phalanx.DistributedDataParallel(model, device_ids=[rank])
        ddp(torch.full((3, 4), float(rank))).sum().backward()  # a CPU input is moved to the GPU
        return model.weight.grad.cpu().tolist()
    finally:
        phalanx.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cuda_device_ids():
    results = run_ranks(_on_gpus, 2, init=False)
    assert results[0] == results[1] == [[1.5] * 4] * 2
