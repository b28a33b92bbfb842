"""Token-weighted losses: the gradient of the global per-token mean over ranks and accumulation
steps, whatever number of tokens each rank holds.

With variable-length or packed sequences ranks hold different numbers of tokens. DDP averages
the ranks' gradients, so averaging per-rank *mean* losses weights a token on a short rank more
than one on a long rank (the 2024 gradient-accumulation bug, across ranks). The fix: each rank
sums its tokens' losses and scales the sum by ``world_size / global_tokens``, the global count
agreed in one small all-reduce; DDP's average then divides the world size back out and the
gradient is that of ``sum(all tokens' losses) / global_tokens``, as one process would compute
on the global batch.
"""

from __future__ import annotations

import operator

import torch
import torch.distributed as dist

from ..diagnostics import ledger
from ..ledger import syncpoint


def token_loss_scale(num_tokens: int | torch.Tensor, group: dist.ProcessGroup | None = None, *,
                     mean_over_ranks: bool = True) -> float:
    """The factor to multiply this rank's *summed* token loss by, so that the reduced gradient
    is that of the global per-token mean (a collective: one all-reduce of one number).

    Call it once per optimizer step with the tokens this rank counts over all the step's
    micro-batches (the ones that contribute to the loss, e.g. not padding), then back-propagate
    ``loss_sum * scale`` for each micro-batch.

    Args:
        num_tokens (int or Tensor): this rank's loss tokens in the optimizer step.
        group (ProcessGroup, optional): the ranks that reduce gradients together. Default:
            the world (or this process alone when no process group is initialised).
        mean_over_ranks (bool, optional): the gradients are averaged over the ranks, as
            DDP, ``fully_shard`` and ZeRO do (``True``), or summed (``False``). Default ``True``.

    Returns:
        float: ``world_size / global_tokens`` (``1 / global_tokens`` when summed).

    Raises:
        ValueError: a negative or non-integer count, or no tokens on any rank.

    Example::

        >>> micro = [next(loader_iter) for _ in range(steps)]
        >>> scale = phalanx.token_loss_scale(sum(int((y != -100).sum()) for _, y in micro))
        >>> for i, (x, y) in enumerate(micro):
        ...     with model.no_sync() if i < steps - 1 else contextlib.nullcontext():
        ...         logits = model(x)
        ...         loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
        ...         (loss * scale).backward()
        >>> optimizer.step()
    """
    if isinstance(num_tokens, torch.Tensor):
        num_tokens = num_tokens.item() if num_tokens.numel() == 1 else num_tokens
    try:
        count = None if isinstance(num_tokens, bool) else operator.index(num_tokens)
    except TypeError:
        count = None
    if count is None or count < 0:
        raise ValueError(f"Invalid num_tokens {num_tokens!r}, expected a non-negative integer "
                         "(this rank's loss tokens in the optimizer step)")
    total = torch.tensor([count], dtype=torch.int64)
    world = 1
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        world = dist.get_world_size(group)
        shadow = syncpoint.tensor_shadow(syncpoint.ALL_REDUCE, total, syncpoint.REDUCE_OPS.index("SUM"))
        with ledger().collective("token_loss_scale", (total,), group, check=True, shadow=shadow):
            dist.all_reduce(total, group=group)
    tokens = int(total)
    if tokens == 0:
        raise ValueError("token_loss_scale: no loss tokens on any rank in this step (global "
                         "count 0); the per-token mean is undefined")
    return (world if mean_over_ranks else 1) / tokens
