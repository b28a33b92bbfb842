"""One GPU: NCCL at world size 1 through ``phalanx.init_process_group()`` and through
``phalanx run --nproc-per-node gpu``, bit for bit with torch's DDP; and the device rule live
(phalanx.env.local_gpu): more local ranks than GPUs is refused on every rank before CUDA says
"invalid device ordinal", and ``device_id`` lets ranks share the GPU over Gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import phalanx
from tests.gpu.common import NEEDS_CUDA, assert_check, save_results
from tests.gpu.world1 import DETERMINISTIC_ENV, parity
from tests.harness import error_of, run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason=NEEDS_CUDA)

ROOT = Path(__file__).resolve().parents[2]
# Seconds: a launcher, a worker importing torch, a CUDA context and NCCL's start (~15 s); the
# part's 150 s (tools/gpu_check.py) holds two of these and the older one-GPU test.
LAUNCH_TIMEOUT_S = 60
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                 "MASTER_PORT")


def _world1(rank, world_size):
    phalanx.init_process_group()  # backend=None: NCCL, this process pinned to cuda:0
    try:
        return parity()
    finally:
        phalanx.destroy_process_group()


def test_nccl_at_world_size_1_is_torchs_ddp_bit_for_bit():
    [out] = run_ranks(_world1, 1, init=False, env=DETERMINISTIC_ENV, timeout=LAUNCH_TIMEOUT_S)
    save_results("nccl_world1", out)
    assert_check([{"nccl world 1": out}], "nccl world 1")


@pytest.mark.skipif(torch.cuda.device_count() != 1,
                    reason=f"needs exactly one GPU, sees {torch.cuda.device_count()} (with N, phalanx run "
                           "starts N workers; tests/dist covers 2)")
def test_phalanx_run_nproc_per_node_gpu(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARS and not k.startswith(("TORCHELASTIC_", "PHALANX_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env.update(DETERMINISTIC_ENV)
    out = tmp_path / "world1.json"
    done = subprocess.run([sys.executable, "-m", "phalanx", "run", "--nproc-per-node", "gpu",
                           str(ROOT / "tests" / "gpu" / "scripts" / "world1.py"), str(out)],
                          env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    result = json.loads(out.read_text())
    save_results("phalanx_run_gpu", result)
    assert_check([{"phalanx run": result}], "phalanx run")


def _device_rule(rank, world_size):
    """With more local ranks than GPUs: refused with NCCL, with backend=None and by get_device();
    then the override, device_id=cuda:0 on every rank, over Gloo."""
    out = {b: error_of(phalanx.init_process_group, backend=b) for b in (None, "nccl")}
    out["get_device"] = error_of(phalanx.get_device)
    phalanx.init_process_group(backend="gloo", device_id=torch.device("cuda", 0))
    try:
        total = torch.full((4,), float(rank + 1), device="cuda")
        phalanx.all_reduce(total)
        sub = dist.new_group([0, 1])
        dist.all_reduce(total, group=sub)
        phalanx.barrier()
        out["shared"] = (torch.cuda.current_device(), str(phalanx.get_device()), dist.get_backend(),
                         total.tolist())
    finally:
        phalanx.destroy_process_group()
    return out


def test_more_local_ranks_than_gpus_is_refused_unless_device_id_names_the_gpu():
    local_world = str(torch.cuda.device_count() + 1)
    results = run_ranks(_device_rule, 2, init=False, env={"LOCAL_WORLD_SIZE": local_world},
                        timeout=LAUNCH_TIMEOUT_S)
    for rank, out in enumerate(results):
        for key in (None, "nccl", "get_device"):
            kind, message = out[key]
            assert kind == "EnvironmentConfigError", (key, out[key])
            assert message.startswith(f"LOCAL_RANK={rank} of LOCAL_WORLD_SIZE={local_world} on this node"), message
        # backend="gloo" on one host: phalanx's shared memory for CPU tensors, Gloo for CUDA ones
        assert out["shared"] == (0, "cuda:0", "phalanx_shm", [6.0] * 4)
