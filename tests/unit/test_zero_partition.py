"""ZeroRedundancyOptimizer in one process: the partition rule, and the process group it needs."""

import pytest
import torch

import phalanx
from phalanx.zero import ZeroRedundancyOptimizer, partition_by_size


def test_partition_is_sorted_greedy_and_bounded():
    # largest first, each to the least-loaded rank; ties to the lower index and rank
    assert partition_by_size([5, 9, 1, 9, 3], 2) == ([0, 0, 1, 1, 1], [14, 13])
    assert partition_by_size([4, 4], 3, loads=[0, 1, 0]) == ([0, 2], [4, 1, 4])
    g = torch.Generator().manual_seed(0)
    for world_size in (2, 3, 4):
        sizes = torch.randint(1, 1000, (50,), generator=g).tolist()
        owners, loads = partition_by_size(sizes, world_size)
        assert loads == [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(world_size)]
        assert max(loads) <= sum(sizes) / world_size + max(sizes)


def test_needs_a_process_group():
    with pytest.raises(phalanx.NotInitializedError, match="needs init_process_group"):
        ZeroRedundancyOptimizer([torch.nn.Parameter(torch.zeros(1))], torch.optim.SGD)
