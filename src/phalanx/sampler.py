"""DistributedSampler: torch's, index for index, plus a resumable global cursor and exact eval.

Every rank draws the same permutation of the data set (seeded by ``seed + epoch``) and takes the
positions ``rank, rank + R, rank + 2R, ...`` of it (``R`` ranks), exactly as
``torch.utils.data.DistributedSampler`` does. What phalanx adds:

* a **global cursor**: the state is one position in the epoch's permutation, shared by all ranks,
  so a run stopped mid-epoch resumes at the same or at a different world size and every remaining
  sample is served exactly once;
* **exact evaluation**: ``pad=False`` gives uneven shards with no padded duplicates.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any, Iterator, Mapping, Sized

import torch
from torch.utils.data import Sampler

from . import process_group

_STATE_KEYS = ("epoch", "position", "dataset_length", "seed", "shuffle")


def _integer(value: Any) -> int | None:
    """``value`` as an int when it is one (numpy's integers too, as torch takes them)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


class DistributedSampler(Sampler[int]):
    r"""Sampler that gives each process its own slice of the data set, and can resume mid-epoch.

    A drop-in for :class:`torch.utils.data.DistributedSampler`: for the same arguments and epoch
    it yields exactly the same indices. Pass one per process as a ``DataLoader``'s ``sampler``.

    .. note::
        The data set is assumed to be of constant size, every instance of it returning the same
        elements in the same order, and ``seed`` must be the same on every rank.

    .. note::
        **Resuming.** The sampler's state is a *global* position ``p`` in the epoch's order: the
        first ``p`` samples of the epoch's permutation are done. All ranks take turns through that
        order, so when each rank has consumed ``k`` of its own indices the position is
        ``k * num_replicas`` past where the iteration started (capped at the data set's length;
        an epoch whose every rank is through is at the end). :meth:`state_dict` computes it,
        :meth:`load_state_dict` restores it, and the next iteration serves the rest of the
        permutation, split over whatever ``num_replicas`` the new sampler has. At the same world
        size it yields exactly what the uninterrupted run would have yielded; at another one,
        every remaining sample still comes exactly once (plus padding, or minus the dropped tail,
        as ``pad``/``drop_last`` say). The resume position holds for the loaded epoch until
        :meth:`set_epoch` moves to another one, which starts it from the beginning.

    .. note::
        **What "consumed" means.** A ``DataLoader`` with workers draws indices ahead of training
        (``num_workers * prefetch_factor`` batches), so the sampler cannot know by itself how far
        training got. ``state_dict(consumed=n)`` takes ``n``, the number of this rank's samples the
        training loop has really used in the current iteration (typically
        ``batches_done * batch_size``). Without it the sampler counts the indices its latest
        iterator handed out, which is exact only when nothing prefetches (``num_workers=0``, or
        the sampler iterated directly).

    Args:
        dataset: data set to sample from; only its ``len()`` is used.
        num_replicas (int, optional): number of processes. Default: the world size of phalanx's
            process group, or of the environment (``WORLD_SIZE``...) before it is initialised.
        rank (int, optional): this process's rank in ``[0, num_replicas)``. Default: as above.
        shuffle (bool, optional): shuffle the indices (with ``seed + epoch``). Default ``True``.
        seed (int, optional): shuffling seed, identical on every rank. Default ``0``.
        drop_last (bool, optional): drop the tail so every rank gets the same count. Default
            ``False``.
        pad (bool, optional): when not ``drop_last``, repeat samples from the start of the epoch
            so that every rank gets the same count, as torch does. ``False`` gives uneven shards
            (counts differ by at most one) in which every sample appears exactly once over all
            ranks: sums all-reduced after an evaluation loop count each sample once. Default
            ``True``.

    .. warning::
        Call :meth:`set_epoch` at the start of every epoch, **before** creating the
        ``DataLoader`` iterator; otherwise every epoch uses the same order.

    .. warning::
        With ``pad=False`` ranks may run a different number of batches: do not run collectives
        (DDP's backward, SyncBatchNorm in training mode) per batch; reduce once after the loop.

    Example::

        >>> sampler = phalanx.DistributedSampler(dataset)
        >>> loader = DataLoader(dataset, batch_size=32, sampler=sampler, num_workers=2)
        >>> if resuming:
        ...     sampler.load_state_dict(ckpt["sampler"])
        >>> for epoch in range(ckpt["sampler"]["epoch"] if resuming else 0, n_epochs):
        ...     sampler.set_epoch(epoch)        # keeps the loaded position for the loaded epoch
        ...     for step, batch in enumerate(loader):
        ...         train(batch)
        ...         state = sampler.state_dict(consumed=min((step + 1) * 32, len(sampler)))
        >>> # exact evaluation: every sample counted once
        >>> val_sampler = phalanx.DistributedSampler(val_set, shuffle=False, pad=False)
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        pad: bool = True,
    ) -> None:
        if num_replicas is None:
            num_replicas = process_group.get_world_size()
        if rank is None:
            rank = process_group.get_rank()
        replicas = _integer(num_replicas)
        if replicas is None or replicas < 1:
            raise ValueError(
                f"Invalid num_replicas {num_replicas!r}, num_replicas should be a positive integer"
            )
        index = _integer(rank)
        if index is None or not 0 <= index < replicas:
            raise ValueError(
                f"Invalid rank {rank!r}, rank should be in the interval [0, {replicas - 1}]"
            )
        num_replicas, rank = replicas, index
        if not hasattr(dataset, "__len__"):
            raise TypeError(
                "DistributedSampler needs a data set with a length (a map-style Dataset), "
                f"got {type(dataset).__name__} without __len__"
            )
        length = len(dataset)  # may be 0: as with torch, nothing is sampled
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.pad = pad
        self.epoch = 0
        self._length = length
        self._start = 0  # global position where this epoch's iterations start (0 unless resumed)
        self._yielded = 0  # indices the latest iterator has handed out
        # torch's public attributes, for a whole epoch from its start
        self.num_samples = self._share(0)
        self.total_size = self._served(0)

    def _share(self, start: int) -> int:
        """How many indices this rank gets when the epoch is served from ``start`` on."""
        remaining, n = self._length - start, self.num_replicas
        if self.drop_last:
            return remaining // n
        if self.pad:
            return -(-remaining // n)
        return (remaining - self.rank + n - 1) // n

    def _served(self, start: int) -> int:
        """Global positions (padding included) all ranks together take from ``start`` on."""
        if self.drop_last or self.pad:
            return self._share(start) * self.num_replicas
        return self._length - start

    def _order(self) -> list[int]:
        """The epoch's permutation of ``range(len(dataset))``, as torch draws it."""
        if not self.shuffle:
            return list(range(self._length))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(self._length, generator=g).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        start = self._start
        stop = start + self._served(start)
        positions = order[start:stop]
        if stop > self._length:
            # torch pads with the epoch's first samples, cycling when padding exceeds the data set
            positions += itertools.islice(itertools.cycle(order), stop - self._length)
        self._yielded = 0
        return self._counted(positions[self.rank :: self.num_replicas])

    def _counted(self, indices: list[int]) -> Iterator[int]:
        for index in indices:
            self._yielded += 1
            yield index

    def __len__(self) -> int:
        """This rank's number of indices in the current epoch (fewer when resumed mid-epoch)."""
        return self._share(self._start)

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch, which seeds the shuffle (``seed + epoch``).

        Moving to a different epoch starts it from its beginning; setting the epoch that
        :meth:`load_state_dict` restored keeps the restored position.

        Args:
            epoch (int): epoch number.
        """
        if epoch != self.epoch:
            self._start = 0
            self._yielded = 0
        self.epoch = epoch

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The global position in the current epoch, as a dict of plain ints and bools.

        Args:
            consumed (int, optional): how many of this rank's indices of the current iteration
                training has really used, typically ``batches_done * batch_size``; a value
                past this rank's share ``len(self)``, as that product gives after a partial
                last batch, means the whole share. Default: how many the latest iterator
                handed out, which counts prefetched indices as consumed (see the class notes).

        Returns:
            ``{"epoch", "position", "dataset_length", "seed", "shuffle"}``; ``position`` is the
            number of samples of the epoch's permutation that are done, for all ranks together.
        """
        share = len(self)
        k = self._yielded if consumed is None else consumed
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(
                f"Invalid consumed {k!r}, consumed should be a non-negative integer, at most "
                f"{share} counted (this rank's share of epoch {self.epoch} from position "
                f"{self._start})"
            )
        k = min(k, share)
        if self.drop_last and k == share:
            position = self._length  # the dropped tail is not served this epoch: it is done
        else:
            position = min(self._start + k * self.num_replicas, self._length)
        return {
            "epoch": self.epoch,
            "position": position,
            "dataset_length": self._length,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at ``state``'s epoch and position; the next iteration serves the rest.

        Raises:
            ValueError: keys are missing, or the state was saved for another data set length,
                seed or shuffle setting (the permutation would differ), or the position is out
                of range.
        """
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise ValueError(
                f"Invalid sampler state: missing {', '.join(missing)}; expected the keys "
                f"{', '.join(_STATE_KEYS)} as DistributedSampler.state_dict() gives them"
            )
        mine = {"dataset_length": self._length, "seed": self.seed, "shuffle": self.shuffle}
        for key, value in mine.items():
            if state[key] != value:
                raise ValueError(
                    f"Sampler state was saved with {key}={state[key]!r} but this sampler has "
                    f"{key}={value!r}; the epoch's order would differ, so it cannot resume"
                )
        position = state["position"]
        if not isinstance(position, int) or not 0 <= position <= self._length:
            raise ValueError(
                f"Invalid sampler state: position {position!r}, expected an integer in "
                f"[0, {self._length}]"
            )
        self.epoch = state["epoch"]
        self._start = position
        self._yielded = 0
