"""StreamingDataset: an iterable data set over shards, each sample once per epoch over all ranks
and DataLoader workers, in an order independent of both, resumable at any world size."""

from __future__ import annotations

import hashlib
import math
import operator
import os
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch.utils.data import IterableDataset, get_worker_info

from .. import process_group
from .order import ENDS, Layout, batch_positions, global_order
from .sources import NpyShard, TokenBinShard, resolve, sizes

_STATE_KEYS = ("epoch", "position", "num_samples", "shards", "seed", "shuffle", "shuffle_block")

# A worker locates its samples a chunk of batches at a time (tensor operations per chunk, not
# per sample): at most this many samples, and for samples that are rows of mapped files (read
# together, one gather per shard), at most this many bytes of them.
_CHUNK_SAMPLES = 4096
_CHUNK_BYTES = 4 << 20
# ... unless a chunk has fewer samples a shard than this on average: then a row view each
_GATHER_FROM = 8


def _positive(name: str, value: Any) -> int:
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None or number < 1:
        raise ValueError(f"Invalid {name} {value!r}, {name} should be a positive integer")
    return number


def _fingerprint(shard_sizes: list[int]) -> str:
    """A short digest of the shard sizes: a resumed run must see the same shards."""
    text = ",".join(map(str, shard_sizes)).encode()
    return f"{len(shard_sizes)}:{hashlib.blake2b(text, digest_size=8).hexdigest()}"


def _row_size(readers: list[Any]) -> tuple[int, int] | None:
    """``(bytes, elements)`` of a sample when every reader is a mapped file whose samples are
    rows of one dtype and shape (read a chunk at a time, gathers per shard); else None."""
    if not all(type(r) in (TokenBinShard, NpyShard) for r in readers):
        return None
    kinds = {(r.dtype, tuple(r.shape[1:]) if isinstance(r, NpyShard) else (r.seq_len,))
             for r in readers}
    if len(kinds) != 1:
        return None
    (dtype, shape), = kinds
    elements = math.prod(shape)
    return max(1, elements * dtype.itemsize), max(1, elements)


