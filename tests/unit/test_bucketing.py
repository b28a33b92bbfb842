"""Bucket planning, checked against torch's own assignment function on the reversed parameter list."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from phalanx.ddp.bucketing import FIRST_BUCKET_BYTES, MIB, describe, plan_buckets

DTYPES = [torch.float32, torch.float64, torch.float16]


def _params(seed: int, n: int = 14):
    rng = random.Random(seed)
    return [
        (f"p{i}", torch.nn.Parameter(torch.zeros(rng.choice([3, 500, 70_000, 300_000]), dtype=rng.choice(DTYPES))))
        for i in range(n)
    ]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cap_mb", [0.5, 1, 2])
def test_same_buckets_as_torch_in_reverse_order(seed, cap_mb):
    named = _params(seed)
    plan = plan_buckets(named, int(cap_mb * MIB), FIRST_BUCKET_BYTES)
    reversed_tensors = [p for _, p in reversed(named)]
    expected, _ = dist._compute_bucket_assignment_by_size(reversed_tensors, [FIRST_BUCKET_BYTES, int(cap_mb * MIB)])
    last = len(named) - 1
    assert [[s.index for s in b.slots] for b in plan] == [[last - i for i in b] for b in expected]


@pytest.mark.parametrize("seed", range(4))
def test_caps_list_same_buckets_as_torch(seed):
    """torch's bucket_cap_mb_list: each (device, dtype) steps through the list, the last cap repeats."""
    named = _params(seed, 20)
    caps = [int(mb * MIB) for mb in random.Random(seed).choices([0.1, 0.4, 1.5], k=3)]
    reversed_tensors = [p for _, p in reversed(named)]
    expected, _ = dist._compute_bucket_assignment_by_size(reversed_tensors, caps)
    last = len(named) - 1
    plan = plan_buckets(named, caps=caps)
    assert [[s.index for s in b.slots] for b in plan] == [[last - i for i in b] for b in expected]


def test_slots_dtypes_offsets_and_launch_order():
    named = [
        ("a", torch.nn.Parameter(torch.zeros(2, 3))),
        ("b", torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))),
        ("c", torch.nn.Parameter(torch.zeros(5))),
    ]
    plan = plan_buckets(named, 1 * MIB)
    assert [(b.dtype, [s.name for s in b.slots]) for b in plan] == [
        (torch.float32, ["c", "a"]),  # the last registered parameter comes first
        (torch.float64, ["b"]),
    ]
    c, a = plan[0].slots
    assert (c.offset, c.numel, a.offset, a.shape) == (0, 5, 5, torch.Size([2, 3]))
    assert plan[0].numel == 11 and plan[0].nbytes == 44
    assert describe(plan).splitlines()[0] == "bucket 0: 0.00 MiB torch.float32 on cpu: c, a"


def test_tied_frozen_and_empty():
    shared = torch.nn.Parameter(torch.zeros(10))
    frozen = torch.nn.Parameter(torch.zeros(10), requires_grad=False)
    named = [("emb", shared), ("frozen", frozen), ("out", shared), ("x", torch.nn.Parameter(torch.zeros(2)))]
    plan = plan_buckets(named)
    assert [(s.name, s.index) for s in plan[0].slots] == [("x", 3), ("emb", 0)]
    assert plan_buckets([("frozen", frozen)]) == []


def test_first_bucket_small_then_cap():
    # 0.6 MiB each (fp32): the first bucket closes at 1 MiB (2 tensors), then 3 per 1.5 MiB bucket.
    named = [(f"p{i}", torch.nn.Parameter(torch.zeros(157_286))) for i in range(8)]
    plan = plan_buckets(named, int(1.5 * MIB), FIRST_BUCKET_BYTES)
    assert [[s.index for s in b.slots] for b in plan] == [[7, 6], [5, 4, 3], [2, 1, 0]]
    one_each = plan_buckets(named, 1, 1)
    assert [len(b.slots) for b in one_each] == [1] * 8


