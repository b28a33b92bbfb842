"""Dense gradients off the common path: a gradient with a graph (``create_graph=True``), and
one that came sparse for a parameter bucketed as dense.

The reducer copies a bucket's gradients in one batched copy; it leaves these out
(:func:`is_unusual`) and copies each here.

``backward(create_graph=True)``: as in torch's DDP, ``.grad`` holds the average of the
first-order gradients over the ranks, and keeps a graph, but higher-order terms are not
averaged: the average's derivative with respect to this rank's gradient is ``1 / world
size``, the other ranks' gradients being constants (no all-reduce is differentiated). A
warning says so. ``.grad`` is then a new tensor, never a view into its bucket.
"""

from __future__ import annotations

import warnings

import torch

HIGHER_ORDER_WARNING = (
    "DistributedDataParallel with backward(create_graph=True): .grad holds the average of the "
    "first-order gradients over the ranks, but higher-order gradients are not averaged: the "
    "graph of each averaged .grad leads to this rank's gradient only, scaled by 1/world size "
    "(as in torch's DDP). Differentiating .grad gives this rank's share, not the global one"
)


def is_unusual(grad: torch.Tensor) -> bool:
    """Whether ``grad`` has a graph or is sparse: not for the reducer's batched copy."""
    return grad.requires_grad or grad.layout != torch.strided


def copy_unusual(grad: torch.Tensor, slot: torch.Tensor) -> torch.Tensor | None:
    """Copy an unusual ``grad`` (:func:`is_unusual`) into ``slot``.

    Returns ``grad`` when it has a graph (the reducer keeps it to attach the average to it,
    :func:`averaged_with_graph`), else ``None``.
    """
    if grad.layout != torch.strided:  # sparse, for a parameter not known to be sparse
        slot.copy_(grad.to_dense())
        return None
    warnings.warn(HIGHER_ORDER_WARNING, UserWarning, stacklevel=2)
    with torch.no_grad():
        slot.copy_(grad)
    return grad


class _Average(torch.autograd.Function):
    """The average over the ranks (a constant) whose derivative with respect to this
    rank's gradient is ``1 / divisor``."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, average: torch.Tensor, divisor: int) -> torch.Tensor:
        ctx.divisor = divisor
        return average.to(local.dtype, copy=True)  # the bucket's dtype may differ (mixed precision)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad_output / ctx.divisor, None, None


def averaged_with_graph(local: torch.Tensor, average: torch.Tensor, divisor: int) -> torch.Tensor:
    """A new ``.grad``: the value of ``average``, with a graph back to ``local``, this
    rank's gradient."""
    with torch.enable_grad():
        return _Average.apply(local, average, divisor)
