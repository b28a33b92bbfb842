"""Activation checkpointing under phalanx's DDP as under torch's: one checkpoint per layer, and a
block checkpointed twice in one forward with ``static_graph=True``, reentrant or not."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.checkpoint import checkpoint

import phalanx
from tests.harness import error_of, run_ranks


class _Twice(nn.Module):
    """A block run twice per forward, each time under checkpoint."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.block = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        x = checkpoint(self.block, x, use_reentrant=self.reentrant)
        x = checkpoint(self.block, x, use_reentrant=self.reentrant)
        return self.head(x)


def _train(model, rank, reentrant):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randn(4, 6, generator=g, requires_grad=reentrant)  # reentrant needs a grad input
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _both(rank, world_size):
    out = {}
    for reentrant in (True, False):
        torch.manual_seed(0)
        net = _Twice(reentrant)
        theirs = _train(TorchDDP(copy.deepcopy(net), static_graph=True), rank, reentrant)
        ours = phalanx.DistributedDataParallel(copy.deepcopy(net), static_graph=True)
        failed = error_of(_train, ours, rank, reentrant)
        out[reentrant] = failed or max((a - b).abs().max().item() for a, b in zip(ours.parameters(), theirs))
    return out


@pytest.fixture(scope="module")
def twice():
    return run_ranks(_both, 2)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_a_block_checkpointed_twice_with_static_graph_trains_as_torchs(twice, reentrant):
    for out in twice:
        assert out[reentrant] == 0.0, out[reentrant]
