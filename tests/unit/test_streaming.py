"""StreamingDataset: exact coverage, the same global order at any world size and worker count,
epochs that differ, the position a resume starts from, and a real DataLoader with workers.

Ranks and workers are simulated in one process through the data set's own partition (the
batches each worker makes, taken round robin as torch's DataLoader takes them); one test runs
real DataLoader workers and checks they give exactly what the simulation says.
"""

import itertools
import os
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import phalanx
from phalanx.streaming import Layout

# shard sizes: 24 samples dividing evenly over 1-4 ranks x batch 2 at some world sizes, 29 that
# do not (with a one-sample shard), and a single shard
SHARDINGS = {"even": [6, 6, 6, 6], "uneven": [7, 5, 1, 9, 3, 4], "single": [11]}


def write_shards(directory, sizes):
    """``.npy`` shards whose rows hold their own sample id."""
    start = 0
    for i, n in enumerate(sizes):
        np.save(directory / f"shard-{i:03d}.npy", np.arange(start, start + n, dtype=np.int64)[:, None])
        start += n
    return str(directory / "*.npy")


def rank_stream(data, workers):
    """The sample ids a DataLoader over ``data`` with ``workers`` workers delivers, in order:
    each worker makes every ``workers``-th batch of the rank, taken round robin."""
    layout = data.layout()
    per_worker = [layout.worker_batches(data.rank, w, workers) for w in range(max(workers, 1))]
    order = data.order()
    batches = [b for group in itertools.zip_longest(*per_worker) for b in group if b is not None]
    return [[int(order[p % order.numel()]) for p in range(*b)] for b in batches]


def datasets(pattern, world, **kwargs):
    return [phalanx.StreamingDataset(pattern, num_replicas=world, rank=r, **kwargs)
            for r in range(world)]