@pytest.mark.parametrize("caps", [(0, 1), (1, 0), (-5, 1)])
def test_bad_caps(caps):
    with pytest.raises(ValueError, match="bucket sizes must be positive"):
        plan_buckets(_params(0, 2), *caps)


def test_owners_never_share_a_bucket():
    # reversed order: p5 p4 p3 p2 p1 p0; owners 0 1 0 None 1 0 (by index 0..5)
    named = [(f"p{i}", torch.nn.Parameter(torch.zeros(100_000))) for i in range(6)]  # 0.38 MiB each
    owners = [0, 1, None, 0, 1, 0]
    plan = plan_buckets(named, int(0.7 * MIB), FIRST_BUCKET_BYTES, owners=owners)
    # each owner fills its own open bucket: rank 0's first closes at 1 MiB (3 tensors)
    assert [(b.owner, [s.index for s in b.slots]) for b in plan] == [
        (0, [5, 3, 0]), (1, [4, 1]), (None, [2])]
    assert all(owners[s.index] == b.owner for b in plan for s in b.slots)
    assert describe(plan).splitlines()[1].startswith("bucket 1 for rank 1: 0.76 MiB")
    assert plan_buckets(named, owners=None) == plan_buckets(named, owners=[None] * 6)
    with pytest.raises(ValueError, match="one owner per parameter: 6 parameters, got 2 owners"):
        plan_buckets(named, owners=[0, 1])


def test_caps_per_bucket_and_skipped_parameters():
    # 0.38 MiB each, reversed order p7..p0: caps 0.5, 1, then 0.3 MiB for the rest
    named = [(f"p{i}", torch.nn.Parameter(torch.zeros(100_000))) for i in range(8)]
    caps = (int(0.5 * MIB), 1 * MIB, int(0.3 * MIB))
    plan = plan_buckets(named, caps=caps)
    assert [[s.index for s in b.slots] for b in plan] == [[7, 6], [5, 4, 3], [2], [1], [0]]
    assert plan_buckets(named, 5, 7, caps=(int(0.5 * MIB), 1 * MIB, int(0.3 * MIB))) == plan  # caps win
    assert plan_buckets(named, int(0.3 * MIB), int(0.5 * MIB)) == plan_buckets(
        named, caps=(int(0.5 * MIB), int(0.3 * MIB)))
    # skipped: p6 and its second name "tied" (the same tensor) are in no bucket
    named.append(("tied", named[6][1]))
    skipped = plan_buckets(named, caps=caps, skip=[6])
    assert [[s.index for s in b.slots] for b in skipped] == [[7, 5], [4, 3, 2], [1], [0]]
    assert plan_buckets(named[:1], skip=[0]) == []
    with pytest.raises(ValueError, match=r"bucket sizes must be positive, got caps of \[1, 0\] bytes"):
        plan_buckets(named, caps=(1, 0))
    with pytest.raises(ValueError, match=r"got caps of \[\] bytes"):
        plan_buckets(named, caps=())


@pytest.mark.parametrize("seed", range(3))
def test_reduce_dtype_buckets_every_floating_gradient_in_it(seed):
    """Mixed precision: the buckets are those of the parameters cast to reduce_dtype (torch's
    assignment over them); a complex parameter keeps its own dtype and buckets."""
    named = _params(seed) + [("c", torch.nn.Parameter(torch.zeros(9, dtype=torch.complex64)))]
    plan = plan_buckets(named, MIB, FIRST_BUCKET_BYTES, reduce_dtype=torch.bfloat16)
    cast = [(n, torch.nn.Parameter(p.detach().to(torch.bfloat16)) if p.is_floating_point() else p) for n, p in named]
    same = plan_buckets(cast, MIB, FIRST_BUCKET_BYTES)
    layout = [[(b.dtype, [s.index for s in b.slots]) for b in p] for p in (plan, same)]
    assert layout[0] == layout[1]
    assert {b.dtype for b in plan} == {torch.bfloat16, torch.complex64}
