"""ZeRO stage 2 (``DistributedDataParallel.shard_gradients``): each rank keeps only the averaged
gradients of the parameters it owns.

Each equivalence case trains two replicas side by side on every rank for 10 steps: phalanx DDP
with a ZeroRedundancyOptimizer and sharded gradients, and phalanx DDP (itself tested against
torch's DDP) with the plain optimizer and ``torch.nn.utils.clip_grad_norm_``. Both see the same
data; parameters, gradients and norms must agree within 1e-6. One group of ranks per world size
runs every check (a module fixture); the tests assert on its results.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, StepLR

import phalanx
from phalanx.ledger import syncpoint
from phalanx.zero import ZeroRedundancyOptimizer
from tests.dist.test_ddp_equivalence import batch, build, loss_of
from tests.dist.test_ddp_errors import Branchy
from tests.harness import error_of, run_ranks

STEPS = 10
TOL = 1e-6
# clip_grad_norm_ (norm_type, max_norm): max_norm below the norm of most steps here, so
# clipping acts (asserted)
L2_CLIP = (2.0, 0.3)

# name -> (optimizer class, hyper-parameters, lr scheduler factory)
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3},
            lambda opt: StepLR(opt, step_size=3, gamma=0.5)),
    "adam": (torch.optim.Adam, {"lr": 0.01}, lambda opt: LambdaLR(opt, lambda s: 1 / (1 + s))),
}

CASES = {
    "adam_no_sync_clip": dict(model="mlp", opt="adam", accum=2, clip=L2_CLIP),
    # many buckets per owner; .grad views the kept buckets; a parameter outside the optimizer
    "sgd_small_buckets_view_clip_inf": dict(
        model="mlp", opt="sgd", clip=(math.inf, 0.1), leave_out="4.bias",
        ddp=dict(bucket_cap_mb=1e-4, gradient_as_bucket_view=True)),
    # the branch is used by one rank per step, by none at step 1
    "adam_find_unused": dict(model="branch", opt="adam", ddp=dict(find_unused_parameters=True)),
    "sgd_static_graph_dead_layer": dict(model="dead", opt="sgd", clip=L2_CLIP, ddp=dict(static_graph=True)),
    # clip_grad_norm_ without shard_gradients: every rank holds every averaged gradient
    "stage1_adam_no_sync_clip": dict(model="mlp", opt="adam", accum=2, clip=L2_CLIP, stage2=False),
}


def _groups(model, leave_out=None):
    """Two param groups: weights at the default lr, biases at their own lr without decay."""
    named = [(n, p) for n, p in model.named_parameters() if n != leave_out]
    return [
        {"params": [p for n, p in named if n.endswith("weight")]},
        {"params": [p for n, p in named if n.endswith("bias")], "lr": 0.05, "weight_decay": 0.0},
    ]


def _replica(case, rank, sharded, group=None):
    """(ddp, optimizer, scheduler): sharded (ZeRO, stage 2 unless case says not) or plain."""
    ddp = phalanx.DistributedDataParallel(build(case["model"], seed=rank), process_group=group,
                                          **case.get("ddp", {}))
    cls, kwargs, schedule = OPTIMIZERS[case["opt"]]
    groups = _groups(ddp.module, case.get("leave_out"))
    if not sharded:
        opt = cls(groups, **kwargs)
    else:
        opt = ZeroRedundancyOptimizer(groups, cls, process_group=group, **kwargs)
        if case.get("stage2", True):
            ddp.shard_gradients(opt)
    return ddp, opt, schedule(opt)


def _backward(ddp, kind, step, rank, world_size, accum):
    for micro in range(accum):
        inputs, kwargs, y = batch(kind, step, micro, rank, world_size)
        with ddp.no_sync() if micro < accum - 1 else nullcontext():
            loss_of(kind, ddp(*inputs, **kwargs), y).backward()


def _run_case(case, rank, world_size, group=None):
    kind, clip = case["model"], case.get("clip")
    ours, opt, sched = _replica(case, rank, True, group)
    ref, ref_opt, ref_sched = _replica(case, rank, False, group)
    initial = [p.detach().clone() for p in ours.parameters()]
    if case.get("stage2", True):
        owned = {n for (n, _), o in zip(ours.module.named_parameters(),
                                        opt.owners_of(ours.parameters())) if o in (None, rank)}
    else:
        owned = {n for n, _ in ours.module.named_parameters()}
    out = {"grad_diff": 0.0, "norm_diff": 0.0, "clipped": 0, "held": [], "owned": sorted(owned)}
    for step in range(STEPS):
        _backward(ours, kind, step, rank, world_size, case.get("accum", 1))
        _backward(ref, kind, step, rank, world_size, case.get("accum", 1))
        out["held"].append(sorted(n for n, p in ours.module.named_parameters() if p.grad is not None))
        for p, q in zip(ours.parameters(), ref.parameters()):
            if p.grad is not None:
                out["grad_diff"] = max(out["grad_diff"], (p.grad - q.grad).abs().max().item())
        if clip is not None:
            norm_type, max_norm = clip
            norm = opt.clip_grad_norm_(max_norm, norm_type)
            ref_norm = nn.utils.clip_grad_norm_([p for g in ref_opt.param_groups for p in g["params"]],
                                                max_norm, norm_type)
            out["norm_diff"] = max(out["norm_diff"], (norm - ref_norm).abs().item())
            out["clipped"] += int(ref_norm.item() > max_norm)
        for o, s in ((opt, sched), (ref_opt, ref_sched)):
            o.step()
            s.step()
            o.zero_grad(set_to_none=step % 2 == 0)
    out["param_diff"] = max((p - q).abs().max().item() for p, q in zip(ours.parameters(), ref.parameters()))
    out["moved"] = max((p - q).abs().max().item() for p, q in zip(ours.parameters(), initial))
    out["lr"] = [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    return out


def _memory(rank, world_size):
    """Gradient bytes after one backward: plain DDP and stage 2, with and without bucket views.

    Six equal layers: sorted-greedy gives each rank exactly total/N at 2 and 3 ranks.
    """
    out = {}
    for view in (False, True):
        for sharded in (False, True):
            torch.manual_seed(0)
            model = nn.Sequential(*(nn.Linear(32, 32) for _ in range(6)))
            ddp = phalanx.DistributedDataParallel(model, gradient_as_bucket_view=view)
            if sharded:
                opt = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=1e-3)
                ddp.shard_gradients(opt)
                owners = opt.owners_of(ddp.parameters())
                out["owned"] = sum(p.numel() * 4 for p, o in zip(ddp.parameters(), owners) if o == rank)
                out["keeps_last"] = ddp.bucket_plan[-1].owner == rank
            ddp(torch.randn(4, 32)).sum().backward()
            out[f"view={view} sharded={sharded}"] = ddp.gradient_bytes()
    out["total"] = sum(p.numel() * 4 for p in model.parameters())
    out["largest"] = max(p.numel() * 4 for p in model.parameters())
    return out


def _sharded_branchy(rank):
    torch.manual_seed(rank)
    ddp = phalanx.DistributedDataParallel(Branchy())
    opt = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, lr=0.1)
    ddp.shard_gradients(opt)
    return ddp, opt


def _unused_errors(rank, world_size):
    ddp, opt = _sharded_branchy(rank)
    step = lambda use_branch: ddp(torch.randn(4, 6), use_branch=use_branch).sum().backward()  # noqa: E731
    out = {"everywhere": error_of(step, False), "one_rank": error_of(step, rank != 1)}
    opt.zero_grad()
    step(True)  # usable afterwards: each rank holds exactly its own gradients
    mine = [o == rank for o in opt.owners_of(ddp.parameters())]
    out["held_after"] = [p.grad is not None for p in ddp.parameters()] == mine
    return out


def _api_errors(rank, world_size):
    ddp, opt = _sharded_branchy(rank)
    out = {"not_zero": error_of(ddp.shard_gradients, torch.optim.SGD(ddp.parameters(), lr=0.1)),
           "other_model": error_of(ddp.shard_gradients, ZeroRedundancyOptimizer(
               nn.Linear(2, 2).parameters(), torch.optim.SGD, lr=0.1))}
    plain = phalanx.DistributedDataParallel(Branchy())
    loss = plain(torch.randn(4, 6)).sum()
    out["mid_iteration"] = error_of(plain.shard_gradients, opt)
    loss.backward()  # the unsharded reducer still finishes this backward
    out["mid_iteration_grads"] = sum(p.grad is not None for p in plain.parameters())
    torch.manual_seed(0)
    twins = phalanx.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    w0, b0, w1, b1 = twins.parameters()  # rank 1 lists the two (same-shaped) weights swapped
    swapped = ZeroRedundancyOptimizer([w1, b0, w0, b1] if rank == 1 else [w0, b0, w1, b1],
                                      torch.optim.SGD, lr=0.1)
    out["owner_mismatch"] = error_of(twins.shard_gradients, swapped)
    if world_size == 3:
        out["subgroup"] = _subgroup(rank)
    return out


def _subgroup(rank):
    """DDP over global ranks [1, 2]: a world-wide optimizer is refused, a subgroup one trains."""
    group = dist.new_group([1, 2])  # every rank must call new_group
    everyone = ZeroRedundancyOptimizer(nn.Linear(6, 3).parameters(), torch.optim.SGD, lr=0.1)
    out = None
    if rank != 0:
        ddp = phalanx.DistributedDataParallel(Branchy(), process_group=group)
        out = {"other_ranks": error_of(ddp.shard_gradients, everyone),
               "train": _run_case(CASES["adam_no_sync_clip"], rank - 1, 2, group)}
    dist.barrier()  # rank 0 hosts the store the subgroup still needs: it waits here
    return out


def _more_ranks_than_params(rank):
    """Two parameters on three ranks: rank 2 owns none, keeps no gradient, and still trains."""
    models, held = [], []
    for sharded in (True, False):
        torch.manual_seed(rank)
        ddp = phalanx.DistributedDataParallel(nn.Linear(3, 1), gradient_as_bucket_view=False)
        if sharded:
            opt = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=0.1)
            ddp.shard_gradients(opt)
        else:
            opt = torch.optim.Adam(ddp.parameters(), lr=0.1)
        for step in range(3):
            opt.zero_grad()
            ddp(torch.full((2, 3), float(rank + step))).pow(2).mean().backward()
            held.append(ddp.gradient_bytes())
            opt.step()
        models.append(ddp.module)
    diff = max((p - q).abs().max().item() for p, q in zip(*(m.parameters() for m in models)))
    return {"diff": diff, "held": held[:3], "plain_held": held[3:]}


def _all_checks(rank, world_size):
    out = {name: _run_case(case, rank, world_size) for name, case in CASES.items()}
    out["memory"] = _memory(rank, world_size)
    out["unused"] = _unused_errors(rank, world_size)
    out["errors"] = _api_errors(rank, world_size)
    if world_size == 3:
        out["tiny"] = _more_ranks_than_params(rank)
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def ranks(request):
    """(world size, every rank's results) of one group of ranks running all checks."""
    return request.param, run_ranks(_all_checks, request.param, timeout=240)


def _assert_equivalent(name, case, results):
    for rank, out in enumerate(results):
        assert out["param_diff"] <= TOL, (name, rank, out["param_diff"])
        assert out["grad_diff"] <= TOL, (name, rank, out["grad_diff"])
        assert out["norm_diff"] <= TOL, (name, rank, out["norm_diff"])
        assert out["moved"] > 1e-3, (name, rank, "training changed nothing: the test would prove nothing")
        assert out["lr"], name
        if "clip" in case:
            assert out["clipped"] >= STEPS // 2, (name, out["clipped"])
        for held in out["held"]:  # .grad is held for owned parameters only (and not for unused)
            assert set(held) <= set(out["owned"]), (name, rank, held, out["owned"])
        if case["model"] == "mlp":
            assert all(held == out["owned"] for held in out["held"]), (name, rank)
    if case.get("stage2", True):
        owned = [set(out["owned"]) for out in results]
        shared = set.intersection(*owned)
        assert shared == ({case["leave_out"]} if "leave_out" in case else set()), (name, shared)
        assert sum(len(o - shared) for o in owned) == len(set.union(*owned) - shared)  # one owner each


@pytest.mark.parametrize("name", list(CASES))
def test_stage2_trains_like_plain_ddp_and_unsharded_optimizer(ranks, name):
    _, results = ranks
    case = CASES[name]
    _assert_equivalent(name, case, [out[name] for out in results])


@pytest.mark.parametrize("ranks", [3], indirect=True, ids=["world3"])  # the 3-rank group only
def test_stage2_over_a_subgroup_trains_like_plain_ddp(ranks):
    world_size, results = ranks
    if world_size == 3:  # DDP and ZeRO over global ranks [1, 2]: owners mapped to global ranks
        sub = [out["errors"]["subgroup"]["train"] for out in results[1:]]
        _assert_equivalent("subgroup", CASES["adam_no_sync_clip"], sub)


def test_stage2_gradient_memory_is_about_one_nth(ranks):
    world_size, results = ranks
    memory = [out["memory"] for out in results]
    tail = 4  # the last bucket's control element (float32), on the ranks that keep that bucket
    for rank, mem in enumerate(memory):
        total, owned, extra = mem["total"], mem["owned"], tail if mem["keeps_last"] else 0
        # plain DDP: every gradient, twice without bucket views (.grad and bucket)
        assert mem["view=False sharded=False"] == 2 * total + tail
        assert mem["view=True sharded=False"] == total + tail
        assert mem["view=False sharded=True"] == 2 * owned + extra
        assert mem["view=True sharded=True"] == owned + extra
        assert owned + extra <= total / world_size + mem["largest"], (rank, owned, total)
    assert sum(mem["owned"] for mem in memory) == memory[0]["total"]
    assert all(mem["owned"] > 0 for mem in memory)
    if world_size == 3:  # weight (3 floats) on rank 0, bias on rank 1, rank 2 nothing
        tiny = [out["tiny"] for out in results]
        assert all(t["diff"] <= TOL for t in tiny), tiny
        # .grad plus kept bucket: rank 0 weight 12 + 12 + 4 (the last bucket's tail), rank 1 bias 4 + 4
        assert [t["held"] for t in tiny] == [[28] * 3, [8] * 3, [0] * 3]
        # plain DDP: .grad (16) and its one bucket, which carries the forward's sync point: the
        # bucket and its tail sit in the check's envelope (phalanx.ledger.syncpoint)
        envelope = 4 * syncpoint.envelope_size(world_size)
        assert all(t["plain_held"] == [16 + envelope] * 3 for t in tiny), tiny


def test_unused_parameters_still_raise_on_every_rank(ranks):
    world_size, results = ranks
    everyone = "; ".join(f"rank {r}: 'branch.bias', 'branch.weight'" for r in range(world_size))
    for out in results:
        unused = out["unused"]
        assert unused["everywhere"] == ("UnusedParametersError", (
            f"Parameters received no gradient in this backward pass while find_unused_parameters=False "
            f"({everyone}). Pass find_unused_parameters=True to DistributedDataParallel, "
            "or make every parameter take part in the loss (or freeze it with requires_grad=False)"))
        kind, message = unused["one_rank"]
        assert kind == "UnusedParametersError" and "(rank 1: 'branch.bias', 'branch.weight')." in message
        assert unused["held_after"]


def test_shard_gradients_refuses_mistakes_on_every_rank(ranks):
    world_size, results = ranks
    for rank, out in enumerate(results):
        errors = out["errors"]
        assert errors["not_zero"] == ("TypeError", (
            "shard_gradients() needs a sharded optimizer such as phalanx.ZeroRedundancyOptimizer "
            "(its owners_of() says which rank owns each parameter), got SGD"))
        assert errors["other_model"] == ("ValueError", (
            "shard_gradients() needs the optimizer of this model: it holds none of the 6 parameters "
            "of this DistributedDataParallel's module"))
        assert errors["mid_iteration"] == ("UsageError", (
            "shard_gradients() was called between a forward and its backward; call it between "
            "iterations (after backward(), or before the first forward)"))
        assert errors["mid_iteration_grads"] == 6
        kind, message = errors["owner_mismatch"]
        assert kind == "RankMismatchError", errors["owner_mismatch"]
        assert "shard_gradients() owners differ across ranks: ranks 1 disagree with rank 0" in message
        assert "'owner of 0.weight'" in message
    if world_size == 3:
        assert results[0]["errors"]["subgroup"] is None
        for out in results[1:]:
            assert out["errors"]["subgroup"]["other_ranks"] == ("ValueError", (
                "shard_gradients() needs the optimizer sharded over the ranks DDP averages over: "
                "DDP has global ranks [1, 2], the optimizer [0, 1, 2]"))


def _stage2_on_gpus(rank, world_size):
    phalanx.init_process_group(backend="nccl")
    try:
        torch.manual_seed(rank)
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)).cuda(rank)
        ddp = phalanx.DistributedDataParallel(model, device_ids=[rank])
        opt = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, lr=0.1)
        ddp.shard_gradients(opt)
        ddp(torch.full((3, 4), float(rank))).sum().backward()
        norm = opt.clip_grad_norm_(1e9).item()
        held = {n: p.grad.cpu().sum().item() for n, p in model.named_parameters() if p.grad is not None}
        return {"held": held, "norm": norm, "owners": opt.owners_of(model.parameters())}
    finally:
        phalanx.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_stage2_on_gpus_with_nccl():
    results = run_ranks(_stage2_on_gpus, 2, init=False)
    names = ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert results[0]["norm"] == results[1]["norm"] > 0
    for rank, out in enumerate(results):
        assert sorted(out["held"]) == sorted(n for n, o in zip(names, out["owners"]) if o == rank)
    # d(sum of 3 x 2 outputs)/d(bias) is 3 per entry on each rank, so 6 summed: only its owner has it
    assert [out["held"]["1.bias"] for out in results if "1.bias" in out["held"]] == [6.0]
