"""``clip_grad_norm_`` for a sharded model whose gradients are DTensors and plain tensors
together (``ignored_params``), which ``torch.nn.utils.clip_grad_norm_`` refuses ("got mixed
torch.Tensor and DTensor"). The sharded gradients' norm is the global one (DTensor's
arithmetic combines every rank's share); a plain gradient counts as this rank holds it."""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch.distributed.tensor import DTensor

from ..diagnostics import ledger

# torch.nn.utils.clip_grad_norm_ divides by (total_norm + 1e-6); the same keeps results equal.
_EPS = 1e-6


def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """Clip the gradients of ``parameters`` to a total norm of ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` does, sharded (DTensor) and plain gradients together.

    Args:
        parameters: tensors (or one tensor) whose ``.grad`` to clip.
        max_norm (float): the largest total norm.
        norm_type (float): the norm's order (``inf`` for the largest magnitude). Default 2.
        error_if_nonfinite (bool): raise if the total norm is nan or inf. Default ``False``.
        foreach (bool, optional): passed to torch's norm.

    Returns:
        The total norm of the gradients before clipping (a plain tensor, the same on every
        rank when only sharded gradients take part).

    Example::

        >>> fully_shard(model, ignored_params={model.scale})
        >>> phalanx.fsdp.clip_grad_norm_(model.parameters(), 1.0)
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    sharded = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    norms = []
    if sharded:
        # recorded (hang reports name it); inside phalanx.join, refused on every rank once a rank
        # has joined: the norm needs that rank's shards, which it cannot announce
        mesh = sharded[0].device_mesh  # (HSDP: the norm's shares are summed across the shards)
        group = mesh.get_group(mesh.ndim - 1)
        with ledger().collective("fully_shard clip_grad_norm_ all-reduce", (), group):
            norms.append(torch.nn.utils.get_total_norm(sharded, norm_type, False, foreach).full_tensor())
    if plain:
        norms.append(torch.nn.utils.get_total_norm(plain, norm_type, False, foreach))
    if not norms:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), norm_type) \
        if len(norms) > 1 else norms[0]
    if error_if_nonfinite and not math.isfinite(total.item()):
        raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from "
                           "`parameters` is non-finite, so it cannot be clipped. To disable this "
                           "error and scale the gradients by the non-finite norm anyway, set "
                           "`error_if_nonfinite=False`")
    coef = torch.clamp(max_norm / (total + _EPS), max=1.0).item()
    with torch.no_grad():
        locals_ = [g.to_local() for g in sharded] + plain
        if locals_:
            torch._foreach_mul_(locals_, coef)
    return total
