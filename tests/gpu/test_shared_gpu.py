"""Two ranks sharing one GPU over Gloo, every tensor on cuda:0 (rank 1 has LOCAL_RANK=1 on a
one-GPU machine; torch's DDP supports this, NCCL refuses two ranks on one device): phalanx's
DDP, hooks, SyncBatchNorm, ZeRO, join and checkpoints against torch's, one spawned group for
all the checks, each check its own test."""

from __future__ import annotations

import pytest
import torch

from tests.gpu import checks_ddp, checks_features
from tests.gpu.common import NEEDS_CUDA, ON_CPU, assert_check, run_checks, save_results
from tests.harness import run_ranks

# ON_CPU: the checks' logic on the CPU (tools/gpu_check.py --rehearse-on-cpu), proving nothing about CUDA
pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or ON_CPU), reason=NEEDS_CUDA)

CHECKS = {**checks_ddp.CHECKS, **checks_features.CHECKS, "checkpoint": checks_features.checkpoint}
# Seconds for the whole group (under tools/gpu_check.py's 150 s for the part, so that a hung
# rank is named with its stack): start-up, CUDA contexts and ~40 small trainings, whose
# all-reduces Gloo copies through the host; 15 s on the CPU.
GROUP_TIMEOUT_S = 120


def _all_checks(rank, world_size, directory):
    checks = {name: check for name, check in CHECKS.items() if name != "checkpoint"}
    out = run_checks(checks, rank)
    out.update(run_checks({"checkpoint": checks_features.checkpoint}, rank, directory))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    found = run_ranks(_all_checks, 2, str(tmp_path_factory.mktemp("shared-gpu")), timeout=GROUP_TIMEOUT_S)
    save_results("shared_gpu", found)
    return found


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_two_ranks_on_one_gpu_match_torch(results, name):
    assert_check(results, name)
