"""Communication overlaps the backward pass, and buckets start in bucket order on every rank.

Each rank records two kinds of events in one list: ("grad", name) from a hook registered on
every parameter *before* DDP's own (so it fires first), and ("launch", bucket) from a wrapper
around ``torch.distributed.all_reduce`` (the real collective still runs). The model registers
its layers in an order different from the order it uses them, so one bucket is complete
before the bucket in front of it: the reducer must hold it back. A layer that is never used
must not hold its bucket back either: found by the graph walk (find_unused_parameters) or
learned in the first backward (static_graph).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import phalanx
from phalanx.ddp.reference import NaiveDDP
from tests.harness import run_ranks

# Each layer's weight+bias exceeds this cap (in bytes: 1000), so every layer is one bucket.
CAP_MB = 1000 / 2**20


class Shuffled(nn.Module):
    """Registers a, c, b but runs a -> b -> c: gradients arrive c, b, a; buckets are b, c, a."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 40)
        self.c = nn.Linear(24, 16)
        self.b = nn.Linear(40, 24)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


class WithDead(Shuffled):
    """Adds a layer registered last and never used: it alone forms bucket 0."""

    def __init__(self):
        super().__init__()
        self.d = nn.Linear(16, 16)


def _record(model: nn.Module, bucket_cap_mb: float, rank: int, steps: int = 2, **ddp_args):
    events: list[tuple[str, object]] = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, name=name: events.append(("grad", name)))
    ddp = phalanx.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, **ddp_args)
    buffers = [bucket.buffer.data_ptr() for bucket in ddp._runtime.reducer._buckets]  # kept for good
    original = dist.all_reduce

    def recording_all_reduce(tensor, *args, **kwargs):
        if tensor.data_ptr() in buffers:  # a bucket (not the forward's diagnostics check)
            events.append(("launch", buffers.index(tensor.data_ptr())))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = recording_all_reduce
    try:
        per_step = []
        for step in range(steps):
            events.clear()
            torch.manual_seed(10 * step + rank)
            ddp(torch.randn(5, 8)).pow(2).sum().backward()
            per_step.append(list(events))
    finally:
        dist.all_reduce = original
    plan = [[slot.name for slot in spec.slots] for spec in ddp.bucket_plan]
    return per_step, plan, [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def overlapped(events) -> bool:
    """Some all-reduce started before the last gradient of the backward was produced."""
    kinds = [kind for kind, _ in events]
    last_grad = len(kinds) - 1 - kinds[::-1].index("grad")
    return "launch" in kinds[:last_grad]


def _overlap_checks(rank, world_size):
    torch.manual_seed(rank)
    per_step, plan, grads = _record(Shuffled(), CAP_MB, rank)
    # The same model averaged by the naive oracle: gradients must match.
    torch.manual_seed(rank)
    naive = NaiveDDP(Shuffled())
    for step in range(2):
        torch.manual_seed(10 * step + rank)
        naive(torch.randn(5, 8)).pow(2).sum().backward()
        naive.sync_gradients()
    diff = max((g - p.grad).abs().max().item() for g, p in zip(grads, naive.parameters()))
    torch.manual_seed(rank)
    single_bucket, _, _ = _record(Shuffled(), 25, rank, steps=1)
    found, _, _ = _record(WithDead(), CAP_MB, rank, find_unused_parameters=True)
    learned, _, _ = _record(WithDead(), CAP_MB, rank, static_graph=True)
    return {"per_step": per_step, "plan": plan, "diff": diff, "single_bucket": single_bucket[0],
            "found": found, "learned": learned}


@pytest.fixture(scope="module")
def results():
    return run_ranks(_overlap_checks, 2)  # one group of processes for every test here


def test_allreduce_overlaps_backward_in_bucket_order(results):
    for out in results:
        assert out["plan"] == [["b.bias", "b.weight"], ["c.bias", "c.weight"], ["a.bias", "a.weight"]]
        assert out["diff"] < 1e-6
        for events in out["per_step"]:
            launches = [bucket for kind, bucket in events if kind == "launch"]
            assert launches == [0, 1, 2], events
            assert overlapped(events), events
            grads = [name for kind, name in events if kind == "grad"]
            # c's bucket (1) was complete before b's (0) but was launched after it.
            assert grads.index("c.weight") < grads.index("b.weight"), grads
            assert events.index(("launch", 1)) > events.index(("launch", 0)), events
            # the last bucket (its tail reports late gradients) goes when the backward is done
            assert events[-1] == ("launch", 2), events
        # Negative control: one bucket cannot overlap, and the check says so.
        assert not overlapped(out["single_bucket"]), out["single_bucket"]
        assert [e for e in out["single_bucket"] if e[0] == "launch"] == [("launch", 0)]


def _dead_bucket_launch(events) -> int:
    """Position of bucket 0's (the unused layer's) launch among the events."""
    return events.index(("launch", 0))


def test_unused_parameters_do_not_hold_back_their_bucket(results):
    for out in results:
        # find_unused_parameters: the graph walk settles the dead layer at the first hook
        for events in out["found"]:
            assert _dead_bucket_launch(events) == 1, events
            assert [b for kind, b in events if kind == "launch"] == [0, 1, 2, 3]
        # static_graph: the first backward learns it (bucket 0 waits to the end), the next uses it
        first, second = out["learned"]
        assert _dead_bucket_launch(first) == len(first) - 4, first  # after every gradient
        assert _dead_bucket_launch(second) == 1, second
