"""Exact evaluation: MetricSum over DistributedSampler(pad=False) shards of unequal length
(one of them empty) equals one process evaluating the whole set, every sample counted once."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from tests.harness import error_of, run_ranks


def _evaluate(world_size):
    """(shard sizes, distributed totals, one-process totals) for sets of 7 and 3 samples."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    out = []
    for length in (7, 3):
        g = torch.Generator().manual_seed(length)
        data = TensorDataset(torch.randn(length, 5, generator=g), torch.randint(0, 3, (length,), generator=g))
        sampler = phalanx.DistributedSampler(data, shuffle=False, pad=False) if world_size > 1 else None
        sums = phalanx.MetricSum("loss", "correct", "samples")
        for x, y in DataLoader(data, batch_size=2, sampler=sampler):
            logits = model(x)
            sums.add(loss=F.cross_entropy(logits, y, reduction="sum"),
                     correct=(logits.argmax(1) == y).sum(), samples=len(y))
        x, y = data.tensors
        whole = {"loss": F.cross_entropy(model(x), y, reduction="sum").item(),
                 "correct": float((model(x).argmax(1) == y).sum()), "samples": float(length)}
        out.append((length if sampler is None else len(sampler), sums.compute(), whole))
    return out


def _rank(rank, world_size):
    result = _evaluate(world_size)
    result.append(error_of(phalanx.MetricSum, "loss", "loss"))
    result.append(error_of(phalanx.MetricSum("loss").add, accuracy=1))
    return result


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_metric_sums_equal_one_process_on_the_whole_set(world_size):
    results = [_rank(0, 1)] if world_size == 1 else run_ranks(_rank, world_size)
    for rank, (seven, three, twice, unknown) in enumerate(results):
        for (shard, totals, whole), length in ((seven, 7), (three, 3)):
            assert totals["samples"] == length and totals["correct"] == whole["correct"]
            assert abs(totals["loss"] - whole["loss"]) < 1e-5
        assert twice == ("ValueError", "MetricSum's names must differ, got ('loss', 'loss')")
        assert unknown == ("ValueError", "MetricSum has no sum named 'accuracy'; it keeps ['loss']")
    shards = [r[1][0] for r in results]  # of the set of 3
    assert sum(shards) == 3 and (world_size < 4 or 0 in shards)  # an empty shard at 4 ranks
