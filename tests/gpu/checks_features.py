"""The rest of phalanx on CUDA tensors, two ranks sharing cuda:0 over Gloo: mixed precision
against torch's DDP with the same ``mixed_precision``, SyncBatchNorm against BatchNorm on the
global batch, ZeRO stage 1 and 2 against torch's DDP with a plain optimizer, join against
torch's join, checkpoints saved from CUDA and loaded elsewhere, phalanx.fully_shard against
torch's DDP (and, reported, against torch's fully_shard)."""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import phalanx
from phalanx.checkpoint import read_checkpoint
from tests.gpu.common import (DEV, DEVICE_IDS, TOL, against_torch, batch, bitwise, flat_grads, flat_params, net,
                              pair, rel_diff, sync, train)


def sync_batchnorm(rank: int) -> dict[str, Any]:
    """Each rank's half of a batch through phalanx.SyncBatchNorm; BatchNorm on the whole batch."""
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(5)
    x, dy = (torch.randn(4 * world, 3, 5, generator=g) * 2 + 1).to(DEV), torch.randn(4 * world, 3, 5, generator=g).to(DEV)
    mine = slice(4 * rank, 4 * (rank + 1))
    torch.manual_seed(0)
    ours, ref = phalanx.SyncBatchNorm(3).to(DEV), nn.BatchNorm1d(3).to(DEV)
    x_ours, x_ref = x[mine].clone().requires_grad_(True), x.clone().requires_grad_(True)
    out_ours, out_ref = ours(x_ours), ref(x_ref)
    (out_ours * dy[mine]).sum().backward()
    (out_ref * dy).sum().backward()
    param_grads = torch.cat([ours.weight.grad, ours.bias.grad])
    dist.all_reduce(param_grads)  # each rank holds its part of d/dweight: their sum is the whole
    pairs = {"output": (out_ours, out_ref[mine]), "input grad": (x_ours.grad, x_ref.grad[mine]),
             "running_mean": (ours.running_mean, ref.running_mean),
             "running_var": (ours.running_var, ref.running_var),
             "weight and bias grads": (param_grads, torch.cat([ref.weight.grad, ref.bias.grad]))}
    return {"limits": {name: (rel_diff([a], [b]), TOL) for name, (a, b) in pairs.items()},
            "info": {"on": str(out_ours.device)}}


def _adam_like_torch(stage: int, rank: int) -> dict[str, Any]:
    """phalanx's DDP with a ZeroRedundancyOptimizer (stage 2: ``shard_gradients``) against
    torch's DDP with Adam; the gradient norm clipped by each, as torch's clip_grad_norm_."""
    norms = []

    def run(model):
        ours = isinstance(model, phalanx.DistributedDataParallel)
        if ours:
            opt = phalanx.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-2)
            if stage == 2:
                model.shard_gradients(opt)
        else:
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        record = []
        for step in range(3):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(batch(rank, step)[0].to(DEV)), batch(rank, step)[1].to(DEV)).backward()
            clip = opt.clip_grad_norm_ if ours else (lambda n: nn.utils.clip_grad_norm_(model.parameters(), n))
            record.append(clip(1.0).reshape(1).float())
            opt.step()
        sync()
        norms.append(record)
        return [flat_params(model)]

    ours, theirs, _ = pair(run)
    out = against_torch(ours, theirs)
    out["limits"]["clipped norm vs torch"] = (rel_diff(*norms), TOL)
    return out


def zero_stage1(rank: int) -> dict[str, Any]:
    return _adam_like_torch(1, rank)


def zero_stage2(rank: int) -> dict[str, Any]:
    return _adam_like_torch(2, rank)


def join(rank: int) -> dict[str, Any]:
    """Rank 0 has 3 batches, rank 1 has 5: phalanx's join trains as torch's join does."""
    records = []
    for make in (phalanx.DistributedDataParallel, torch.nn.parallel.DistributedDataParallel):
        model = make(net(), device_ids=DEVICE_IDS)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with model.join():
            records.append(train(model, opt, rank, steps=3 + 2 * rank)[-1:])
    moved = rel_diff(records[0], [flat_params(net())])
    return {"limits": {"vs torch's join": (rel_diff(*records), TOL), "trained": (float(moved < 1e-3), 0)},
            "info": {"bitwise": torch.equal(*records[0], *records[1])}}


def checkpoint(rank: int, directory: str) -> dict[str, Any]:
    """Saved from cuda:0; loaded onto cuda:0 (model, Adam's state, CUDA RNG), read onto the CPU,
    and loaded into a CPU model with map_location='cpu'."""
    directory = os.path.join(directory, "checkpoint")
    model = phalanx.DistributedDataParallel(net(), device_ids=DEVICE_IDS)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, rank, steps=2)
    saver = phalanx.Checkpointer(directory, model, opt, map_location=DEV)
    path = saver.save(0, 2)
    expected_draw = torch.rand(3, device=DEV)
    saved = flat_params(model)
    fresh = phalanx.DistributedDataParallel(copy.deepcopy(net()), device_ids=DEVICE_IDS)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    phalanx.Checkpointer(directory, fresh, fresh_opt, map_location=DEV).load()
    state_devices = {str(t.device) for s in fresh_opt.state.values() for t in s.values()
                     if isinstance(t, torch.Tensor) and t.dim() > 0}
    redraw = torch.rand(3, device=DEV)
    on_cpu = net(torch.device("cpu"))
    phalanx.Checkpointer(directory, on_cpu, map_location="cpu").load()
    read = read_checkpoint(path, map_location="cpu")["model"]
    limits = {
        "cuda load: parameters": (rel_diff([flat_params(fresh)], [saved]), 0.0),
        "cuda load: Adam state on cuda:0": (float(state_devices != {str(DEV)}), 0),
        "cuda load: CUDA RNG restored": (float(not torch.equal(redraw, expected_draw)), 0),
        "cpu load: parameters": (rel_diff([flat_params(on_cpu).to(DEV)], [saved]), 0.0),
        "read with map_location='cpu'": (float({str(t.device) for t in read.values()} != {"cpu"}), 0),
    }
    default = phalanx.Checkpointer(directory, model).map_location
    return {"limits": limits, "info": {"default map_location": str(default), "state devices": sorted(state_devices)}}


