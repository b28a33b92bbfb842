"""Rank 0's buffers (BatchNorm running statistics...) to every rank before a forward."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..diagnostics import ledger


BUFFERS = "DDP buffer broadcast"  # its name in the collective log


class BufferSync:
    """Overwrites every rank's buffers with rank ``src``'s.

    In place normally; with ``fresh=True`` (a graph may have saved the old buffers for its
    backward) the values land in new tensors that replace the old ones in every module that
    registers them, so the saved ones keep their version and the backward still works.

    Args:
        module: the module whose buffers are synchronised.
        group: the process group; ``None`` is the default group.
        src: the global rank whose buffers everyone takes.
    """

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None, src: int) -> None:
        self.module = module
        self.group = group
        self.src = src
        self._last = comm.LastWorks()

    def _broadcast(self, tensors: list[torch.Tensor], src: int, shadow: Any) -> None:
        with ledger().collective(BUFFERS, tensors, self.group, shadow=shadow) as c:
            pending = comm.broadcast_async(tensors, src=src, group=self.group)
            c.wait(pending)
        self._last.hold(pending)

    def sync(self, fresh: bool, src: int | None = None, shadow: Any = None) -> None:
        """Broadcast rank ``src``'s buffers (default: the constructor's). ``shadow``: how a
        rank that has joined takes part (phalanx.join: :meth:`receive`)."""
        src = self.src if src is None else src
        buffers = list(self.module.buffers())
        if not fresh or dist.get_rank() == src:  # rank src only reads its buffers
            self._broadcast(buffers, src, shadow)
            return
        received = [torch.empty_like(b) for b in buffers]
        self._broadcast(received, src, shadow)
        replace = {id(old): new for old, new in zip(buffers, received)}
        for sub in self.module.modules():
            for name, old in sub._buffers.items():
                if old is not None and id(old) in replace:
                    sub._buffers[name] = replace[id(old)]

    def receive(self, src: int) -> None:
        """A rank that has joined (phalanx.join): take rank ``src``'s buffers, as the others do."""
        with torch.no_grad():
            comm.broadcast_async(list(self.module.buffers()), src=src, group=self.group).wait()
