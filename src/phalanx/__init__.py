"""phalanx: data-parallel training for PyTorch.

One process per device, each with a full replica; gradients averaged by bucketed all-reduce
overlapped with the backward pass; a sampler giving every process its own slice; a launcher
that starts and watches the processes; SyncBatchNorm, sharded optimizer state and
crash-safe checkpoints.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from .env import DistEnv
from .errors import (
    AlreadyInitializedError,
    CheckpointError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    EarlyTerminationError,
    EnvironmentConfigError,
    NotInitializedError,
    PhalanxError,
    RankExitedError,
    RankMismatchError,
    RendezvousError,
    UnusedParametersError,
    UsageError,
)

__version__ = "0.1.0"

# Names from modules that import torch load on first use (PEP 562), so `import phalanx`,
# and with it `phalanx run`, starts without paying torch's import (about 2 s of CPU) before
# the workers start. Export a new name by adding it here, to the TYPE_CHECKING block and to
# __all__; tests/e2e/test_launch_cli.py checks that the launcher's start stays torch-free.
_LAZY = {
    "accumulation_steps": "batch",
    "Checkpointer": "checkpoint",
    "TrainingState": "checkpoint",
    "PreemptionHandler": "checkpoint",
    "DistributedDataParallel": "ddp",
    "FSDPModule": "fsdp",
    "fully_shard": "fsdp",
    "DiLoCo": "model_averaging",
    "LocalSGD": "model_averaging",
    "barrier": "process_group",
    "destroy_process_group": "process_group",
    "get_device": "process_group",
    "get_local_rank": "process_group",
    "get_local_world_size": "process_group",
    "get_rank": "process_group",
    "get_world_size": "process_group",
    "init_process_group": "process_group",
    "is_initialized": "process_group",
    "DistributedSampler": "sampler",
    "StreamingDataset": "streaming",
    "token_loss_scale": "streaming",
    "SyncBatchNorm": "sync_batchnorm",
    "Join": "uneven",
    "join": "uneven",
    "MetricSum": "metrics",
    "straggler_report": "diagnostics",
    "ZeroRedundancyOptimizer": "zero",
    "ShardedGradScaler": "zero",
}

if TYPE_CHECKING:  # what type checkers and IDEs see
    from . import comm_hooks, streaming
    from .batch import accumulation_steps
    from .checkpoint import Checkpointer, PreemptionHandler, TrainingState
    from .ddp import DistributedDataParallel
    from .fsdp import FSDPModule, fully_shard
    from .diagnostics import straggler_report
    from .metrics import MetricSum
    from .model_averaging import DiLoCo, LocalSGD
    from .process_group import (
        barrier,
        destroy_process_group,
        get_device,
        get_local_rank,
        get_local_world_size,
        get_rank,
        get_world_size,
        init_process_group,
        is_initialized,
    )
    from .sampler import DistributedSampler
    from .streaming import StreamingDataset, token_loss_scale
    from .sync_batchnorm import SyncBatchNorm
    from .uneven import Join, join
    from .zero import ShardedGradScaler, ZeroRedundancyOptimizer


# torch.distributed's own collectives and types, reachable as phalanx.X so that
# `import phalanx as dist` replaces `import torch.distributed as dist` in a script: phalanx
# writes no collective of its own, every one of these is torch's; the group collectives are
# checked across ranks and recorded first (phalanx.diagnostics.collectives).
_FROM_TORCH_DISTRIBUTED = frozenset({
    "Backend", "GroupMember", "P2POp", "ProcessGroup", "ReduceOp", "Work",
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_single", "all_reduce", "all_to_all",
    "all_to_all_single", "batch_isend_irecv", "broadcast", "broadcast_object_list", "gather",
    "gather_object", "get_backend", "get_global_rank", "get_group_rank",
    "get_process_group_ranks", "irecv", "is_available", "is_gloo_available",
    "is_nccl_available", "is_torchelastic_launched", "isend", "monitored_barrier", "new_group",
    "recv", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
    "scatter_object_list", "send",
})


# Subpackages reachable as attributes without importing them first (phalanx.comm_hooks.X).
_SUBPACKAGES = frozenset({"comm_hooks", "streaming"})


def __getattr__(name: str):
    if name in _FROM_TORCH_DISTRIBUTED:
        collectives = import_module(".diagnostics.collectives", __name__)
        if name in collectives.CHECKED:  # checked and recorded first (phalanx.diagnostics)
            return collectives.checked(name)
        return getattr(import_module("torch.distributed"), name)
    if name in _SUBPACKAGES:
        return import_module(f".{name}", __name__)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'phalanx' has no attribute {name!r}")
    return getattr(import_module(f".{module}", __name__), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | _FROM_TORCH_DISTRIBUTED)


__all__ = [
    "AlreadyInitializedError",
    "CheckpointError",
    "Checkpointer",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "DiLoCo",
    "DistEnv",
    "FSDPModule",
    "Join",
    "MetricSum",
    "DistributedDataParallel",
    "DistributedSampler",
    "EarlyTerminationError",
    "EnvironmentConfigError",
    "LocalSGD",
    "NotInitializedError",
    "PhalanxError",
    "PreemptionHandler",
    "RankExitedError",
    "RankMismatchError",
    "RendezvousError",
    "ShardedGradScaler",
    "StreamingDataset",
    "SyncBatchNorm",
    "TrainingState",
    "UnusedParametersError",
    "UsageError",
    "ZeroRedundancyOptimizer",
    "accumulation_steps",
    "barrier",
    "comm_hooks",
    "destroy_process_group",
    "fully_shard",
    "get_device",
    "get_local_rank",
    "get_local_world_size",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "is_initialized",
    "join",
    "straggler_report",
    "token_loss_scale",
]
