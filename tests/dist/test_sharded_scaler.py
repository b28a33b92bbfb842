"""GradScaler with ZeRO stage 2: an inf in one rank's shard of the gradients makes every rank
skip the step and halve its scale (phalanx.ShardedGradScaler); torch's own GradScaler there is
named by the sync point, with the fix, instead of hanging."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import phalanx
from tests.harness import error_of, run_ranks


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])


def _zero2(scaler_class):
    ddp = phalanx.DistributedDataParallel(_model(), bucket_cap_mb=0.0001)  # a bucket per tensor
    opt = phalanx.ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    ddp.shard_gradients(opt)
    return ddp, opt, scaler_class(device="cpu", init_scale=2.0 ** 10)


def _step(ddp, opt, scaler, rank, poisoned=None):
    """One step; ``poisoned``: a parameter whose gradient is inf (on every rank: after the
    reduction only its owner holds it)."""
    hook = None if poisoned is None else poisoned.register_hook(lambda g: torch.full_like(g, float("inf")))
    opt.zero_grad()
    scaler.scale(ddp(torch.randn(4, 8) + rank).square().sum()).backward()
    if hook is not None:
        hook.remove()
    scaler.step(opt)
    scaler.update()


def _agreed_skips(rank, world_size):
    ddp, opt, scaler = _zero2(phalanx.ShardedGradScaler)
    params = list(ddp.parameters())
    owners = opt.owners_of(params)
    out = []
    for target in range(world_size):  # an inf in each rank's shard in turn
        before = [p.detach().clone() for p in params]
        _step(ddp, opt, scaler, rank, poisoned=params[owners.index(target)])
        skipped = all(torch.equal(a, b) for a, b in zip(before, params))
        out.append((target, skipped, scaler.get_scale()))
        _step(ddp, opt, scaler, rank)  # a clean step: every rank steps
        moved = not all(torch.equal(a, b) for a, b in zip(before, params))
        out.append(("clean", moved, scaler.get_scale()))
    return out, [p.tolist() for p in params]


@pytest.mark.parametrize("world_size", [2, 3])
def test_an_inf_in_any_ranks_shard_skips_the_step_on_every_rank(world_size):
    results = run_ranks(_agreed_skips, world_size)
    expected, scale = [], 2.0 ** 10
    for target in range(world_size):
        scale /= 2  # backoff_factor 0.5 at each inf, on every rank
        expected += [(target, True, scale), ("clean", True, scale)]
    for steps, _ in results:
        assert steps == expected
    assert all(weights == results[0][1] for _, weights in results)  # the replicas agree


def _torchs_scaler(rank, world_size):
    ddp, opt, scaler = _zero2(torch.amp.GradScaler)
    params = list(ddp.parameters())
    poisoned = params[opt.owners_of(params).index(0)]
    return error_of(lambda: [_step(ddp, opt, scaler, rank, poisoned), _step(ddp, opt, scaler, rank)])


def test_torchs_scaler_with_sharded_gradients_is_named_with_the_fix():
    for error in run_ranks(_torchs_scaler, 2):
        assert error is not None and error[0] == "CollectiveMismatchError", error
        assert "ZeroRedundancyOptimizer.step" in error[1], error
        assert error[1].endswith("use phalanx.ShardedGradScaler in place of torch's GradScaler: "
                                 "it agrees on the skip"), error
