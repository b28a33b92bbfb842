"""DistributedSampler in one process: parity with torch's, the global cursor, errors."""

import itertools

import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler as TorchSampler

from phalanx import DistributedSampler


def _torch_indices(n, world, rank, shuffle, seed, drop_last, epoch):
    sampler = TorchSampler(range(n), world, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(sampler), len(sampler)


@pytest.mark.parametrize("shuffle, drop_last", list(itertools.product([True, False], repeat=2)))
def test_same_indices_as_torch(shuffle, drop_last):
    for n, world, seed, epoch in itertools.product(
        [1, 2, 3, 5, 7, 10, 16, 33], [1, 2, 3, 4, 5], [0, 7], [0, 3]
    ):
        for rank in range(world):
            ours = DistributedSampler(range(n), world, rank, shuffle, seed, drop_last)
            ours.set_epoch(epoch)
            case = (n, world, rank, seed, epoch)
            expected, expected_len = _torch_indices(n, world, rank, shuffle, seed, drop_last, epoch)
            assert list(ours) == expected, case
            assert len(ours) == expected_len, case
            assert (ours.num_samples, ours.total_size) == (expected_len, expected_len * world)


def _interleave(per_rank):
    """The global order the ranks' lists were taken from (rank r holds positions r, r+R, ...)."""
    longest = max((len(indices) for indices in per_rank), default=0)
    return [ix[i] for i in range(longest) for ix in per_rank if i < len(ix)]


def _samplers(n, world, **kwargs):
    return [DistributedSampler(range(n), world, r, seed=3, **kwargs) for r in range(world)]


def _epoch_order(n, epoch):
    return _torch_indices(n, 1, 0, True, 3, False, epoch)[0]


MODES = [dict(), dict(drop_last=True), dict(pad=False)]


@pytest.mark.parametrize("mode", MODES, ids=["pad", "drop_last", "uneven"])
def test_resume_mid_epoch_at_any_world_size(mode):
    """Stop after k samples per rank, resume at another world size: the rest, exactly once."""
    epoch = 2
    for n, before, after in itertools.product([1, 5, 10, 17], [1, 2, 3], [1, 2, 3, 4]):
        order = _epoch_order(n, epoch)
        first = _samplers(n, before, **mode)
        for sampler in first:
            sampler.set_epoch(epoch)
        full = [list(s) for s in first]
        for k in range(min(len(s) for s in first) + 1):
            states = [s.state_dict(consumed=k) for s in first]
            assert all(state == states[0] for state in states), (n, before, k)  # one global cursor
            position = states[0]["position"]
            done = _interleave([ix[:k] for ix in full])
            second = _samplers(n, after, **mode)
            for sampler in second:
                sampler.load_state_dict(states[0])
                sampler.set_epoch(epoch)  # the loaded epoch: keeps the position
            rest = [list(s) for s in second]
            assert [len(ix) for ix in rest] == [len(s) for s in second]
            case = (n, before, after, k, position)
            if before == after:  # exactly what the uninterrupted run would have served
                assert rest == [ix[k:] for ix in full], case
            served = _interleave(rest)
            if mode.get("drop_last"):
                assert position == (n if k == len(first[0]) else k * before), case
                assert served == order[position : position + len(served)], case
                assert len(served) == (n - position) // after * after, case
            else:
                assert position == min(k * before, n), case
                assert done[:position] == order[:position], case
                assert served[: n - position] == order[position:], case
                padding = served[n - position :]
                assert (padding == []) if mode.get("pad") is False else (len(padding) < after), case


def test_chained_resumes_cover_the_epoch_exactly_once():
    order = _epoch_order(23, 0)
    seen, state = [], None
    for world, k in [(3, 2), (2, 3), (4, 1), (1, None)]:
        samplers = _samplers(23, world, pad=False)
        if state is not None:
            for sampler in samplers:
                sampler.load_state_dict(state)
        lists = [list(s) for s in samplers]
        k = max(len(ix) for ix in lists) if k is None else k
        seen += _interleave([ix[:k] for ix in lists])
        state = samplers[0].state_dict(consumed=min(k, len(samplers[0])))
    assert seen == order and state["position"] == 23


def test_default_consumed_counts_what_the_iterator_handed_out():
    sampler = DistributedSampler(range(20), num_replicas=2, rank=1)
    sampler.set_epoch(1)
    assert sampler.state_dict()["position"] == 0
    it = iter(sampler)
    for _ in range(3):
        next(it)
    assert sampler.state_dict() == {
        "epoch": 1, "position": 6, "dataset_length": 20, "seed": 0, "shuffle": True
    }
    assert sampler.state_dict(consumed=1)["position"] == 2  # the loop knows better (prefetch)
    # a DataLoader without workers draws one batch at a time: the count is exact
    loader = DataLoader(range(20), batch_size=4, sampler=sampler)
    batches = iter(loader)
    next(batches), next(batches)
    assert sampler.state_dict()["position"] == 16
    sampler.set_epoch(2)  # a new epoch starts from its beginning
    assert sampler.state_dict()["position"] == 0 and len(sampler) == 10


def test_loaded_position_holds_until_another_epoch():
    sampler = DistributedSampler(range(10), num_replicas=2, rank=0, shuffle=False)
    sampler.load_state_dict({"epoch": 4, "position": 6, "dataset_length": 10, "seed": 0,
                             "shuffle": False})
    assert sampler.epoch == 4 and len(sampler) == 2
    sampler.set_epoch(4)
    assert list(sampler) == [6, 8] and list(sampler) == [6, 8]
    assert sampler.state_dict()["position"] == 10  # both ranks through: the end of the epoch
    sampler.set_epoch(5)
    assert list(sampler) == [0, 2, 4, 6, 8]


def test_uneven_shards_have_no_duplicates():
    for n, world in itertools.product([1, 2, 7, 10], [2, 3, 4]):
        lists = [list(s) for s in _samplers(n, world, pad=False)]
        assert sorted(itertools.chain(*lists)) == list(range(n)), (n, world)
        assert max(map(len, lists)) - min(map(len, lists)) <= 1


def test_defaults_from_the_environment(monkeypatch):
    for key, value in dict(RANK="1", WORLD_SIZE="4", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT="29500").items():
        monkeypatch.setenv(key, value)
    sampler = DistributedSampler(range(10), shuffle=False)
    assert (sampler.rank, sampler.num_replicas, list(sampler)) == (1, 4, [1, 5, 9])


class _NoLen(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(())


@pytest.mark.parametrize(
    "args, kind, message",
    [
        ((range(5), 0, 0), ValueError, "Invalid num_replicas 0, num_replicas should be a positive integer"),
        ((range(5), -2, 0), ValueError, "Invalid num_replicas -2"),
        ((range(5), 3, 3), ValueError, "Invalid rank 3, rank should be in the interval [0, 2]"),
        ((range(5), 3, -1), ValueError, "Invalid rank -1, rank should be in the interval [0, 2]"),
        ((range(5), 2.0, 0), ValueError, "Invalid num_replicas 2.0, num_replicas should be a "),
        ((_NoLen(), 2, 0), TypeError, "needs a data set with a length (a map-style Dataset), got _NoLen"),
    ],
)
def test_bad_arguments(args, kind, message):
    with pytest.raises(kind) as info:
        DistributedSampler(*args)
    assert message in str(info.value)


def test_what_torch_takes_it_takes():
    import numpy as np

    ours = DistributedSampler(range(10), num_replicas=np.int64(3), rank=np.int32(2), seed=4)
    theirs = TorchSampler(range(10), num_replicas=np.int64(3), rank=np.int32(2), seed=4)
    assert (list(ours), ours.rank, ours.num_samples) == (list(theirs), 2, theirs.num_samples)
    empty = DistributedSampler(range(0), num_replicas=2, rank=1)  # torch samples nothing
    assert list(empty) == list(TorchSampler(range(0), num_replicas=2, rank=1)) == []
    assert len(empty) == 0 and empty.state_dict()["position"] == 0


def test_bad_states():
    sampler = DistributedSampler(range(10), num_replicas=2, rank=0)
    good = sampler.state_dict()
    cases = [
        ({"epoch": 0}, "missing position, dataset_length, seed, shuffle"),
        ({**good, "dataset_length": 12}, "saved with dataset_length=12 but this sampler has dataset_length=10"),
        ({**good, "seed": 1}, "saved with seed=1 but this sampler has seed=0"),
        ({**good, "shuffle": False}, "saved with shuffle=False but this sampler has shuffle=True"),
        ({**good, "position": 11}, "position 11, expected an integer in [0, 10]"),
    ]
    for state, message in cases:
        with pytest.raises(ValueError) as info:
            sampler.load_state_dict(state)
        assert message in str(info.value)
    for consumed in (-1, 1.5, True):
        with pytest.raises(ValueError) as info:
            sampler.state_dict(consumed=consumed)
        assert (f"Invalid consumed {consumed}, consumed should be a non-negative integer, at "
                "most 5 counted") in str(info.value)
    # past the share (batches_done * batch_size after a partial last batch): the whole share
    assert sampler.state_dict(consumed=7) == sampler.state_dict(consumed=5)
    assert sampler.state_dict(consumed=5)["position"] == 10