class StreamingDataset(IterableDataset):
    r"""Iterable data set over shards that gives each sample exactly once per epoch over all
    ranks and DataLoader workers, and resumes mid-epoch at any world size and worker count.

    Each epoch has one global order of the samples, a function of ``(seed, epoch)`` and the
    shards only: two shard-level shuffles (the shards' order, then each shard's samples) and a
    bounded shuffle window of ``shuffle_block`` samples (see :mod:`phalanx.streaming.order`).
    That order is served in global steps: in each, every rank takes the next ``batch_size``
    positions in rank order, and a rank's batches go to its DataLoader workers round robin, the
    order in which torch's ``DataLoader`` collects them. Pass it to a plain ``DataLoader`` with
    the same ``batch_size``; any ``num_workers``, ``persistent_workers`` and ``prefetch_factor``.

    .. note::
        **Resuming.** The state is one global position ``p``: the first ``p`` samples of the
        epoch's order are done. When every rank has taken ``k`` samples (whole batches),
        ``p = start + k * num_replicas``. Workers read ahead of training, so the dataset cannot
        see what the loop took: pass it, ``state_dict(consumed=batches_done * batch_size)``
        (or ``Checkpointer.save(..., consumed=...)``). The resumed epoch serves the positions
        from ``p`` on over whatever ``num_replicas`` and ``num_workers`` the new run has: each
        remaining sample exactly once, none that was consumed.

    .. note::
        ``set_epoch`` and ``load_state_dict`` write the epoch and position into a small
        shared-memory tensor that workers read when an iteration starts, so they reach
        ``persistent_workers`` too.

    Args:
        sources: paths, directories or globs (``.npy`` and ``.jsonl`` by suffix),
            :class:`phalanx.streaming.TokenFiles` for raw token files, or
            :class:`phalanx.streaming.ShardReader` objects for other formats; in that order,
            they number the samples (sample ids).
        batch_size (int): the ``DataLoader``'s ``batch_size`` (per rank); must be the same.
        ends (str): what to do with the end of an epoch that does not divide over the ranks,
            required: ``"drop"`` (every rank the same count, the remainder not served),
            ``"pad"`` (every rank the same count, padded with the epoch's first samples, as
            torch's sampler pads) or ``"uneven"`` (every sample once, ranks differing by at
            most one sample; use with :func:`phalanx.join`).
        shuffle (bool, optional): shuffle as above; ``False`` serves samples in id order.
            Default ``True``.
        seed (int, optional): shuffling seed, identical on every rank. Default ``0``.
        shuffle_block (int, optional): the shuffle window, in samples. Default ``65536``.
        num_replicas (int, optional): number of ranks. Default: phalanx's world size.
        rank (int, optional): this rank. Default: phalanx's rank.
        transform (callable, optional): applied to each sample as it is read.

    .. warning::
        Keep the ``DataLoader``'s ``drop_last=False`` (use ``ends="drop"``) and its
        ``batch_size`` equal to this one's: batches of another size break the round-robin
        alignment, and with it the exactness of resumption.

    Example::

        >>> data = phalanx.StreamingDataset("shards/*.npy", batch_size=8, ends="drop")
        >>> loader = DataLoader(data, batch_size=8, num_workers=2, persistent_workers=True)
        >>> ckpt = phalanx.Checkpointer("runs/lm", model, optimizer, sampler=data)
        >>> state = ckpt.load()
        >>> for epoch in range(state.epoch if state else 0, epochs):
        ...     data.set_epoch(epoch)              # keeps a restored mid-epoch position
        ...     for step, batch in enumerate(loader):
        ...         train(batch)
        ...         ckpt.save(epoch, step, consumed=(step + 1) * 8)
    """

    def __init__(self, sources: Iterable[Any], *, batch_size: int, ends: str,
                 shuffle: bool = True, seed: int = 0, shuffle_block: int = 1 << 16,
                 num_replicas: int | None = None, rank: int | None = None,
                 transform: Callable[[Any], Any] | None = None) -> None:
        if ends not in ENDS:
            raise ValueError(f"Invalid ends {ends!r}, expected one of {', '.join(map(repr, ENDS))}")
        self.batch_size = _positive("batch_size", batch_size)
        self.shuffle_block = _positive("shuffle_block", shuffle_block)
        self.num_replicas = _positive(
            "num_replicas", process_group.get_world_size() if num_replicas is None else num_replicas)
        self.rank = process_group.get_rank() if rank is None else rank
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) \
                or not 0 <= self.rank < self.num_replicas:
            raise ValueError(
                f"Invalid rank {rank!r}, rank should be in the interval [0, {self.num_replicas - 1}]")
        self.ends, self.shuffle, self.seed, self.transform = ends, shuffle, seed, transform
        self.readers = resolve(sources)
        if not self.readers:
            raise ValueError("StreamingDataset needs at least one source, got none")
        self.shard_sizes = sizes(self.readers)
        self.num_samples = sum(self.shard_sizes)
        self._ends_at = torch.cumsum(torch.tensor(self.shard_sizes, dtype=torch.int64), 0)
        self._starts_at = self._ends_at - torch.tensor(self.shard_sizes, dtype=torch.int64)
        # [epoch, start position]: in shared memory, so that workers (persistent ones too) see
        # set_epoch and load_state_dict made in the main process
        self._shared = torch.zeros(2, dtype=torch.int64).share_memory_()
        # samples this process's iterator yielded (num_workers=0): those of the batches before
        # the current one, and the current batch's iterator (counted as it is consumed)
        self._done, self._current = 0, None
        self._counted_here = False  # an iteration ran in this process (num_workers=0)
        self._cache: tuple[int, torch.Tensor] | None = None
        # samples that are rows of one tensor per shard, of one dtype and shape: read a chunk's
        # samples of a shard with one gather
        self._row_bytes, self._row_elements = _row_size(self.readers) or (None, None)
        # each shard's rows tensor (a view of its mapped file), by shard, for this process only
        # (a reader's rows() checks the process on every call: 1.5 µs, 66 calls a chunk at 320
        # shards; this dict is checked once a chunk)
        self._rows_cache: dict[int, torch.Tensor] = {}
        self._rows_pid = -1

    @property
    def epoch(self) -> int:
        return int(self._shared[0])

    def layout(self) -> Layout:
        """How the current epoch, from its (restored) position on, splits over the ranks."""
        return Layout(self.num_samples, int(self._shared[1]), self.num_replicas, self.batch_size,
                      self.ends)

    def order(self, epoch: int | None = None) -> torch.Tensor:
        """The sample ids of ``epoch`` (default: the current one) in their global order."""
        epoch = self.epoch if epoch is None else epoch
        if self._cache is None or self._cache[0] != epoch:
            self._cache = (epoch, global_order(self.shard_sizes, self.seed, epoch,
                                               shuffle=self.shuffle, shuffle_block=self.shuffle_block))
        return self._cache[1]

    def _locate(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(shard, index in the shard)`` of each sample id, as two tensors."""
        # searchsorted in pieces of at most 200 (its parallel grain: see order.py's note)
        shards = torch.cat([torch.searchsorted(self._ends_at, ids[at:at + 200], right=True)
                            for at in range(0, ids.numel(), 200)]) if ids.numel() > 200 \
            else torch.searchsorted(self._ends_at, ids, right=True)
        return shards, ids - self._starts_at.index_select(0, shards)

    def sample(self, sample_id: int) -> Any:
        """Sample ``sample_id`` (its place in the sources), transformed."""
        shard, local = (int(t) for t in self._locate(torch.tensor([sample_id])))
        item = self.readers[shard][local]
        return item if self.transform is None else self.transform(item)

    def _read(self, ids: torch.Tensor) -> Callable[[int, int], Sequence[Any]]:
        """A reader of the samples ``ids``: ``take(a, b)`` gives samples ``ids[a:b]`` (not
        transformed). Sample objects are made batch by batch, as they are consumed: a chunk's
        worth alive at once kept Python's garbage collector busy (a fifth of an epoch's time)."""
        shards, local = self._locate(ids)
        readers = self.readers
        if self._row_bytes is None:  # readers of any kind: one __getitem__ per sample
            pairs = list(zip(shards.tolist(), local.tolist()))
            return lambda a, b: [readers[s][i] for s, i in pairs[a:b]]
        # rows of mapped files: group the ids by shard (sorting them keeps each shard's reads in
        # file order) and gather each shard's rows into one tensor; a batch then takes its rows
        # from it in the order asked
        ids_sorted, where = torch.sort(ids)
        shards_sorted = shards.index_select(0, where)
        present, counts = torch.unique_consecutive(shards_sorted, return_counts=True)
        present = present.tolist()
        if self._rows_pid != os.getpid():  # a new process (a DataLoader worker): its own maps
            self._rows_cache, self._rows_pid = {}, os.getpid()
        if len(present) * _GATHER_FROM > ids.numel():  # few samples a shard: a view each
            rows = {s: self._rows(s) for s in present}
            pairs = list(zip(shards.tolist(), local.tolist()))
            return lambda a, b: [rows[s][i] for s, i in pairs[a:b]]
        # gathers of at most torch's parallel grain (32768 elements): a larger one runs on
        # several threads, which costs more than the copy when the cores are busy
        piece = max(1, 32768 // self._row_elements)
        first = self._rows(present[0])
        gathered = torch.empty((ids.numel(),) + first.shape[1:], dtype=first.dtype)
        parts = (ids_sorted - self._starts_at.index_select(0, shards_sorted)).split(counts.tolist())
        at = 0
        for s, part in zip(present, parts):
            rows = self._rows(s)
            for p in range(0, part.numel(), piece):
                index = part[p:p + piece]
                torch.index_select(rows, 0, index, out=gathered[at:at + index.numel()])
                at += index.numel()
        # gathered[k] is sample where[k]: sample j is gathered[back[j]]; put them in order
        # (unless they are: unshuffled), then a batch is a slice
        if not torch.equal(where, torch.arange(where.numel())):
            back = torch.empty_like(where).scatter_(0, where, torch.arange(where.numel()))
            ordered = torch.empty_like(gathered)
            for p in range(0, back.numel(), piece):
                torch.index_select(gathered, 0, back[p:p + piece], out=ordered[p:p + piece])
            gathered = ordered
        return lambda a, b: gathered[a:b].unbind(0)

    def _rows(self, shard: int) -> torch.Tensor:
        """Shard ``shard``'s rows, through this process's cache (``_read`` resets it in a new
        process)."""
        rows = self._rows_cache.get(shard)
        if rows is None:
            rows = self._rows_cache[shard] = self.readers[shard].rows()
        return rows

    def _batches(self, batches: list[tuple[int, int]], ramp: bool = False) -> Iterator[Any]:
        """The samples of ``batches`` (position ranges), batch by batch: a list per batch,
        transformed. ``ramp``: the first chunk is one batch, each next one four times the last,
        up to the chunk size (in DataLoader workers: see below)."""
        order, transform = self.order(), self.transform
        per_chunk = _CHUNK_SAMPLES
        if self._row_bytes:
            per_chunk = min(per_chunk, _CHUNK_BYTES // self._row_bytes)
        per_chunk = max(1, per_chunk // self.batch_size)  # in batches
        # In a DataLoader worker the main process waits for the first batch while the worker
        # reads it, and the worker is idle later (waiting for the main process to ask): so its
        # first batch waits for the order and one batch's reads, not a whole chunk's (3.5 ->
        # 2.2 ms at 32k samples, one thread), and the small chunks' extra cost (1.3 ms a
        # worker and epoch there) is paid where there is time for it. In the main process it
        # would only add.
        c, size = 0, 1 if ramp else per_chunk
        while c < len(batches):
            chunk = batches[c:c + size]
            c, size = c + size, min(4 * size, per_chunk)
            take = self._read(order.index_select(0, batch_positions(chunk) % order.numel()))
            at = 0
            for begin, end in chunk:
                batch = take(at, at + end - begin)
                at += end - begin
                yield batch if transform is None else [transform(item) for item in batch]

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        batches = self._batches(self.layout().worker_batches(self.rank, worker, workers),
                                ramp=info is not None)
        if info is not None:
            for batch in batches:
                yield from batch
            return
        # num_workers=0: count what is yielded, for state_dict()
        self._done, self._current, self._counted_here = 0, None, True
        for batch in batches:
            current = iter(batch)
            self._current = (len(batch), current)
            yield from current
            self._done += len(batch)
            self._current = None

    def _yielded(self) -> int:
        """Samples this process's iterator has yielded in its current iteration."""
        if self._current is None:
            return self._done
        size, current = self._current
        return self._done + size - operator.length_hint(current)

    def __len__(self) -> int:
        """This rank's number of samples in the current epoch (fewer when resumed mid-epoch)."""
        return self.layout().share(self.rank)

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch, which seeds the order. Moving to a different epoch starts it from its
        beginning; setting the epoch :meth:`load_state_dict` restored keeps its position.

        Args:
            epoch (int): epoch number.
        """
        if epoch != self.epoch:
            self._shared[1] = 0
            self._done, self._current, self._counted_here = 0, None, False
        self._shared[0] = epoch

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The global position in the current epoch, as a dict of plain values.

        Args:
            consumed (int, optional): samples of this iteration the training loop has taken
                on this rank, ``batches_done * batch_size`` (a value past this rank's share
                means all of it). Default: the samples this process's iterator yielded, which
                is exact only with ``num_workers=0``.

        Raises:
            ValueError: ``consumed`` is not a whole number of batches, or is left out while
                the data was iterated in DataLoader workers (this process cannot see it).
        """
        if consumed is None:
            if not self._counted_here:
                raise ValueError(
                    "StreamingDataset.state_dict() needs consumed=batches_done * batch_size: "
                    "the data set was not iterated in this process (DataLoader workers read it), "
                    "so it cannot tell how far the training loop got"
                )
            consumed = self._yielded()
        if isinstance(consumed, bool) or not isinstance(consumed, int) or consumed < 0:
            raise ValueError(f"Invalid consumed {consumed!r}, consumed should be a non-negative integer")
        return {"epoch": self.epoch,
                "position": self.layout().position(self.rank, consumed),
                "num_samples": self.num_samples, "shards": _fingerprint(self.shard_sizes),
                "seed": self.seed, "shuffle": self.shuffle, "shuffle_block": self.shuffle_block}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at ``state``'s epoch and position; the next iteration serves the rest.

        Raises:
            ValueError: keys missing, or the state is of other shards or shuffle settings (the
                order would differ), or its position is out of range.
        """
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise ValueError(
                f"Invalid StreamingDataset state: missing {', '.join(missing)}; expected the keys "
                f"{', '.join(_STATE_KEYS)} as StreamingDataset.state_dict() gives them")
        mine = {"num_samples": self.num_samples, "shards": _fingerprint(self.shard_sizes),
                "seed": self.seed, "shuffle": self.shuffle, "shuffle_block": self.shuffle_block}
        for key, value in mine.items():
            if state[key] != value:
                raise ValueError(
                    f"StreamingDataset state was saved with {key}={state[key]!r} but this data "
                    f"set has {key}={value!r}; the epoch's order would differ, so it cannot resume")
        position = state["position"]
        if isinstance(position, bool) or not isinstance(position, int) \
                or not 0 <= position <= self.num_samples:
            raise ValueError(f"Invalid StreamingDataset state: position {position!r}, expected "
                             f"an integer in [0, {self.num_samples}]")
        self._shared[0], self._shared[1] = state["epoch"], position
        self._done, self._current, self._counted_here = 0, None, False

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_cache"] = None  # workers compute the order themselves
        state["_rows_cache"], state["_rows_pid"] = {}, -1  # views of this process's maps
        state["_done"], state["_current"] = 0, None
        return state
