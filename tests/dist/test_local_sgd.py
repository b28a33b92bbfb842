"""Local SGD and DiLoCo (issue 12) against a naive reference written here: every parameter
all-reduced on its own, the outer Nesterov step spelled out; on phalanx's DDP, torch's DDP
and a plain module, with BatchNorm statistics averaged too; argument errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import phalanx
from tests.harness import error_of, run_ranks

EVERY, STEPS, LR, OUTER_LR, OUTER_MOMENTUM = 3, 8, 0.1, 0.7, 0.9


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 6, generator=g) * (1 + rank), torch.randint(0, 3, (8,), generator=g)


def _state(module):
    return torch.cat([t.detach().flatten().double() for t in module.state_dict().values()])


def _reference(rank, world_size, kind):
    """The naive algorithm: local SGD steps; every EVERY steps each tensor averaged by itself."""
    net = _net()
    with torch.no_grad():
        for t in list(net.parameters()) + list(net.buffers()):
            dist.broadcast(t, 0)
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    params = list(net.parameters())
    global_params = [p.detach().clone() for p in params]
    momenta = [torch.zeros_like(p) for p in params]
    for step in range(STEPS):
        x, y = _batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        if (step + 1) % EVERY:
            continue
        with torch.no_grad():
            for b in net.buffers():
                if b.is_floating_point():
                    dist.all_reduce(b)
                    b /= world_size
            for p, g, m in zip(params, global_params, momenta):
                if kind == "local":
                    dist.all_reduce(p)
                    p /= world_size
                    continue
                delta = g - p  # the pseudo-gradient, averaged
                dist.all_reduce(delta)
                delta /= world_size
                m.mul_(OUTER_MOMENTUM).add_(delta)  # torch.optim.SGD's Nesterov, step by step
                g.add_(delta.add(m, alpha=OUTER_MOMENTUM), alpha=-OUTER_LR)
                p.copy_(g)
    return _state(net)


def _ours(rank, world_size, kind, wrap):
    net = _net()
    model = {"phalanx": phalanx.DistributedDataParallel, "torch": TorchDDP, "plain": lambda m: m}[wrap](net)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    if kind == "local":
        scheme = phalanx.LocalSGD(model, opt, every=EVERY)
    else:
        scheme = phalanx.DiLoCo(model, opt, every=EVERY, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM)
    for step in range(STEPS):
        x, y = _batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        scheme.step()
    return _state(net)


def _against_reference(rank, world_size):
    out = {}
    for kind in ("local", "diloco"):
        want = _reference(rank, world_size, kind)
        for wrap in ("phalanx", "torch", "plain"):
            got = _ours(rank, world_size, kind, wrap)
            out[(kind, wrap)] = (got - want).abs().max().item()
        out[(kind, "moved")] = (want - _state(_net())).abs().max().item()
    ddp = phalanx.DistributedDataParallel(_net())
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    out["every"] = error_of(phalanx.LocalSGD, ddp, opt, every=0)
    out["optimizer"] = error_of(phalanx.DiLoCo, ddp, "sgd", every=2)
    out["compress"] = error_of(phalanx.DiLoCo, ddp, opt, every=2, compress="int8")
    out["model"] = error_of(phalanx.LocalSGD, "net", opt, every=2)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_local_sgd_and_diloco_equal_the_naive_reference(world_size):
    for out in run_ranks(_against_reference, world_size):
        for kind in ("local", "diloco"):
            assert out[(kind, "moved")] > 0.05  # training did something
            for wrap in ("phalanx", "torch", "plain"):
                # 2 ranks: a + b whatever the packing, bit for bit; 3: Gloo's ring order may differ
                assert out[(kind, wrap)] <= (0.0 if world_size == 2 else 1e-6), (kind, wrap, out[(kind, wrap)])
        assert out["every"] == ("ValueError", "every must be a positive number of steps, got 0")
        assert out["optimizer"] == ("TypeError", "optimizer must be a torch.optim.Optimizer, got str")
        assert out["compress"] == ("ValueError", "compress must be None or one of ['bf16', 'fp16'], got 'int8'")
        assert out["model"] == ("TypeError", "model must be a torch.nn.Module (or a DDP of one), got str")
