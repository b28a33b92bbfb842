"""The collectives of ``fully_shard``, each issued through the ledger (:mod:`phalanx.ledger`)
so that the hang and mismatch reports name the unit; and the layout of a unit's flat
buffers, the same as torch's ``fully_shard``.

A unit's parameters are sharded on dim 0 as ``torch.chunk`` splits them (DTensor's
``Shard(0)``): each is padded to ``ceil(rows / world) * world`` rows, and rank ``r`` holds rows
``[r * k, (r + 1) * k)`` of the padded tensor (``k = ceil(rows / world)``). A reduce-scatter's
input is rank-major: for each rank, the chunk of every gradient in order (torch's
``torch._chunk_cat``); an all-gather's output is the same layout, rank by rank.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import comm
from ..diagnostics import ledger
from ..ledger import Collective


class Pending:
    """A collective in flight, recorded in the ledger; :meth:`wait` completes it. Its work
    handle stays with it: hold the last ones in a :class:`~phalanx.comm.LastWorks`."""

    def __init__(self, handle: Any, record: Collective) -> None:
        self._handle, self._record, self._done = handle, record, False

    def wait(self) -> None:
        if self._done:
            return
        self._done = True
        self._record.wait(self._handle)
        self._record.end()


class _Local:
    """The work of a group of one: done where it was started (no collective)."""

    def wait(self) -> None:
        return None


def _alone(output: torch.Tensor, input: torch.Tensor, group: Any) -> Pending | None:
    """In a group of one, every collective here is a copy (the shard is the whole, the
    reduction over one rank the identity): made at once, nothing sent or recorded, as torch's
    ``fully_shard`` runs no collective at world size 1. ``None`` in a larger group."""
    if dist.get_world_size(group) != 1:
        return None
    if output.data_ptr() != input.data_ptr():  # (an all-reduce is in place)
        with torch.no_grad():
            output.copy_(input.view_as(output))
    return Pending(_Local(), Collective(None, None))


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Any, unit: str,
               shadow: tuple[int, ...] | None = None, announced: bool = False) -> Pending:
    """Start gathering every rank's ``input`` into ``output`` (rank by rank). ``shadow`` and
    ``announced``: :meth:`phalanx.ledger.Ledger.collective`'s (a join, :mod:`.joining`)."""
    if (done := _alone(output, input, group)) is not None:
        return done
    record = ledger().collective(f"fully_shard all-gather {unit}", (input,), group,
                                 shadow=shadow, announced=announced)
    with record.guard():
        work = comm.all_gather_tensor(output, input, group=group, async_op=True)
    return Pending(work, record)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: Any, group: Any, unit: str,
                   shadow: tuple[int, ...] | None = None, announced: bool = False) -> Pending:
    """Start :func:`phalanx.comm.reduce_scatter_async` (an all-to-all on Gloo); ``shadow``
    and ``announced`` as for :func:`all_gather`."""
    if (done := _alone(output, input, group)) is not None:
        return done
    record = ledger().collective(f"fully_shard reduce-scatter {unit}", (input,), group,
                                 shadow=shadow, announced=announced)
    with record.guard():
        pending = comm.reduce_scatter_async(output, input, op, group)
    return Pending(pending, record)


def all_reduce(tensor: torch.Tensor, op: Any, group: Any, unit: str) -> Pending:
    """Start reducing ``tensor`` in place across ``group`` (HSDP: a reduce-scatter's output
    across the replicas), recorded as the others."""
    if (done := _alone(tensor, tensor, group)) is not None:
        return done
    record = ledger().collective(f"fully_shard all-reduce {unit}", (tensor,), group)
    with record.guard():
        work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    return Pending(work, record)


def padded_rows(rows: int, world: int) -> int:
    """Rows of each rank's chunk of a tensor of ``rows`` rows (``torch.chunk``'s size)."""
    return -(-rows // world)


def chunk_cat(tensors: Sequence[torch.Tensor], world: int, out: torch.Tensor) -> None:
    """Write ``tensors`` into ``out`` rank-major: for each rank, its dim-0 chunk of every
    tensor, each padded with zeros to ``padded_rows`` rows (what ``torch._chunk_cat`` writes)."""
    chunks = []
    for t in tensors:
        pad = padded_rows(t.shape[0], world) * world - t.shape[0]
        if pad:
            t = F.pad(t.reshape(t.shape[0], -1), (0, 0, 0, pad))
        chunks.append(t.reshape(world, -1))
    with torch.no_grad():
        torch.cat(chunks, dim=1, out=out.view(world, -1))
