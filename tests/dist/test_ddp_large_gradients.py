"""Gradients large enough to be divided on their way into their bucket slot
(:data:`phalanx.ddp.bucketing.DIVIDE_INTO_SLOT`), beside small ones copied and divided with the
rest, whatever the bucket layout, the ``.grad`` handling and the accumulation: the same bits as
every gradient copied, then divided with its bucket (phalanx's path for small ones), at world 2
and 3 (a division that rounds); the same bits as torch's DDP at world 2. At world 3 Gloo's ring
sums three values in an order that depends on where its chunks fall in a bucket, and torch's
buckets differ from phalanx's: the last bits may differ there, and do on this model."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import phalanx
from phalanx.ddp import bucketing
from phalanx.ddp.bucketing import DIVIDE_INTO_SLOT
from tests.harness import run_ranks

WIDTH = 256  # a WIDTH x WIDTH weight is the threshold's size: divided into its slot
CASES = {
    "default": dict(),
    "grads kept (set_to_none=False)": dict(set_to_none=False),
    "no bucket views": dict(ddp=dict(gradient_as_bucket_view=False)),
    "one bucket per tensor": dict(ddp=dict(bucket_cap_mb=1e-5)),
    "no_sync accumulation": dict(accumulate=True),
    "no_sync accumulation, no views": dict(accumulate=True, ddp=dict(gradient_as_bucket_view=False)),
    "unused parameter": dict(unused=True, ddp=dict(find_unused_parameters=True)),
}


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.big, self.out = nn.Linear(8, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 3)
        self.spare = nn.Linear(WIDTH, WIDTH)  # large too; unused in the "unused parameter" case

    def forward(self, x, unused=False):
        h = torch.tanh(self.big(torch.tanh(self.inp(x))))
        return self.out(h if unused else torch.tanh(self.spare(h)))


def _train(rank, make, case):
    torch.manual_seed(0)
    model = make(_Net(), **case.get("ddp", {}))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grads = []
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
        opt.zero_grad(set_to_none=case.get("set_to_none", True))
        if case.get("accumulate"):
            with model.no_sync():
                F.cross_entropy(model(x.flip(0), case.get("unused", False)), y).backward()
        F.cross_entropy(model(x, case.get("unused", False)), y).backward()
        grads.append([p.grad.clone() if p.grad is not None else None for p in model.parameters()])
        opt.step()
    return grads, [p.detach().clone() for p in model.parameters()]


def _compare(rank, world_size):
    out = {}
    for name, case in CASES.items():
        runs = {}
        for impl, make in (("unfused", phalanx.DistributedDataParallel), ("torch", TorchDDP),
                           ("phalanx", phalanx.DistributedDataParallel)):
            # "unfused": every gradient copied into its slot, then divided with its bucket
            bucketing.DIVIDE_INTO_SLOT = float("inf") if impl == "unfused" else DIVIDE_INTO_SLOT
            runs[impl] = _train(rank, make, case)
        out[name] = {other: _same(runs["phalanx"], runs[other]) for other in ("unfused", "torch")}
    return out


def _same(a, b) -> float:
    """0.0 where every gradient of every step and every final parameter is the same bits;
    else the largest difference."""
    pairs = [(x, y) for step_a, step_b in zip(a[0], b[0]) for x, y in zip(step_a, step_b)]
    pairs += list(zip(a[1], b[1]))
    if any((x is None) != (y is None) for x, y in pairs):
        return float("inf")
    return max((x.double() - y.double()).abs().max().item() for x, y in pairs if x is not None)


def test_the_threshold_is_what_the_model_assumes():
    assert WIDTH * WIDTH == DIVIDE_INTO_SLOT


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_large_and_small_gradients_average_as_before_and_as_torchs(world_size):
    for rank, out in enumerate(run_ranks(_compare, world_size, timeout=120)):
        for name, got in out.items():
            assert got["unfused"] == 0.0, (rank, name, got)
            assert got["torch"] == 0.0 if world_size == 2 else got["torch"] < 1e-6, (rank, name, got)
