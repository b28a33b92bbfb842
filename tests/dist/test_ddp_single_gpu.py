"""Smoke tests on one GPU (skipped without CUDA): NCCL at world size 1, DDP with
``device_ids=[0]``, SyncBatchNorm forward and backward on cuda.

One process, so nothing is averaged: these check that the GPU paths run at all (backend
choice, device pinning, inputs moved to the device, float64 NCCL all-reduces, ``.item()`` of
CUDA tensors). The 2-GPU tests in test_ddp_features.py, test_zero2.py and
test_sync_batchnorm.py check the numbers across ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import phalanx
from tests.harness import run_ranks

TOL = 1e-5


def _sync_batchnorm_on(device):
    """The synchronised path (forced: one process would take plain BatchNorm's) vs BatchNorm."""
    torch.manual_seed(0)
    ours, ref = phalanx.SyncBatchNorm(3).to(device), nn.BatchNorm1d(3).to(device)
    ours._synchronised = lambda: True  # its all-reduces work in a group of one
    x = torch.randn(6, 3, 4, device=device) * 2 + 1
    dy = torch.randn_like(x)
    outs, grads = [], []
    for bn in (ours, ref):
        x_in = x.clone().requires_grad_(True)
        outs.append(bn(x_in))
        outs[-1].backward(dy)
        grads.append(x_in.grad)
    pairs = {"out": outs, "grad_in": grads}
    for name in ("weight", "bias", "running_mean", "running_var"):
        pairs[name] = [getattr(bn, name) for bn in (ours, ref)]
        if name in ("weight", "bias"):
            pairs[f"grad_{name}"] = [getattr(bn, name).grad for bn in (ours, ref)]
    return {name: (a - b).abs().max().item() for name, (a, b) in pairs.items()}


def _one_gpu(rank, world_size):
    phalanx.init_process_group()  # backend=None: NCCL, as this process has a GPU
    try:
        out = {"backend": dist.get_backend(), "device": str(phalanx.get_device()),
               "current": torch.cuda.current_device()}
        phalanx.barrier()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).cuda(0)
        ddp = phalanx.DistributedDataParallel(
            phalanx.SyncBatchNorm.convert_sync_batchnorm(model), device_ids=[0])
        y = ddp(torch.randn(5, 4))  # a CPU input, moved to cuda:0
        y.sum().backward()
        out["output"] = str(y.device)
        out["grads_on_gpu"] = all(p.grad is not None and p.grad.is_cuda for p in model.parameters())
        out["sync_batchnorm"] = _sync_batchnorm_on("cuda")
        return out
    finally:
        phalanx.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 1, reason="needs a GPU")
def test_nccl_ddp_and_sync_batchnorm_on_one_gpu():
    [out] = run_ranks(_one_gpu, 1, init=False)
    assert (out["backend"], out["device"], out["current"]) == ("nccl", "cuda:0", 0)
    assert out["output"] == "cuda:0" and out["grads_on_gpu"]
    for name, err in out["sync_batchnorm"].items():
        assert err <= TOL, (name, err)
