"""ShardedGradScaler: torch's GradScaler whose inf/nan check every rank agrees on.

torch's ``GradScaler`` looks for an inf or a nan in the gradients of the optimizer it steps, and
skips ``optimizer.step()`` when it finds one. With ZeRO stage 2
(:meth:`phalanx.DistributedDataParallel.shard_gradients`) each rank holds only the gradients
it owns: an inf in rank 0's shard makes rank 0 skip while rank 1, which holds no copy of that
gradient, steps and waits in ZeRO's broadcast for a rank that never comes (phalanx's sync
point names the two ranks instead of hanging, but the run is over). torch's FSDP has the same
problem and its ``ShardedGradScaler`` the same answer: after the local check, the ranks
all-reduce what they found, so every rank skips, or none does, and every rank's scale halves,
or none does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.amp import GradScaler

from ..diagnostics import ledger
from ..ledger import syncpoint
from .optimizer import ZeroRedundancyOptimizer


class ShardedGradScaler(GradScaler):
    r"""A drop-in for ``torch.amp.GradScaler`` whose skip decision is the same on every rank.

    Each time torch's scaler checks an optimizer's gradients for inf/nan (in ``unscale_`` or
    ``step``), the ranks add up what they found (one one-element all-reduce over the
    optimizer's ``process_group``, the world for other optimizers): any rank's inf makes every
    rank skip the step and halve its scale. Needed with sharded gradients (ZeRO stage 2);
    harmless elsewhere (DDP's averaged gradients are alike on every rank).

    Args: torch's ``GradScaler`` arguments (``device``, ``init_scale``, ``growth_factor``,
        ``backoff_factor``, ``growth_interval``, ``enabled``), unchanged.

    Example::

        >>> scaler = phalanx.ShardedGradScaler("cuda")
        >>> with torch.autocast("cuda", torch.float16):
        ...     loss = model(x).sum()
        >>> scaler.scale(loss).backward()
        >>> scaler.step(zero_optimizer)            # every rank steps, or every rank skips
        >>> scaler.update()
    """

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                        found_inf: torch.Tensor, allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        group = optimizer.process_group if isinstance(optimizer, ZeroRedundancyOptimizer) else None
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return per_device
        # A rank holding no gradient on any device has no entry: it still takes part.
        found = torch.stack([t.to(found_inf.device) for t in per_device.values()]).sum() \
            if per_device else found_inf.clone()
        agreed = found.reshape(1).to(torch.float32)
        shadow = syncpoint.tensor_shadow(syncpoint.ALL_REDUCE, agreed, syncpoint.REDUCE_OPS.index("SUM"))
        with ledger().collective("ShardedGradScaler inf check", (agreed,), group, shadow=shadow) as c:
            c.wait(dist.all_reduce(agreed, group=group, async_op=True))
        if not per_device:
            return {found_inf.device: agreed.reshape(()).to(found_inf.dtype)}
        for t in per_device.values():
            t.copy_(agreed.reshape(()))
        return per_device

