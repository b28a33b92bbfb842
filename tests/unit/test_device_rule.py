"""phalanx's device rule, one GPU per local rank (phalanx.env.local_gpu), and how
init_process_group and get_device follow it, checked without a GPU: torch's CUDA queries are
replaced by a machine that shows ``gpus`` GPUs, and nothing reaches CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import phalanx
from phalanx import process_group
from phalanx.env import DistEnv, local_gpu
from phalanx.errors import EnvironmentConfigError


def _env(local_rank: int, local_world_size: int) -> DistEnv:
    return DistEnv(rank=local_rank, world_size=local_world_size, local_rank=local_rank,
                   local_world_size=local_world_size, master_addr="127.0.0.1", master_port=29500,
                   source="launcher")


@pytest.mark.parametrize("local_rank, local_world_size, gpus, expected", [
    (0, 1, 0, None),   # no GPU: the CPU
    (1, 2, 0, None),
    (0, 1, 1, 0),      # one rank, one GPU
    (1, 2, 2, 1),      # cuda:LOCAL_RANK
    (1, 2, 8, 1),      # more GPUs than ranks: still cuda:LOCAL_RANK
    (3, 4, 4, 3),
])
def test_one_gpu_per_local_rank(local_rank, local_world_size, gpus, expected):
    assert local_gpu(_env(local_rank, local_world_size), gpus) == expected


@pytest.mark.parametrize("local_rank", [0, 1])  # every rank of the node refuses, none waits
def test_fewer_gpus_than_local_ranks_is_refused_on_every_rank(local_rank):
    with pytest.raises(EnvironmentConfigError) as caught:
        local_gpu(_env(local_rank, 2), 1)
    message = str(caught.value)
    assert message.startswith(f"LOCAL_RANK={local_rank} of LOCAL_WORLD_SIZE=2 on this node, but "
                              "this process sees 1 GPU: phalanx pins each local rank")
    for advice in ("--nproc-per-node gpu", "device_id=0", "backend='gloo'"):
        assert advice in message
    assert "invalid device ordinal" not in message


@pytest.fixture
def one_gpu(monkeypatch):
    """A machine that shows one GPU and has NCCL; a CUDA call that would run fails the test."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)

    def no_cuda(*args, **kwargs):
        raise AssertionError("reached CUDA")

    monkeypatch.setattr(torch.cuda, "set_device", no_cuda)
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize("backend", [None, "nccl"])
def test_init_refuses_two_local_ranks_on_one_gpu_before_cuda(one_gpu, backend):
    with pytest.raises(EnvironmentConfigError, match="LOCAL_RANK=1 of LOCAL_WORLD_SIZE=2"):
        phalanx.init_process_group(backend=backend)
    assert not dist.is_initialized()


def test_get_device_refuses_before_a_process_group(one_gpu):
    with pytest.raises(EnvironmentConfigError, match="this process sees 1 GPU"):
        phalanx.get_device()


def test_a_named_device_is_the_override(one_gpu):
    env = _env(1, 2)
    # backend=None follows the device named, as torch does; Gloo pins it as well
    assert process_group._resolve_backend(None, env, torch.device("cuda", 0)) == "nccl"
    assert process_group._resolve_backend(None, env, torch.device("cpu")) == "gloo"
    assert process_group._pinned_gpu("gloo", env, torch.device("cuda", 0)) == 0
    assert process_group._pinned_gpu("nccl", env, 0) == 0
    assert process_group._pinned_gpu("gloo", env, None) is None  # Gloo alone pins nothing
    with pytest.raises(ValueError, match=r"^device_id cuda:1 is out of range. Please use a device "
                                         r"index less than the number of accelerators available: 1"):
        process_group._pinned_gpu("gloo", env, torch.device("cuda", 1))


def test_one_rank_per_gpu_is_pinned_to_its_local_rank(monkeypatch, one_gpu):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    env = _env(1, 2)
    assert process_group._resolve_backend(None, env) == "nccl"
    assert process_group._pinned_gpu("nccl", env, None) == 1
    assert phalanx.get_device() == torch.device("cuda", 1)
    arguments = DistEnv(rank=1, world_size=2, source="arguments")  # rank= without a launcher
    assert process_group._pinned_gpu("nccl", arguments, None) is None
