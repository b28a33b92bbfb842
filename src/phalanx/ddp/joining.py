"""DistributedDataParallel's part in :mod:`phalanx.uneven` (uneven inputs).

On a rank that still has inputs, while others have joined, each synchronising forward's check
is waited for and announces the step; its verdict names the ranks still active, which set the
divisor of the average (the initial world size, or with ``divide_by_initial_world_size=False``
the active ranks) and the rank whose buffers are broadcast (the highest active one, as in
torch: rank 0 may have joined with stale buffers). Each bucket, the sparse gradients and the
buffer broadcast are announced by the reducer and the buffer sync themselves.

On a rank that has joined, :meth:`JoinPart.shadow` takes part in each announced collective:
zeros into every bucket (and its control tail), empty sparse gradients, the active rank's
buffers received. Its ``.grad`` is left alone, as torch's join does, unless an optimizer in the
join steps with the averages (a ZeRO shard it owns): then they are written back into it.

When every rank has joined, :meth:`JoinPart.end` gives every rank the parameters and buffers
of the last rank to join (the highest of them), as torch's join does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..ledger import syncpoint
from .buffer_sync import BufferSync
from .checkin import DDPAction
from .reducer import Reducer


class JoinPart:
    """One DDP's place in a running join (``index``) and what it does there.

    Args:
        group: the DDP's process group.
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.index: int | None = None  # this DDP's place in a running phalanx.join
        self.divide_initial = True
        self.write_back = False  # a joined rank writes the averages into .grad

    def begin(self, index: int, divide_initial: bool, write_back: bool, reducer: Reducer | None) -> None:
        """The DDP is joinable number ``index`` of a join starting now."""
        self.index, self.divide_initial, self.write_back = index, divide_initial, write_back
        if reducer is not None:
            reducer.join_index = index

    def step_settings(self, verdict: Any, reducer: Reducer) -> int | None:
        """After an active rank's forward check while ranks have joined: set the divisor of this
        step's average; return the rank whose buffers count (``None`` outside a join)."""
        if verdict is None:
            return None
        reducer.set_divisor(dist.get_world_size(self.group) if self.divide_initial else verdict.count)
        return max(verdict.ranks)

    def buffers_shadow(self, src: int | None) -> tuple[int, ...] | None:
        """How a joined rank takes part in the buffer broadcast from ``src`` (``None``: outside
        a join)."""
        return None if src is None else (syncpoint.JOINABLE, self.index, DDPAction.BUFFERS, src)

    def shadow(self, action: int, verdict: Any, reducer: Reducer, buffer_sync: BufferSync | None) -> None:
        """A rank that has joined takes part in what an active rank's DDP announced."""
        args = verdict.announce[3:]
        if action == DDPAction.BUFFERS:
            buffer_sync.receive(args[0])
        elif action == DDPAction.BUCKET:
            reducer.shadow_bucket(args[0], self.write_back)
        elif action == DDPAction.SPARSE:
            reducer.shadow_sparse()
        # DDPAction.FORWARD: its collectives are announced one by one

    def end(self, module: nn.Module, with_buffers: bool, last: int) -> None:
        """Every rank has joined: every rank takes rank ``last``'s parameters (and buffers, when
        the forwards broadcast them)."""
        tensors = list(module.parameters()) + (list(module.buffers()) if with_buffers else [])
        with torch.no_grad():
            comm.broadcast_tensors(tensors, src=last, group=self.group)

    def leave(self, reducer: Reducer | None) -> None:
        """The join is over: the average is over the whole group again."""
        self.index = None
        if reducer is not None:
            reducer.join_index = None
            reducer.set_divisor(dist.get_world_size(self.group))
