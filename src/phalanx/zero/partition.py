"""Who owns which parameter: sorted-greedy partitioning by size, and state memory.

Pure functions, no communication: every rank computes the same partition from the same sizes.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import torch
from torch.optim import Optimizer


def partition_by_size(
    sizes: Sequence[int], world_size: int, loads: Sequence[int] | None = None
) -> tuple[list[int], list[int]]:
    """Give each item an owner rank, largest item first, always to the least-loaded rank.

    This is sorted-greedy ("longest processing time first") list scheduling. Ties go to the
    lower item index and the lower rank, so every rank computes the same answer. No rank ends
    above ``sum(sizes) / world_size + max(sizes)`` (plus any imbalance already in ``loads``).

    Args:
        sizes: the size of each item (bytes, for parameters).
        world_size: number of ranks.
        loads: each rank's load before these items. Default ``None``: all zero.

    Returns:
        ``(owners, loads)``: the owner rank of each item, and each rank's load afterwards.
    """
    heap = [(load, rank) for rank, load in enumerate(loads or [0] * world_size)]
    heapq.heapify(heap)
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, rank = heapq.heappop(heap)
        owners[i] = rank
        heapq.heappush(heap, (load + sizes[i], rank))
    return owners, [load for load, _ in sorted(heap, key=lambda item: item[1])]


def optimizer_state_bytes(optimizer: Optimizer) -> int:
    """Bytes of the tensors in ``optimizer.state`` (for a ZeRO optimizer: this rank's shard)."""
    return sum(
        value.numel() * value.element_size()
        for per_param in optimizer.state.values()
        for value in per_param.values()
        if isinstance(value, torch.Tensor)
    )
