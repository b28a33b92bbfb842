"""How one bucket's flat buffer is reduced: the :class:`BucketComm` protocol and its strategies.

:class:`AllReduceMean` (the default) and :class:`ReduceToOwner` (ZeRO stage 2);
:class:`~phalanx.ddp.hook_comm.HookComm` (a communication hook) lives in ``hook_comm.py``.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch
import torch.distributed as dist

from .. import comm
from .bucketing import BucketSpec


class BucketComm(Protocol):
    """What the :class:`~phalanx.ddp.reducer.Reducer` needs to reduce its buckets.

    When the work returned by :meth:`launch` completes, the buffer of a bucket this rank keeps
    must hold the reduced gradients, and the control tail of the last bucket (see
    :mod:`phalanx.ddp.reducer`) must be summed on every rank.
    """

    group: dist.ProcessGroup | None
    """The process group the buckets are reduced over (``None``: the world)."""
    divisor: int
    """The reducer divides each gradient by this while copying it into its bucket (saving a
    pass over the buffer)."""
    label: str
    """What the collective log adds to ``DDP bucket k`` for this comm: ``""``, or
    ``" via <hook>"`` (the same on every rank)."""
    divides_itself: bool
    """Whether the comm averages the sums itself (a communication hook, by the group's size):
    :attr:`divisor` is then 1 and stays so under a join, and the average's divisor is the
    group's size; otherwise the reducer may change :attr:`divisor` (a join's active ranks)."""
    runs_to_end_in_join: bool
    """Whether, inside a join, each bucket's work must be waited for before the next bucket is
    announced (a hook's collectives, which must come in the same order on joined and active
    ranks: :mod:`phalanx.ddp.joining`)."""

    def launch(self, b: int, flat: torch.Tensor) -> dist.Work:
        """Start reducing bucket ``b``'s flat buffer, asynchronously."""
        ...

    def keeps(self, b: int) -> bool:
        """Whether this rank keeps bucket ``b``'s result."""
        ...


class AllReduceMean:
    """Default bucket communication: an all-reduce (sum) of gradients pre-divided by ``divisor``.

    Args:
        group: process group; ``None`` is the default group.

    Example::

        >>> comm = AllReduceMean()
        >>> torch.div(grad, comm.divisor, out=flat)  # what the reducer does with each gradient
        >>> comm.launch(0, flat).wait()              # flat: the average, on every rank
    """

    label = ""
    divides_itself = False
    runs_to_end_in_join = False

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.divisor = dist.get_world_size(group)

    def launch(self, b: int, flat: torch.Tensor) -> dist.Work:
        return dist.all_reduce(flat, group=self.group, async_op=True)

    def keeps(self, b: int) -> bool:
        return True


class ReduceToOwner:
    """ZeRO stage 2: each bucket's sum goes to its owner only (:func:`phalanx.comm.reduce_async`:
    on Gloo every other rank sends its bucket to the owner once, half of what Gloo's own
    reduce sends at world 2).

    The plan must come from :func:`~phalanx.ddp.bucketing.plan_buckets` with ``owners``, so that
    every bucket has one :attr:`~phalanx.ddp.bucketing.BucketSpec.owner` (a rank in ``group``).
    Buckets whose owner is ``None`` are all-reduced and kept everywhere. The last bucket is
    all-reduced too, whoever owns it: every rank must read its control tail; ranks other
    than its owner then drop its gradients like those of any bucket they do not keep.

    Args:
        plan: the buckets, in launch order.
        group: process group; ``None`` is the default group.

    Example::

        >>> owners = zero.owners_of(p for _, p in named)   # a ZeroRedundancyOptimizer's
        >>> plan = plan_buckets(named, owners=owners)
        >>> comm = ReduceToOwner(plan)
        >>> comm.launch(0, flat).wait()   # the sum reaches plan[0].owner (every rank if last)
        >>> comm.keeps(0)                 # True on plan[0].owner only (everywhere if None)
    """

    label = ""
    divides_itself = False
    runs_to_end_in_join = False

    def __init__(self, plan: Sequence[BucketSpec], group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.divisor = dist.get_world_size(group)
        rank = dist.get_rank(group)
        self._keeps = [spec.owner is None or spec.owner == rank for spec in plan]
        # None: all-reduce; else the owner (a rank of the group).
        self._dst = [s.owner for s in plan[:-1]] + [None]
        # reduces in flight, oldest first: each holds, on the owner, the others' copies of its
        # bucket until it is waited for (comm.reduce_async)
        self._landing: list[comm.PendingReduce] = []

    def launch(self, b: int, flat: torch.Tensor) -> Any:
        # The reduces that have arrived are summed now, not at the end of the backward, so
        # that their receive buffers go (measured at world 2, 8 buckets of 4 MiB: the
        # backward's peak 10 MiB above Gloo's own reduce otherwise)
        while self._landing and self._landing[0].is_completed():
            self._landing.pop(0).wait()
        if self._dst[b] is None:
            return dist.all_reduce(flat, group=self.group, async_op=True)
        pending = comm.reduce_async(flat, self._dst[b], group=self.group)
        self._landing.append(pending)
        return pending

    def keeps(self, b: int) -> bool:
        return self._keeps[b]

