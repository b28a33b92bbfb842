"""BalancedSavePlanner's split of replicated tensors: the bytes each rank must write anyway
(its shards) count, and the largest replicated tensors go first, to the least loaded rank."""

import torch
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.default_planner import create_default_local_save_plan

from phalanx.checkpoint.dcp_engine import balance


def _bytes(plans):
    return [sum(item.tensor_storage_size() for item in plan.items) for plan in plans]


def test_replicated_tensors_go_to_the_least_loaded_rank():
    shared = {"a": torch.zeros(300), "b": torch.zeros(200), "c": torch.zeros(100)}
    own = [{"shard0": torch.zeros(500)}, {"shard1": torch.zeros(100)}]  # uneven shards
    plans = [create_default_local_save_plan({**shared, **own[r]}, r == 0) for r in range(2)]
    mine = _bytes(balance(plans))
    assert sorted(mine) == [2400, 2400] and sum(mine) == 4 * 1200  # 4-byte floats, even
    # DCP's own dedup takes the items in order: the shards, met last, count too late
    theirs = _bytes(dedup_save_plans(plans))
    assert max(theirs) > max(mine), theirs