def _mixed_precision_reference(world: int, steps: int = 3) -> list[torch.Tensor]:
    """What bf16 compute around fp32 masters, averaged in fp32, gives, as ``train`` records it,
    computed in this process alone: each rank's batch through a bf16 copy of the masters, the
    gradients upcast (exactly), summed in rank order and divided by ``world`` (exact at 2),
    AdamW on the masters."""
    master = net()
    opt = torch.optim.AdamW(master.parameters(), lr=1e-2)
    seen = []
    for step in range(steps):
        total = None
        for r in range(world):
            low = copy.deepcopy(master).to(torch.bfloat16)
            x, y = batch(r, step)
            F.cross_entropy(low(x.to(DEV, torch.bfloat16)), y.to(DEV)).backward()
            grads = [p.grad.float() for p in low.parameters()]
            total = grads if total is None else [a + b for a, b in zip(total, grads)]
        for p, g in zip(master.parameters(), total):
            p.grad = g / world
        seen.append(flat_grads(master))
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync()
    return seen + [flat_params(master)]


def mixed_precision(rank: int) -> dict[str, Any]:
    """``mixed_precision=_MixedPrecision(bf16, fp32)``, AdamW, against the reference computed in
    one process (:func:`_mixed_precision_reference`); torch's DDP with the same is compared and
    reported (it runs on CUDA only: on the CPU its forward fails, no events). Two ranks:
    dividing by 2 is exact, so torch's sum-then-divide and phalanx's divide-then-sum give the
    same fp32 averages of the same bf16 gradients."""
    from torch.nn.parallel.distributed import _MixedPrecision

    def run(ddp: nn.Module) -> list[torch.Tensor]:
        return train(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2), rank)

    kwargs = {"device_ids": DEVICE_IDS, "gradient_as_bucket_view": False,
              "mixed_precision": _MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    ddp = phalanx.DistributedDataParallel(net(), **kwargs)
    ours, reference = run(ddp), _mixed_precision_reference(dist.get_world_size())
    out = against_torch(ours, reference, label="vs the reference")
    out["limits"]["fp32 masters"] = (float(any(p.dtype != torch.float32 for p in ddp.parameters())), 0)
    if DEV.type == "cpu":
        out["info"]["torch's"] = "skipped: torch's DDP mixed precision needs CUDA events"
        return out
    theirs = run(torch.nn.parallel.DistributedDataParallel(net(), **kwargs))
    out["info"].update({"vs torch": rel_diff(ours, theirs), "vs torch bitwise": bitwise(ours, theirs),
                        "torch's vs the reference": rel_diff(theirs, reference)})
    return out


def _sharded(shard: Any) -> nn.Module:
    """The check model with ``inp`` and ``branch`` as units, then the root."""
    model = net()
    for child in (model.inp, model.branch):
        shard(child)
    return shard(model)


def fully_shard(rank: int) -> dict[str, Any]:
    """``phalanx.fully_shard`` (per-layer units and the root, AdamW, 3 steps) on cuda:0 against
    torch's DDP; torch's ``fully_shard`` on the same Gloo-on-CUDA group, where it runs, is
    compared too and reported (never asserted: it is torch's path, not phalanx's)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    def full(model: nn.Module) -> list[torch.Tensor]:
        return [torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).detach().flatten().float()
                           for p in model.parameters()])]

    def run(model: nn.Module) -> list[torch.Tensor]:
        train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), rank)
        return full(model)

    ours = run(_sharded(phalanx.fully_shard))
    ddp = torch.nn.parallel.DistributedDataParallel(net(), device_ids=DEVICE_IDS)
    out = against_torch(ours, run(ddp), label="vs torch's DDP")
    world, sharded = dist.get_world_size(), list(_sharded(phalanx.fully_shard).parameters())
    held = sum(p.to_local().numel() for p in sharded)
    bound = sum(-(-p.shape[0] // world) * p[0].numel() if p.dim() > 1 else -(-p.shape[0] // world) for p in sharded)
    out["limits"]["held beyond 1/N of the rows"] = (float(held > bound), 0)
    out["limits"]["shards off the device"] = (float(any(p.to_local().device != DEV for p in sharded)), 0)
    try:
        theirs = run(_sharded(torch_fully_shard))
        out["info"]["vs torch's fully_shard"] = rel_diff(ours, theirs)
        out["info"]["vs torch's fully_shard bitwise"] = bitwise(ours, theirs)
    except Exception as e:  # torch's FSDP2 on Gloo with CUDA tensors: its own limits
        out["info"]["torch's fully_shard"] = f"{type(e).__name__}: {e}"[:500]
    return out


CHECKS = {
    "fully_shard": fully_shard,
    "mixed_precision": mixed_precision,
    "sync_batchnorm": sync_batchnorm,
    "zero_stage1": zero_stage1,
    "zero_stage2": zero_stage2,
    "join": join,
}
