"""``ZeroRedundancyOptimizer.clip_grad_norm_``: the norm of a gradient no rank holds whole.

Each rank contributes the norm of the gradients of the parameters it owns; one all-reduce
combines the shares (a sum of ``norm ** p``, or a max for ``p = inf``) into the norm
``torch.nn.utils.clip_grad_norm_`` would compute over the whole averaged gradient.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.distributed as dist

# torch.nn.utils.clip_grad_norm_ divides by (total_norm + 1e-6); the same keeps results equal.
_EPS = 1e-6


def clip_grad_norm(
    owned: Sequence[torch.Tensor],
    present: Sequence[torch.Tensor],
    max_norm: Any,
    norm_type: Any,
    error_if_nonfinite: bool,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> torch.Tensor:
    """Scale ``present`` by ``min(1, max_norm / (norm + 1e-6))``; return the norm (a collective).

    ``owned`` are this rank's gradients in the norm (each gradient owned by one rank of
    ``group``); ``present`` every gradient to scale here; ``device`` where the all-reduced
    scalar lives.
    """
    max_norm, norm_type = _check(max_norm, norm_type)
    total = _share(owned, norm_type, device)
    inf = norm_type == math.inf
    dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
    if not inf:
        total = total ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total).item():
        raise RuntimeError(
            f"The total norm of order {norm_type} of the gradients is {total.item()}, so they "
            "cannot be clipped; pass error_if_nonfinite=False to clip anyway"
        )
    coef = torch.clamp(max_norm / (total + _EPS), max=1.0)
    for grad in present:
        grad.mul_(coef.to(grad.device, grad.dtype))
    return total


def _check(max_norm: Any, norm_type: Any) -> tuple[float, float]:
    for name, value in (("max_norm", max_norm), ("norm_type", norm_type)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not norm_type > 0:
        raise ValueError(f"norm_type must be positive (2.0, 1.0, inf, ...), got {norm_type}")
    return float(max_norm), float(norm_type)


def _share(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """This rank's share of the total: the max magnitude (``inf``), else the sum of ``|g|^p``."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.stack([torch.linalg.vector_norm(g, norm_type).float().to(device) for g in grads])
    if norm_type == math.inf:
        return norms.max()
    return (norms ** norm_type).sum()
