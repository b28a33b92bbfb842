"""Rank 0's buffers (BatchNorm running statistics...) to every rank before a forward."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..diagnostics.monitor import watched


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
        self.is_src = dist.get_rank() == src
        self._last = comm.LastWorks()

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        with watched("DDP buffer broadcast", tensors, self.group):
            pending = comm.broadcast_async(tensors, src=self.src, group=self.group)
            pending.wait()
        self._last.hold(pending)

    def sync(self, fresh: bool) -> None:
        buffers = list(self.module.buffers())
        if not fresh or self.is_src:  # rank src only reads its buffers
            self._broadcast(buffers)
            return
        received = [torch.empty_like(b) for b in buffers]
        self._broadcast(received)
        replace = {id(old): new for old, new in zip(buffers, received)}
        for sub in self.module.modules():
            for name, old in sub._buffers.items():
                if old is not None and id(old) in replace:
                    sub._buffers[name] = replace[id(old)]
