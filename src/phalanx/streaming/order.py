"""The epoch's global sample order, and its partition over ranks, batches and workers.

Everything here is a pure function of its arguments: the order of an epoch depends only on
``(seed, epoch)``, the shard sizes and the shuffle settings, never on the world size or the
number of DataLoader workers; the partition then cuts *positions* of that order into per-rank
batches, and the batches of one rank into per-worker streams.

**The order** (``shuffle=True``), in three stages, each seeded from ``(seed, epoch, stage)``:

1. the shards are permuted (shard-level shuffle 1);
2. the samples of each shard are permuted within the shard (shard-level shuffle 2), the
   shards' samples laid end to end in the order of stage 1;
3. that sequence is cut into windows of ``shuffle_block`` consecutive positions and each
   window is permuted (the bounded shuffle buffer): a sample moves at most ``shuffle_block - 1``
   positions, so samples of neighbouring shards mix while a worker's reads stay within about
   ``shuffle_block`` samples' worth of shards at a time.

**The partition.** From a start position ``p0`` (0, or where a resumed epoch stopped), the
remaining ``M`` positions are served in *global steps* of ``R * B`` positions (``R`` ranks,
batch size ``B``): in step ``j`` rank ``r`` takes positions ``p0 + j*R*B + r*B`` onwards, ``B``
of them. So when every rank has taken ``k`` samples (``k`` a multiple of ``B``) the first
``p0 + k*R`` positions of the order are done and nothing else: the global position is a
single integer whatever ``R`` is. The tail (``T < R*B`` positions) is split by ``ends``:
``"drop"`` gives each rank ``T // R`` (the rest is not served), ``"pad"`` gives each rank
``ceil(T / R)``, the missing positions taken from the start of the epoch's order, as
:class:`torch.utils.data.DistributedSampler` pads, and ``"uneven"`` serves every position once,
the first ``T % R`` ranks taking one more. A rank's batches go to its DataLoader workers round
robin (batch ``j`` to worker ``j % W``), the order in which torch's DataLoader takes them.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

ENDS = ("drop", "pad", "uneven")


def stage_seed(seed: int, epoch: int, stage: int) -> int:
    """A 63-bit seed for one shuffle stage of one epoch, the same in every process and run
    (a hash, not Python's ``hash()``, which varies between processes)."""
    digest = hashlib.blake2b(f"{seed}/{epoch}/{stage}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _generator(seed: int, epoch: int, stage: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(stage_seed(seed, epoch, stage))
    return g


# Indexing here is index_select, not ``tensor[index]``: advanced indexing, ``take`` and
# ``searchsorted`` split even a few thousand elements over torch's threads, and on busy cores
# one such call took 20-40 ms instead of 0.1 (torch 2.13, two threads).


def global_order(sizes: Sequence[int], seed: int, epoch: int, *, shuffle: bool = True,
                 shuffle_block: int = 1 << 16) -> torch.Tensor:
    """The epoch's order: an ``int64`` permutation of ``range(sum(sizes))``.

    Sample ids number the samples of shard 0 first, then shard 1, ... (the sources' order).
    ``shuffle=False`` gives ``0, 1, 2, ...``.
    """
    total = sum(sizes)
    if not shuffle or total == 0:
        return torch.arange(total, dtype=torch.int64)
    with _one_thread():
        return _shuffled(sizes, total, seed, epoch, shuffle_block)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Torch's operations in the block run on one thread (the process's thread count is
    restored after it). The order is a few operations over all the epoch's samples, each above
    torch's parallel grain; on two threads its radix sorts alone took 23-160 ms of CPU at 320k
    samples on busy cores (the threads wait at a barrier per pass for each other) against 5 ms on
    one (torch 2.13). DataLoader workers run on one thread already: this changes nothing there."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _shuffled(sizes: Sequence[int], total: int, seed: int, epoch: int,
              shuffle_block: int) -> torch.Tensor:
    sizes_t = torch.tensor(list(sizes), dtype=torch.int64)
    shard_rank = torch.empty(len(sizes), dtype=torch.float64)
    shard_rank[torch.randperm(len(sizes), generator=_generator(seed, epoch, 1))] = torch.arange(
        len(sizes), dtype=torch.float64)
    # stage 2: sort by (shard's place in the shuffled shard order, a random key); the key is in
    # [0, 1), so adding it to the integer place keeps the shards apart (the sums are made in
    # the random keys' own tensor: a new one per operation cost as much again, in page faults)
    key = torch.rand(total, generator=_generator(seed, epoch, 2), dtype=torch.float64)
    key.add_(shard_rank.index_select(0, _segment_of(sizes_t, total)))
    order = _argsort(key)
    # stage 3: the same within windows of shuffle_block positions (window w's keys w + u, the
    # window number added a window at a time: no integer division per sample)
    key = torch.rand(total, generator=_generator(seed, epoch, 3), dtype=torch.float64)
    whole = total // shuffle_block * shuffle_block
    key[:whole].view(-1, shuffle_block).add_(
        torch.arange(whole // shuffle_block, dtype=torch.float64)[:, None])
    key[whole:].add_(float(whole // shuffle_block))
    return order.index_select(0, _argsort(key))


def _segment_of(sizes: torch.Tensor, total: int) -> torch.Tensor:
    """For each of ``total`` elements, the segment it is in: ``i`` repeated ``sizes[i]`` times
    (``repeat_interleave``, without its one-element parallel grain: 10x slower on busy cores)."""
    marks = torch.zeros(total, dtype=torch.int64)
    marks.index_fill_(0, torch.cumsum(sizes, 0)[:-1], 1)
    return torch.cumsum(marks, 0)


def _argsort(key: torch.Tensor) -> torch.Tensor:
    """The stable argsort of non-negative float64 keys, through their bits: the bits of
    non-negative doubles, read as int64, order as the doubles do, and int64 sorts faster, the
    same result. From 32768 keys (torch's parallel grain) torch sorts int64 by radix, 3.7x
    faster a key than its merge sort below (torch 2.13): from 8192 keys, in a process of one
    torch thread (DataLoader workers, and :func:`global_order`, which runs on one), the bits are
    padded to 32768 with a larger key (no double's bits reach int64's max), which sorts last.
    With more threads the radix sort is parallel, which on busy cores took 10-20x its time:
    below 32768 keys it is not asked for."""
    bits = key.view(torch.int64)
    if _RADIX_PAD_FROM <= bits.numel() < _RADIX_FROM and torch.get_num_threads() == 1:
        padded = torch.full((_RADIX_FROM,), torch.iinfo(torch.int64).max, dtype=torch.int64)
        padded[:bits.numel()] = bits
        return torch.argsort(padded, stable=True)[:bits.numel()]
    return torch.argsort(bits, stable=True)


_RADIX_FROM, _RADIX_PAD_FROM = 32768, 8192


@dataclass(frozen=True)
class Layout:
    """How the positions ``[start, total)`` of an epoch split over ``ranks`` ranks in batches
    of ``batch_size``; see the module notes. ``total`` is the epoch's number of samples."""

    total: int
    start: int
    ranks: int
    batch_size: int
    ends: str

    @property
    def full_steps(self) -> int:
        """Global steps in which every rank takes a full batch."""
        return (self.total - self.start) // (self.ranks * self.batch_size)

    @property
    def tail(self) -> int:
        """Positions left after the full steps."""
        return self.total - self.start - self.full_steps * self.ranks * self.batch_size

    def tail_range(self, rank: int) -> tuple[int, int]:
        """``rank``'s positions in the tail, ``[begin, end)``; ``end`` may pass ``total``
        (padding, ``ends="pad"``)."""
        base = self.start + self.full_steps * self.ranks * self.batch_size
        if self.ends == "uneven":
            q, extra = divmod(self.tail, self.ranks)
            begin = base + rank * q + min(rank, extra)
            return begin, begin + q + (1 if rank < extra else 0)
        q = self.tail // self.ranks if self.ends == "drop" else -(-self.tail // self.ranks)
        return base + rank * q, base + (rank + 1) * q

    def share(self, rank: int) -> int:
        """How many samples ``rank`` takes from ``start`` to the end of the epoch."""
        begin, end = self.tail_range(rank)
        return self.full_steps * self.batch_size + end - begin

    def batches(self, rank: int) -> list[tuple[int, int]]:
        """``rank``'s batches as position ranges ``[begin, end)``, in the order it takes them."""
        step = self.ranks * self.batch_size
        first = self.start + rank * self.batch_size
        out = [(first + j * step, first + j * step + self.batch_size)
               for j in range(self.full_steps)]
        begin, end = self.tail_range(rank)
        if end > begin:
            out.append((begin, end))
        return out

    def worker_batches(self, rank: int, worker: int, workers: int) -> list[tuple[int, int]]:
        """The batches of ``rank`` that its DataLoader worker ``worker`` of ``workers`` makes:
        every ``workers``-th from the ``worker``-th, as the DataLoader takes them round robin."""
        return self.batches(rank)[worker::max(workers, 1)]

    def position(self, rank: int, consumed: int) -> int:
        """The global position once ``rank`` has taken ``consumed`` samples from ``start``
        (every rank the same number, as in lockstep training): ``start + consumed * ranks``,
        or ``total`` once ``rank``'s share is done (a dropped tail is done too).

        Raises:
            ValueError: ``consumed`` is short of the share and not a multiple of the batch
                size, so it is not a position of the global order.
        """
        share = self.share(rank)
        if consumed >= share:
            return self.total
        if consumed % self.batch_size:
            raise ValueError(
                f"Invalid consumed {consumed}: expected a multiple of batch_size "
                f"{self.batch_size} (whole batches taken by the training loop), or at least "
                f"this rank's share {share} once the epoch is done"
            )
        return self.start + consumed * self.ranks


def batch_positions(batches: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The positions of ``batches`` (ranges ``[begin, end)``) laid end to end, in a few tensor
    operations whatever their number."""
    if not batches:
        return torch.empty(0, dtype=torch.int64)
    size = batches[0][1] - batches[0][0]
    same = 0  # the leading batches of one size (all but a rank's tail batch): one broadcast
    while same < len(batches) and batches[same][1] - batches[same][0] == size:
        same += 1
    begins = torch.tensor([begin for begin, _ in batches[:same]], dtype=torch.int64)
    parts = [(begins[:, None] + torch.arange(size, dtype=torch.int64)).reshape(-1)]
    parts += [torch.arange(begin, end, dtype=torch.int64) for begin, end in batches[same:]]
    return torch.cat(parts) if len(parts) > 1 else parts[0]
