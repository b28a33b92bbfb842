"""The sync point's envelope, summed as an all-reduce sums it: every rank reads the same exact
verdict in float32 (the participants, agreement, announcement, flags), at any world size up
to its bound, whatever the order of the sum."""

from __future__ import annotations

import random

import pytest
import torch

from phalanx.ledger import syncpoint


def _summed(heads: list[list[float]], world: int, order: list[int]) -> torch.Tensor:
    """The ranks' envelopes summed in float32, one rank after another in ``order`` (Gloo's
    ring adds the contributions one at a time, in some order)."""
    total = torch.zeros(syncpoint.envelope_size(world), dtype=syncpoint.envelope_dtype(world))
    for rank in order:
        total[:len(heads[rank])] += torch.tensor(heads[rank], dtype=total.dtype)
    return total


@pytest.mark.parametrize("world", [2, 3, 17, 300, 4096])
def test_every_rank_reads_the_same_exact_verdict_up_to_its_bound(world):
    rng = random.Random(world)
    h = syncpoint.fingerprint("DistributedDataParallel forward ()", rng.getrandbits(32))
    announce = (syncpoint.ALL_REDUCE, 0, (1 << 40) + 12345, 7, 255, 0)  # the largest values
    joined = set(rng.sample(range(world), world // 3))  # ranks out of inputs: zeros, flags
    heads = [syncpoint.head(None if r in joined else h, announce, (int(r == world - 1), 0), r, world)
             for r in range(world)]
    order = list(range(world))
    rng.shuffle(order)
    verdict = syncpoint.read(_summed(heads, world, order), world)
    assert verdict.ranks == tuple(r for r in range(world) if r not in joined)
    assert verdict.agree and verdict.announce == announce and verdict.flags == (True, False)
    # one rank elsewhere: no verdict agrees, whichever piece of the fingerprint differs
    for bit in (0, 13, 31):
        other = next(r for r in range(world) if r not in joined)
        heads[other] = syncpoint.head(h ^ (1 << bit), announce, (), other, world)
        assert not syncpoint.read(_summed(heads, world, order), world).agree, bit


def test_the_envelope_is_float32_and_the_same_size_up_to_the_bound():
    assert syncpoint.envelope_dtype(2) == syncpoint.envelope_dtype(65536) == torch.float32
    assert syncpoint.envelope_dtype(65537) == torch.float64
    assert syncpoint.envelope_size(2) == syncpoint.envelope_size(1000) == syncpoint.ENVELOPE
    # the squares of the pieces: 15^2 per rank, exact in float32 up to the bound
    assert 15 ** 2 * syncpoint.FLOAT32_RANKS < 2 ** 24 and 255 * syncpoint.FLOAT32_RANKS < 2 ** 24
    payload = syncpoint.payload(1, (), (), 0, 2)
    assert payload.numel() == syncpoint.ENVELOPE and payload[syncpoint.head_size(2):].eq(0).all()


def test_an_announcement_out_of_range_is_refused_with_the_value():
    with pytest.raises(ValueError, match=r"announces values in \[0, 2\^48\), got -1"):
        syncpoint.head(1, (syncpoint.BROADCAST, 0, 4, -1), (), 0, 2)


@pytest.mark.parametrize("world", [2, 3, 16, 17, 300])
def test_the_unanimous_sums_are_what_agreeing_ranks_sum(world):
    h, announce = syncpoint.fingerprint("DistributedDataParallel forward", 7), (10, 0, 1)
    heads = [syncpoint.head(h, announce, (), r, world) for r in range(world)]
    summed = _summed(heads, world, list(range(world)))
    expected = syncpoint.unanimous(h, announce, world)
    assert summed[:len(expected)].tolist() == expected
    verdict = syncpoint.read(summed, world)
    assert verdict.agree and verdict.ranks == tuple(range(world)) and verdict.announce[:3] == announce
