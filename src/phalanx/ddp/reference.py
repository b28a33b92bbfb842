"""A naive data-parallel wrapper, kept as the oracle the bucketed one is tested against.

No buckets, no hooks, no overlap: after ``backward()`` the caller runs
:meth:`NaiveDDP.sync_gradients`, which all-reduces every gradient on its own. Slow and
obviously right, which is its whole purpose.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import comm


class NaiveDDP(nn.Module):
    """Replicates ``module`` from rank 0; averages gradients one parameter at a time.

    Args:
        module (nn.Module): the model.
        group (ProcessGroup, optional): the group to average over. Default ``None`` (the world).

    Example::

        >>> model = NaiveDDP(net)
        >>> loss_fn(model(x), y).backward()
        >>> model.sync_gradients()
        >>> opt.step()
    """

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.module = module
        self.group = group
        src = 0 if group is None else dist.get_global_rank(group, 0)
        with torch.no_grad():
            comm.broadcast_tensors(list(module.parameters()) + list(module.buffers()), src=src, group=group)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """Average ``.grad`` over the group; a missing one counts as zeros, unless it is missing everywhere."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        has_grad = torch.tensor([float(p.grad is not None) for p in params])
        dist.all_reduce(has_grad, group=self.group)
        world = dist.get_world_size(self.group)
        for p, anywhere in zip(params, has_grad.tolist()):
            if anywhere == 0:
                continue
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grad, group=self.group)
            p.grad = grad.div_(world)