@pytest.mark.parametrize("sharding", list(SHARDINGS))
def test_every_sample_exactly_once_any_world_and_workers(tmp_path, sharding):
    pattern = write_shards(tmp_path, SHARDINGS[sharding])
    total = sum(SHARDINGS[sharding])
    for world in range(1, 5):
        exact, dropped, padded = (datasets(pattern, world, batch_size=2, ends=ends, seed=3)
                                  for ends in ("uneven", "drop", "pad"))
        for workers in (0, 1, 3):
            why = f"{sharding} shards, world {world}, {workers} workers"
            ids = [i for d in exact for batch in rank_stream(d, workers) for i in batch]
            assert sorted(ids) == list(range(total)), why
            drop = [i for d in dropped for batch in rank_stream(d, workers) for i in batch]
            assert len(set(drop)) == len(drop) == total // world * world, why
            pad = [i for d in padded for batch in rank_stream(d, workers) for i in batch]
            assert len(pad) == -(-total // world) * world and set(pad) == set(range(total)), why
            # padding repeats the epoch's first samples, as torch's DistributedSampler pads
            extra = Counter(pad) - Counter(range(total))
            first = padded[0].order()[: len(pad) - total].tolist()
            assert sorted(extra.elements()) == sorted(first), why
            assert all(len(d) == len(pad) // world for d in padded), why


def test_same_global_order_at_world_1_2_3(tmp_path):
    pattern = write_shards(tmp_path, SHARDINGS["uneven"])
    orders = {}
    for world in (1, 2, 3):
        ranks = datasets(pattern, world, batch_size=2, ends="uneven", seed=7, shuffle_block=8)
        streams = [rank_stream(d, 3) for d in ranks]
        # global step j: rank 0's j-th batch, then rank 1's, ...
        orders[world] = [i for step in itertools.zip_longest(*streams) for b in step if b for i in b]
        assert orders[world] == ranks[0].order().tolist()
    assert orders[1] == orders[2] == orders[3]
    assert orders[1] != sorted(orders[1])  # shuffled


def test_epochs_differ_and_shuffle_stages(tmp_path):
    pattern = write_shards(tmp_path, SHARDINGS["uneven"])
    data = phalanx.StreamingDataset(pattern, batch_size=2, ends="drop", num_replicas=1, rank=0)
    first = data.order().tolist()
    data.set_epoch(1)
    assert data.order().tolist() != first and sorted(data.order().tolist()) == sorted(first)
    data.set_epoch(0)
    assert data.order().tolist() == first  # a function of (seed, epoch) only
    plain = phalanx.StreamingDataset(pattern, batch_size=2, ends="drop", num_replicas=1, rank=0,
                                     shuffle=False)
    assert plain.order().tolist() == list(range(29))
    # a window of 1 keeps each shard's samples together (only the two shard-level shuffles)
    blocked = phalanx.StreamingDataset(pattern, batch_size=2, ends="drop", num_replicas=1, rank=0,
                                       shuffle_block=1)
    shard_of = torch.repeat_interleave(torch.arange(6), torch.tensor(SHARDINGS["uneven"]))
    runs = [k for k, _ in itertools.groupby(shard_of[blocked.order()].tolist())]
    assert sorted(runs) == list(range(6)) and runs != list(range(6))


def _reference_order(sizes, seed, epoch, block):
    """The documented stages, written plainly: float keys and torch's stable argsort."""
    from phalanx.streaming.order import _generator
    place = torch.empty(len(sizes), dtype=torch.float64)
    place[torch.randperm(len(sizes), generator=_generator(seed, epoch, 1))] = torch.arange(
        len(sizes), dtype=torch.float64)
    shard_of = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    total = sum(sizes)
    key = place[shard_of] + torch.rand(total, generator=_generator(seed, epoch, 2),
                                       dtype=torch.float64)
    order = torch.argsort(key, stable=True)
    key = (torch.arange(total) // block).double() + torch.rand(
        total, generator=_generator(seed, epoch, 3), dtype=torch.float64)
    return order[torch.argsort(key, stable=True)]


@pytest.mark.parametrize("threads", [1, 2])
def test_global_order_is_the_documented_stages(threads):
    """The order's fast sorts (float keys sorted as int64 bits, padded to torch's radix sort
    in one-thread processes) give the stages' order exactly, below, in and above the padding."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for sizes, block in (([7, 5, 1, 9, 3, 4], 8), ([1000] * 10, 1 << 16),
                             ([900, 1, 3100, 5000] * 3, 2048), ([20_000, 20_001], 30_000)):
            for epoch in (0, 1):
                want = _reference_order(sizes, 3, epoch, block)
                got = phalanx.streaming.global_order(sizes, 3, epoch, shuffle_block=block)
                assert torch.equal(got, want), (sizes, block, epoch)
    finally:
        torch.set_num_threads(before)


def test_resume_position_at_another_world_size(tmp_path):
    """Stopped after 2 batches at world 3, resumed at world 2 and at world 4 with 3 workers:
    the consumed and the resumed ids make one epoch, each once."""
    pattern = write_shards(tmp_path, SHARDINGS["uneven"])
    before = datasets(pattern, 3, batch_size=2, ends="uneven", seed=1)
    for d in before:
        d.set_epoch(4)
    taken = [i for d in before for batch in rank_stream(d, 2)[:2] for i in batch]
    states = [d.state_dict(consumed=4) for d in before]
    assert all(s == states[0] for s in states) and states[0]["position"] == 12
    for world in (2, 4):
        after = datasets(pattern, world, batch_size=3, ends="uneven", seed=1)
        for d in after:
            d.load_state_dict(states[0])
            d.set_epoch(4)  # the restored epoch: keeps the position
        rest = [i for d in after for batch in rank_stream(d, 3) for i in batch]
        assert sorted(taken + rest) == list(range(29)), world
        assert sum(len(d) for d in after) == 29 - 12


def test_state_dict_refuses_what_it_cannot_know(tmp_path):
    pattern = write_shards(tmp_path, [5])
    data = phalanx.StreamingDataset(pattern, batch_size=2, ends="drop", num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="needs consumed=batches_done"):
        data.state_dict()
    with pytest.raises(ValueError, match="multiple of batch_size 2"):
        data.state_dict(consumed=3)
    assert data.state_dict(consumed=9)["position"] == 5  # past the share: the epoch is done
    list(itertools.islice(iter(data), 2))  # num_workers=0: this process counts
    assert data.state_dict()["position"] == 2
    other = phalanx.StreamingDataset(pattern, batch_size=2, ends="drop", num_replicas=1, rank=0,
                                     seed=9)
    with pytest.raises(ValueError, match="seed=0 but this data set has seed=9"):
        other.load_state_dict(data.state_dict(consumed=2))
    with pytest.raises(ValueError, match="Invalid ends None"):
        phalanx.StreamingDataset(pattern, batch_size=2, ends=None)


def test_real_dataloader_workers_match_the_partition(tmp_path):
    """Three ranks' DataLoaders with 2 persistent workers each, over two epochs: every batch is
    the one the partition says, the union is one epoch, and set_epoch reaches the workers."""
    pattern = write_shards(tmp_path, SHARDINGS["uneven"])
    ranks = datasets(pattern, 3, batch_size=2, ends="uneven", seed=2)
    loaders = [DataLoader(d, batch_size=2, num_workers=2, persistent_workers=True,
                          prefetch_factor=3) for d in ranks]
    epochs = []
    for epoch in (0, 1):
        got = []
        for d, loader in zip(ranks, loaders):
            d.set_epoch(epoch)
            batches = [b[:, 0].tolist() for b in loader]
            assert batches == rank_stream(d, 2), (epoch, d.rank)
            got += [i for b in batches for i in b]
        assert sorted(got) == list(range(29))
        epochs.append(got)
    assert epochs[0] != epochs[1]


def _sources(tmp_path, kind):
    """Sources of the ``uneven`` sizes (29 samples) whose samples tell their id (see ``_id``):
    rows of mapped files read by gathers ("npy", "tokens"), one-sample shards (a row view
    each), long rows (gathers of a few rows each), and readers of any kind."""
    sizes = SHARDINGS["uneven"]
    if kind == "npy":
        return write_shards(tmp_path, sizes)
    if kind == "one-sample shards":
        return write_shards(tmp_path, [1] * 29)
    if kind in ("tokens", "long rows"):
        seq_len = 2 if kind == "tokens" else 12_000  # 2 rows per gather at most (32768 elements)
        ids = torch.arange(29).repeat_interleave(seq_len)
        directory = tmp_path / "tok"
        for i, (start, n) in enumerate(zip(itertools.accumulate([0] + sizes), sizes)):
            phalanx.streaming.write_token_shards(ids[start * seq_len:(start + n) * seq_len],
                                                 directory / f"{i:02d}", seq_len, n)
        return [phalanx.streaming.TokenFiles(directory / f"{i:02d}", seq_len=seq_len)
                for i in range(len(sizes))]
    lines = tmp_path / "records.jsonl"  # readers of any kind: JSON Lines and a user's reader
    lines.write_text("".join(f'{{"id": {i}}}\n' for i in range(7)))

    class Ids:
        def __init__(self, start, n):
            self.name, self.start, self.n = f"ids-{start}", start, n

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            return self.start + i

    return [str(lines)] + [Ids(start, n) for start, n in
                           zip(itertools.accumulate([7] + sizes[1:]), sizes[1:])]


def _id(sample):
    if isinstance(sample, dict):
        return sample["id"]
    return int(sample) if not isinstance(sample, torch.Tensor) else int(sample.reshape(-1)[0])


@pytest.mark.parametrize("kind", ["npy", "tokens", "one-sample shards", "long rows", "any"])
def test_iteration_serves_the_partition(tmp_path, kind, monkeypatch):
    """What __iter__ yields, read in chunks of 3 batches, is what the partition says, for every
    kind of reader, padded and uneven ends, and resumed; and the count state_dict() takes
    without workers is exact after whole batches."""
    monkeypatch.setattr(phalanx.streaming.dataset, "_CHUNK_SAMPLES", 6)
    if kind != "one-sample shards":  # gathers however few samples a shard (else a view each)
        monkeypatch.setattr(phalanx.streaming.dataset, "_GATHER_FROM", 0)
    sources = _sources(tmp_path, kind)
    for ends, world in (("pad", 3), ("uneven", 2)):
        ranks = datasets(sources, world, batch_size=2, ends=ends, seed=5, shuffle_block=8)
        for d in ranks:
            d.set_epoch(2)
            want = rank_stream(d, 0)
            got = list(d)
            assert [_id(x) for x in got] == [i for b in want for i in b], (kind, ends, d.rank)
            if kind in ("npy", "tokens"):  # rows, as __getitem__ gives them
                assert all(x.shape == d.readers[0][0].shape for x in got)
        state = ranks[0].state_dict(consumed=4)
        for d in ranks:
            d.load_state_dict(state)
            d.set_epoch(2)
            assert [_id(x) for x in d] == [i for b in rank_stream(d, 0) for i in b]
    data = datasets(sources, 1, batch_size=3, ends="drop", shuffle=False,
                    transform=lambda x: ("t", _id(x)))[0]
    it = iter(data)
    assert [next(it) for _ in range(6)] == [("t", i) for i in range(6)]
    assert data.state_dict()["position"] == 6  # two whole batches yielded
    next(it)
    with pytest.raises(ValueError, match="multiple of batch_size 3"):
        data.state_dict()  # mid-batch: not a position of the order
    assert [x[1] for x in it] == list(range(7, 29))  # one rank drops nothing
    assert data.state_dict()["position"] == 29


def test_iteration_in_workers_reads_chunks(tmp_path, monkeypatch):
    """Two DataLoader workers reading token rows in chunks of 1, then 3 batches give the
    partition."""
    monkeypatch.setattr(phalanx.streaming.dataset, "_CHUNK_SAMPLES", 6)
    monkeypatch.setattr(phalanx.streaming.dataset, "_GATHER_FROM", 0)
    data = datasets(_sources(tmp_path, "tokens"), 3, batch_size=2, ends="pad", seed=4)[1]
    loader = DataLoader(data, batch_size=2, num_workers=2, multiprocessing_context="fork")
    assert [b[:, 0].tolist() for b in loader] == rank_stream(data, 2)


def test_worker_chunks_start_at_one_batch(tmp_path, monkeypatch):
    """In a DataLoader worker the first chunk is one batch (the main process waits for the first
    batch), each next four times the last, up to the chunk limit; without workers every chunk
    is whole. Both serve the partition."""
    monkeypatch.setattr(phalanx.streaming.dataset, "_CHUNK_SAMPLES", 40)  # 20 batches of 2
    sizes = []
    read = phalanx.StreamingDataset._read
    monkeypatch.setattr(phalanx.StreamingDataset, "_read",
                        lambda self, ids: sizes.append(ids.numel()) or read(self, ids))
    data = datasets(write_shards(tmp_path, [80, 37]), 1, batch_size=2, ends="uneven")[0]
    assert [_id(x) for x in data] == [i for b in rank_stream(data, 0) for i in b]
    assert sizes == [40, 40, 37]  # 117 samples: 58 batches of 2 and one of 1
    sizes.clear()
    ours = data.layout().worker_batches(0, 1, 2)  # worker 1 of 2: 29 batches of 2
    got = itertools.chain.from_iterable(data._batches(ours, ramp=True))
    assert [_id(x) for x in got] == [int(data.order()[p]) for b in ours for p in range(*b)]
    assert sizes == [2, 8, 32, 16]


def test_rows_cache_stays_in_its_process(tmp_path):
    """The shards' rows a process caches (views of its maps) are not pickled to workers, and a
    copy started elsewhere (another pid) makes its own."""
    import pickle
    data = datasets(_sources(tmp_path, "tokens"), 1, batch_size=2, ends="drop", seed=2)[0]
    first = [_id(x) for x in data]
    assert data._rows_cache and data._rows_pid == os.getpid()
    copy = pickle.loads(pickle.dumps(data))
    assert copy._rows_cache == {} and copy._rows_pid == -1
    assert [_id(x) for x in copy] == first
    copy._rows_pid = -2  # as if forked: the cache is another process's
    stale = copy._rows_cache
    assert [_id(x) for x in copy] == first
    assert copy._rows_pid == os.getpid() and copy._rows_cache is not stale


def test_order_runs_on_one_thread_and_restores_the_count(monkeypatch):
    """The order's sorts run on one torch thread (a parallel radix sort on busy cores costs
    10-20x), and the process's thread count is restored, after an error too."""
    from phalanx.streaming import order
    seen = []
    argsort = order._argsort
    monkeypatch.setattr(order, "_argsort", lambda key: seen.append(torch.get_num_threads())
                        or argsort(key))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        order.global_order([40_000, 5], 1, 0)
        assert seen == [1, 1] and torch.get_num_threads() == 2
        monkeypatch.setattr(order, "_argsort", lambda key: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            order.global_order([3, 4], 1, 0)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def _one(source, **kwargs):
    return phalanx.StreamingDataset(source, batch_size=2, ends="uneven", num_replicas=1, rank=0,
                                    **kwargs)


def test_bad_input_names_the_file(tmp_path):
    good = write_shards(tmp_path, [3])
    tmp_path = tmp_path / "bad"
    tmp_path.mkdir()
    empty = tmp_path / "empty.npy"
    np.save(empty, np.zeros((0, 1), dtype=np.int64))
    with pytest.raises(ValueError, match=f"{empty}: empty shard"):
        _one([good, str(empty)])
    with pytest.raises(FileNotFoundError, match="No such file or directory: .*missing.npy"):
        _one([good, str(tmp_path / "missing.npy")])
    with pytest.raises(FileNotFoundError, match="No files match the pattern: .*nothing-\\*.npy"):
        _one(str(tmp_path / "nothing-*.npy"))
    cut = tmp_path / "cut.npy"
    cut.write_bytes((tmp_path.parent / "shard-000.npy").read_bytes()[:-5])
    with pytest.raises(ValueError, match=f"{cut}: corrupt .npy: the header says shape"):
        _one(str(cut))
    garbage = tmp_path / "garbage.npy"
    garbage.write_bytes(b"not an array at all")
    with pytest.raises(ValueError, match=f"{garbage}: not a .npy file"):
        _one(str(garbage))
    odd = tmp_path / "odd.bin"
    odd.write_bytes(bytes(10))
    with pytest.raises(ValueError, match=f"{odd}: corrupt token file: 10 bytes"):
        _one(phalanx.streaming.TokenFiles(odd, seq_len=2))  # 4-byte samples of uint16
    with pytest.raises(ValueError, match="no reader for files ending '.txt'"):
        (tmp_path / "notes.txt").write_text("x")
        _one(str(tmp_path / "notes.txt"))
    with pytest.raises(TypeError, match="got int"):
        _one([good, 3])


def test_corrupt_jsonl_record_fails_in_a_worker_naming_file_and_record(tmp_path):
    lines = tmp_path / "records.jsonl"
    lines.write_text('{"id": 0}\n\n{"id": 1}\n{"id": 2, oops}\n{"id": 3}\n')
    data = _one(str(lines), shuffle=False)
    assert len(data) == 4  # the blank line is not a record
    assert [data.sample(i) for i in range(2)] == [{"id": 0}, {"id": 1}]
    with pytest.raises(ValueError, match=f"{lines}: corrupt record 2 \\(the line at byte 21\\)"):
        list(DataLoader(data, batch_size=2, num_workers=1, collate_fn=list))


def test_token_files_and_user_readers(tmp_path):
    """Raw token shards written by the helper read back whole; a user's reader plugs in."""
    tokens = torch.arange(50) % 7
    paths = phalanx.streaming.write_token_shards(tokens, tmp_path / "tok", seq_len=4,
                                                 samples_per_shard=5)
    assert len(paths) == 3  # 12 samples of 4 (2 tokens left out) in shards of 5, 5, 2
    data = _one(phalanx.streaming.TokenFiles(tmp_path / "tok", seq_len=4), shuffle=False)
    assert torch.equal(torch.stack(list(data)).long(), tokens[:48].reshape(12, 4))

    class Squares:
        name = "squares"

        def __len__(self):
            return 5

        def __getitem__(self, i):
            return i * i

    mixed = _one([Squares(), phalanx.streaming.TokenFiles(paths[2], seq_len=4)], shuffle=False)
    assert [mixed.sample(i) for i in range(5)] == [0, 1, 4, 9, 16] and len(mixed) == 7


def test_token_loss_scale_alone_and_its_errors():
    assert phalanx.token_loss_scale(8) == 1 / 8  # one process: the plain per-token mean
    assert phalanx.token_loss_scale(torch.tensor(4), mean_over_ranks=False) == 1 / 4
    with pytest.raises(ValueError, match="no loss tokens on any rank"):
        phalanx.token_loss_scale(0)
    with pytest.raises(ValueError, match="Invalid num_tokens 2.5"):
        phalanx.token_loss_scale(2.5)
