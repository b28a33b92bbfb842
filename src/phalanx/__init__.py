"""phalanx: data-parallel training for PyTorch.

One process per device, each with a full replica; gradients averaged by bucketed all-reduce
overlapped with the backward pass; a sampler giving every process its own slice; a launcher
that starts and watches the processes; SyncBatchNorm, sharded optimizer state and
crash-safe checkpoints.
"""

from .ddp import DistributedDataParallel
from .env import DistEnv
from .errors import (
    AlreadyInitializedError,
    CheckpointError,
    EnvironmentConfigError,
    NotInitializedError,
    PhalanxError,
    RankMismatchError,
    RendezvousError,
    UnusedParametersError,
)
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
from .sync_batchnorm import SyncBatchNorm
from .zero import ZeroRedundancyOptimizer

__version__ = "0.1.0"

__all__ = [
    "AlreadyInitializedError",
    "CheckpointError",
    "DistEnv",
    "DistributedDataParallel",
    "DistributedSampler",
    "EnvironmentConfigError",
    "NotInitializedError",
    "PhalanxError",
    "RankMismatchError",
    "RendezvousError",
    "SyncBatchNorm",
    "UnusedParametersError",
    "ZeroRedundancyOptimizer",
    "barrier",
    "destroy_process_group",
    "get_device",
    "get_local_rank",
    "get_local_world_size",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "is_initialized",
]
