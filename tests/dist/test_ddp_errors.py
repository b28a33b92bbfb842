"""DDP errors: named, raised on every rank, and never a hang (run_ranks would report a hung rank)."""

from __future__ import annotations

import torch
from torch import nn

import phalanx
from tests.harness import run_ranks

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


def _error(fn, *args, **kwargs):
    """(exception type name, message) of what ``fn`` raised, or None."""
    try:
        fn(*args, **kwargs)
    except Exception as e:
        return type(e).__name__, str(e)
    return None


def _step(ddp, use_branch=True):
    ddp(torch.randn(4, 6), use_branch=use_branch).sum().backward()


def _construction_errors(rank, world_size):
    DDP = phalanx.DistributedDataParallel
    out = {}
    out["shape"] = _error(DDP, Branchy(branch_in=16 if rank != 2 else 17))
    extra = Branchy()
    if rank == 1:
        extra.extra = nn.Linear(2, 2)
    out["count"] = _error(DDP, extra)
    frozen = Branchy()
    frozen.head.bias.requires_grad_(rank != 1)
    out["frozen"] = _error(DDP, frozen)
    out["settings"] = _error(DDP, Branchy(), bucket_cap_mb=25 if rank == 0 else 5)
    out["refused_on_one_rank"] = _error(DDP, Branchy(), bucket_cap_mb=-1 if rank == 2 else 25)
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
        out[name] = _error(DDP, **{"module": Branchy(), **kwargs})
    all_frozen = Branchy().requires_grad_(False)
    out["all_frozen"] = _error(DDP, all_frozen)
    out["empty_device_ids_ok"] = _error(DDP, Branchy(), device_ids=[])
    return out


def test_construction_errors_on_every_rank():
    results = run_ranks(_construction_errors, WORLD, timeout=90)
    for rank, out in enumerate(results):
        assert out["shape"] == ("RankMismatchError", (
            "DistributedDataParallel parameters, buffers and settings differ across ranks: ranks 2 "
            "disagree with rank 0 (8 vs 8 entries on rank 0 and rank 2). First difference at position 4: "
            "rank 0 has 'branch.weight' shape (16, 16) torch.float32, rank 2 has 'branch.weight' shape "
            "(16, 17) torch.float32"))
        kind, message = out["count"]
        assert kind == "RankMismatchError"
        assert "ranks 1 disagree with rank 0 (8 vs 10 entries" in message
        assert "rank 0 has nothing, rank 1 has 'extra.weight' shape (2, 2) torch.float32" in message
        kind, message = out["frozen"]
        assert "rank 0 has 'head.bias' shape (3,) torch.float32, rank 1 has 'head.bias' shape (3,) torch.float32 frozen" in message
        kind, message = out["settings"]
        assert kind == "RankMismatchError" and "ranks 1, 2 disagree with rank 0" in message
        assert "rank 0 has 'settings' bucket_cap_mb=25, broadcast_buffers=True" in message
        assert "rank 1 has 'settings' bucket_cap_mb=5," in message
        kind, message = out["refused_on_one_rank"]
        assert kind == "RankMismatchError" and "ranks 2 disagree with rank 0" in message
        assert ("rank 0 has 'arguments' accepted, rank 2 has 'arguments' refused: bucket_cap_mb must be "
                "positive (MiB per bucket), got -1") in message
        assert out["not_module"] == ("TypeError", "module must be a torch.nn.Module, got function")
        assert out["cap_type"] == ("TypeError", "bucket_cap_mb must be a number of MiB or None, got str")
        assert out["cap_zero"] == ("ValueError", "bucket_cap_mb must be positive (MiB per bucket), got 0")
        assert out["flag_type"] == ("TypeError", "find_unused_parameters must be True or False, got 'yes'")
        assert out["cpu_device_ids"] == ("ValueError", (
            "device_ids=[0] is for a module on cuda:0, but the module's tensors are on cpu. For a CPU "
            "module (or one spread over devices) leave device_ids=None; otherwise move the module there "
            "first (module.to('cuda:0'))"))
        assert out["two_device_ids"] == (
            "ValueError", "device_ids must name exactly one device (this process's), got [0, 1]")
        assert out["output_device_alone"] == ("ValueError", "output_device=0 needs device_ids; got device_ids=None")
        assert out["group_type"] == (
            "TypeError", "process_group must be a torch.distributed ProcessGroup or None, got str")
        assert out["all_frozen"][0] == "ValueError" and "at least one parameter that requires a gradient" in out["all_frozen"][1]
        assert out["empty_device_ids_ok"] is None


def _unused_errors(rank, world_size):
    out = {}
    torch.manual_seed(rank)
    ddp = phalanx.DistributedDataParallel(Branchy())
    out["everywhere"] = _error(_step, ddp, use_branch=False)
    # The reducer is usable again afterwards, and averages correctly.
    torch.manual_seed(100 + rank)
    _step(ddp)
    grads = [p.grad.clone() for p in ddp.parameters()]
    gathered = [torch.zeros_like(grads[0]) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, grads[0])
    out["same_after"] = max((g - gathered[0]).abs().max().item() for g in gathered)
    out["one_rank"] = _error(_step, ddp, use_branch=rank != 2)
    static = phalanx.DistributedDataParallel(Branchy(), static_graph=True)
    _step(static, use_branch=False)  # learned: the branch is unused
    _step(static, use_branch=False)
    out["static_changed"] = _error(_step, static, use_branch=True)
    return out


def test_unused_parameter_errors_name_them_on_every_rank():
    results = run_ranks(_unused_errors, WORLD, timeout=90)
    for out in results:
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
