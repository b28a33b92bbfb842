"""ZeroRedundancyOptimizer: optimizer state sharded across ranks (ZeRO stages 1 and 2).

The files, in the order data flows through them:

``partition.py``
    Who owns which parameter: sorted-greedy by size, the same answer on every rank.
``optimizer.py``
    :class:`ZeroRedundancyOptimizer`: a local ``torch.optim`` optimizer over this rank's
    parameters; ``step()`` updates them, then every owner broadcasts its parameters (with
    ``parameters_as_bucket_view``, one flat buffer per owner and device).
``compat.py``
    torch's arguments and methods it refuses (``overlap_with_ddp=True``, ``Join``), saying
    what to use instead.
``clip.py``
    ``clip_grad_norm_`` over a gradient no rank holds whole (ZeRO stage 2): one all-reduce
    of the owners' shares of the norm.
``scaler.py``
    :class:`ShardedGradScaler`: torch's GradScaler whose inf/nan check the ranks agree on, so
    that with sharded gradients every rank skips a step, or none does.
``state.py``
    The state dict: packed by global parameter index (not by rank), so it loads at any
    world size and into the plain optimizer.

Stage 2 (gradients reduced to their owner) is planned by
:meth:`phalanx.DistributedDataParallel.shard_gradients`, which reads the owners from
:meth:`ZeroRedundancyOptimizer.owners_of`.
"""

from .optimizer import ZeroRedundancyOptimizer
from .partition import optimizer_state_bytes, partition_by_size
from .scaler import ShardedGradScaler

__all__ = ["ShardedGradScaler", "ZeroRedundancyOptimizer", "optimizer_state_bytes", "partition_by_size"]
