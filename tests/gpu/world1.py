"""NCCL at world size 1 on cuda:0: what ``phalanx.init_process_group()`` chose and pinned, and
phalanx's DDP against torch's DDP on the same GPU, bit for bit (one rank: nothing is averaged,
so every operation is the same one on the same device). Run inside an initialised group, by
test_one_gpu.py directly and under ``phalanx run --nproc-per-node gpu`` (scripts/world1.py).

Bit for bit needs the same kernels: cuBLAS is made deterministic by the environment the tests
give the rank (``CUBLAS_WORKSPACE_CONFIG``, :data:`DETERMINISTIC_ENV`) and
``torch.use_deterministic_algorithms``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import phalanx
from tests.gpu.common import against_torch, pair, train

# cuBLAS's documented setting for reproducible results (CUDA >= 10.2), read at its start-up.
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def parity() -> dict[str, Any]:
    torch.use_deterministic_algorithms(True, warn_only=True)
    rank = dist.get_rank()
    seen = {"backend": dist.get_backend(), "device": str(phalanx.get_device()),
            "current device": torch.cuda.current_device(), "world size": dist.get_world_size()}
    phalanx.barrier()
    total = torch.ones(1, device="cuda")
    phalanx.all_reduce(total)
    ours, theirs, ddp = pair(lambda m: train(m, torch.optim.Adam(m.parameters(), lr=1e-2), rank))
    out = against_torch(ours, theirs, limit=0.0, label="vs torch's DDP")
    out["limits"].update({
        "backend is nccl": (float(seen["backend"] != "nccl"), 0),
        "get_device() is cuda:0": (float(seen["device"] != "cuda:0"), 0),
        "pinned to cuda:0": (float(seen["current device"] != 0), 0),
        "all_reduce on cuda": (float(total.item() != seen["world size"]), 0),
    })
    # phalanx's DDP builds no reducer for a group of one (ddp/runtime.py: Runtime), torch's does
    out["info"].update(seen, **{"phalanx buckets at world 1": len(ddp.bucket_plan)})
    return out
