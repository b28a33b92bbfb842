"""DistributedSampler on real ranks: defaults from the process group, one cursor, exact eval."""

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import phalanx
from phalanx import comm
from tests.harness import run_ranks

N = 10  # not divisible by 3 ranks: torch's padding would count 2 samples twice


def _evaluate(loader):
    """Sum of the samples' values and their count, all-reduced once after the loop."""
    totals = torch.zeros(2, dtype=torch.float64)
    for batch in loader:
        totals += torch.stack([batch.double().sum(), torch.tensor(float(len(batch)))])
    dist.all_reduce(totals)
    return totals.tolist()


def _checks(rank, world_size):
    data = torch.arange(N) * 10
    sampler = phalanx.DistributedSampler(data, seed=5)
    out = {"ids": (sampler.rank, sampler.num_replicas)}
    sampler.set_epoch(1)
    loader = DataLoader(data, batch_size=2, sampler=sampler)
    for step, _ in enumerate(loader):
        if step == 1:
            break
    # every rank reports the same global position: 2 samples each, 3 ranks -> 6
    states = comm.all_gather_object(sampler.state_dict(consumed=2))
    out["states_agree"] = all(s == states[0] for s in states)
    out["position"] = states[0]["position"]
    exact = phalanx.DistributedSampler(data, shuffle=False, pad=False)
    padded = phalanx.DistributedSampler(data, shuffle=False)
    out["exact"] = _evaluate(DataLoader(data, batch_size=3, sampler=exact))
    out["padded"] = _evaluate(DataLoader(data, batch_size=3, sampler=padded))
    return out


@pytest.fixture(scope="module")
def checks():
    """Every rank's results of one group of 3 ranks running _checks (the tests below)."""
    return run_ranks(_checks, 3)


def test_defaults_come_from_the_process_group(checks):
    for rank, out in enumerate(checks):
        assert out["ids"] == (rank, 3)


def test_every_rank_reports_the_same_global_cursor(checks):
    for out in checks:
        assert out["states_agree"] and out["position"] == 6


def test_without_padding_evaluation_is_exact(checks):
    true_sum = float(sum(range(N)) * 10)
    for out in checks:
        assert out["exact"] == [true_sum, float(N)]


def test_padding_by_default_counts_samples_twice_as_torch_does(checks):
    true_sum = float(sum(range(N)) * 10)
    for out in checks:
        # torch's behaviour, kept as the default: samples 0 and 1 (values 0, 10) counted twice
        assert out["padded"] == [true_sum + 10.0, float(N + 2)]
