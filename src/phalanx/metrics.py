"""Exact distributed evaluation: sums of metrics over every rank's samples, each counted once.

With ``DistributedSampler(dataset, shuffle=False, pad=False)`` each rank evaluates its own
shard, of unequal length (some may be empty), with no padded duplicate. :class:`MetricSum`
adds up named sums on each rank and :meth:`MetricSum.compute` all-reduces them once, in
float64: every sample is counted once, and no rank waits for another's extra batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .diagnostics import ledger
from .ledger import syncpoint


class MetricSum:
    r"""Named sums over the samples of every rank, for exact evaluation on uneven shards.

    Each rank calls :meth:`add` for its own batches (any number, zero included), then every
    rank calls :meth:`compute` once: one all-reduce (float64) of the sums, in the order the
    names were given, the same on every rank.

    Args:
        *names (str): the sums kept, e.g. ``"correct", "loss", "samples"``; the same, in the
            same order, on every rank.
        group (ProcessGroup, optional): the ranks whose samples count. Default ``None``: the
            world (or this process alone without a process group).

    .. warning::
        :meth:`compute` is a collective: every rank of ``group`` calls it, also one whose shard
        is empty. Inside ``phalanx.join``, ranks that have joined take part by themselves.

    Example::

        >>> sampler = phalanx.DistributedSampler(test_set, shuffle=False, pad=False)
        >>> sums = phalanx.MetricSum("correct", "samples")
        >>> for x, y in DataLoader(test_set, sampler=sampler, batch_size=256):
        ...     sums.add(correct=(model(x).argmax(1) == y).sum(), samples=len(y))
        >>> totals = sums.compute()
        >>> accuracy = totals["correct"] / totals["samples"]    # over the whole test set
    """

    def __init__(self, *names: str, group: dist.ProcessGroup | None = None) -> None:
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"MetricSum needs the names of its sums (strings), got {names!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"MetricSum's names must differ, got {names!r}")
        self.names = names
        self.group = group
        self._sums = torch.zeros(len(names), dtype=torch.float64)

    def add(self, **values: Any) -> None:
        """Add this rank's ``values`` (numbers or tensors, summed) to the sums of those names."""
        unknown = sorted(set(values) - set(self.names))
        if unknown:
            raise ValueError(f"MetricSum has no sum named {unknown[0]!r}; it keeps {list(self.names)}")
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                value = value.detach().double().sum().cpu()
            self._sums[self.names.index(name)] += value

    def compute(self) -> dict[str, float]:
        """Every rank's sums added up (a collective); the same dict on every rank."""
        total = self._sums.clone()
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            shadow = syncpoint.tensor_shadow(syncpoint.ALL_REDUCE, total, syncpoint.REDUCE_OPS.index("SUM"))
            with ledger().collective(f"MetricSum({', '.join(self.names)})", (total,), self.group,
                                     check=True, shadow=shadow):
                dist.all_reduce(total, group=self.group)
        return dict(zip(self.names, total.tolist()))

    def reset(self) -> None:
        """Start the sums afresh (e.g. for the next evaluation)."""
        self._sums.zero_()
