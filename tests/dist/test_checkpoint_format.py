"""Checkpointer(format="auto"), the default: sharded for a fully_shard model or past one
8-GPU node, consolidated otherwise; and what each choice then writes."""

import pytest
import torch

import phalanx

from phalanx.checkpoint import Checkpointer, dcp_checkpoint
from phalanx.fsdp import fully_shard
from tests.harness import run_ranks


class _Zero(torch.optim.SGD):
    """An optimizer that consolidates its state, as torch's ZeroRedundancyOptimizer does, and
    does not say which rank owns which parameter (phalanx's param_owners)."""

    def consolidate_state_dict(self, to=0):
        pass


def test_auto_picks_by_world_size_and_optimizer(tmp_path, monkeypatch):
    model = torch.nn.Linear(4, 4)
    ckpt = Checkpointer(tmp_path, model)  # no process group: one process
    assert ckpt.format == "consolidated"
    assert ckpt.save(0, 1).name == "ckpt-000000000001.ckpt"
    for world, expected in ((8, "consolidated"), (9, "sharded"), (64, "sharded")):
        monkeypatch.setattr(dcp_checkpoint, "_rank_world", lambda group, w=world: (0, w))
        assert Checkpointer(tmp_path, model).format == expected, world
        zero = _Zero(model.parameters(), lr=0.1)  # the sharded format does not save it
        assert Checkpointer(tmp_path, model, zero, format="auto").format == "consolidated"
    with pytest.raises(TypeError, match="saves phalanx's ZeroRedundancyOptimizer, not _Zero"):
        Checkpointer(tmp_path, model, _Zero(model.parameters(), lr=0.1), format="sharded")
    with pytest.raises(ValueError, match="Invalid format 'fast', expected one of 'consolidated', "
                                         "'sharded', 'auto'"):
        Checkpointer(tmp_path, model, format="fast")


def _sharded(rank, world_size, directory):
    model = fully_shard(torch.nn.Linear(4, 4))
    ckpt = Checkpointer(directory / "fs", model)  # format="auto", the default
    ddp = phalanx.DistributedDataParallel(torch.nn.Linear(4, 4))
    zero = phalanx.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW)
    zero_ckpt = Checkpointer(directory / "zero", ddp, zero)
    return ckpt.format, ckpt.save(0, 1).name, zero_ckpt.format, zero_ckpt.save(0, 1).name


@pytest.mark.slow
def test_auto_shards_a_fully_shard_model_and_a_zero_optimizer(tmp_path):
    """A fully_shard model, and phalanx's ZeroRedundancyOptimizer (the single file would
    gather its whole state on rank 0), even in a small group."""
    name = "ckpt-000000000001.dcp"
    assert run_ranks(_sharded, 1, tmp_path) == [("sharded", name, "sharded", name)]
