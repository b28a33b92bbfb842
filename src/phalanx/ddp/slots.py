"""Gradients into a bucket's slots and averages back into ``.grad``: the reducer's only
tensor work per parameter, done once per bucket, batched (see :mod:`phalanx.ddp.reducer`).

:func:`fill` runs when a bucket launches: one ``torch._foreach_copy_`` of the gradients not
in their slot already (it casts where the bucket's dtype differs: mixed precision's
``reduce_dtype``), then one division of the whole buffer. :func:`write_back` runs when its
collective is done. A slot becomes ``.grad`` where the DDP's ``gradient_as_bucket_view``
allows it, the bucket is kept on this rank, and its dtype is the one ``.grad`` must have
(``seats``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .bucketing import Bucket
from .unusual import copy_unusual, is_unusual


def grad_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype ``param.grad`` has: its ``grad_dtype`` (mixed precision pins the master's),
    or, where any is allowed (``None``), its own."""
    pinned = getattr(param, "grad_dtype", None)  # an attribute of torch 2.10 and later
    return param.dtype if pinned is None else pinned


def fill(bucket: Bucket, params: Sequence[torch.Tensor], seats: Sequence[bool], divisor: int,
         had_grad: list[bool], graphs: dict[int, torch.Tensor],
         extra: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> None:
    """Put the bucket's contributions, divided by ``divisor``, into its buffer.

    A parameter without a gradient contributes zeros (``had_grad[k]`` set ``False``); a
    gradient with a graph (``create_graph=True``) is copied on its own and kept in
    ``graphs[k]``, out of ``.grad``; where ``seats[k]``, ``.grad`` becomes the slot; in a bucket
    this rank does not keep, the gradients are released once copied. ``extra``: ``(destination,
    source)`` pairs outside the gradients (the control tail, a sync point's head), copied in
    the same batched call, not divided (an eager call costs more than a small copy).
    """
    if bucket.buffer is None:
        bucket.allocate()
    # Gradient mode is on inside a backward only with create_graph=True: gradients may then
    # have graphs, and take the unusual path (so may sparse ones: the except below).
    unusual = torch.is_grad_enabled()
    # the slots a gradient is divided into on its way (bucketing.DIVIDE_INTO_SLOT), if any
    into_slot = bucket.large if divisor != 1 else ()
    first = bucket.first
    end = first + len(bucket.views)
    sources: list[torch.Tensor] = []
    slots: list[torch.Tensor] = []  # the copies' destinations: gradients' slots, then extra's
    in_place: list[torch.Tensor] = []  # slots that hold their gradient already
    divided = False
    for k, param, view, seat in zip(range(first, end), params[first:end], bucket.views, seats[first:end]):
        grad = param.grad
        if grad is None:
            had_grad[k] = False
            view.zero_()
            continue
        if grad is view:
            in_place.append(view)
            continue
        if unusual and is_unusual(grad):
            graph = copy_unusual(grad, view)
            if graph is not None:  # kept out of .grad, which the write-back copies into
                graphs[k] = graph
                param.grad = None
            in_place.append(view)
            continue
        if into_slot and into_slot[k - first] and grad.dtype == view.dtype and grad.layout == torch.strided:
            torch.div(grad, divisor, out=view)  # one pass, not a copy then a division
            divided = True
        else:
            sources.append(grad)
            slots.append(view)
        if seat:
            param.grad = view
    copied = len(slots)
    for destination, source in extra:
        slots.append(destination)
        sources.append(source)
    if sources:
        try:
            torch._foreach_copy_(slots, sources)
        except RuntimeError:  # a sparse gradient for a parameter bucketed as dense
            for slot, grad in zip(slots, sources):
                slot.copy_(grad.to_dense() if grad.layout != torch.strided else grad)
    if divisor != 1 and not divided:
        bucket.grads.div_(_divisor(divisor, bucket.grads))  # the whole buffer at once
    elif divisor != 1 and (in_place or copied):
        torch._foreach_div_(in_place + slots[:copied], divisor)
    if not bucket.keep:
        for param in params[first:end]:
            param.grad = None


# (divisor, dtype, device) -> the divisor as a tensor of one value (a scalar argument costs a
# tensor made per call)
_DIVISORS: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def _divisor(divisor: int, like: torch.Tensor) -> int | torch.Tensor:
    """``divisor`` for dividing ``like``: a 0-dimensional tensor of its dtype (the same bits as
    the number itself: the operand of a division by a scalar, in ``like``'s dtype), where that
    dtype holds it exactly (float32, float64), on the CPU (CUDA multiplies by the reciprocal of
    a scalar: other bits than a tensor's division), else the number."""
    if like.dtype not in (torch.float32, torch.float64) or like.device.type != "cpu" or divisor >= 1 << 24:
        return divisor
    key = (divisor, like.dtype, like.device)
    found = _DIVISORS.get(key)
    if found is None:
        found = _DIVISORS[key] = torch.tensor(float(divisor), dtype=like.dtype, device=like.device)
    return found


def write_back(bucket: Bucket, params: Sequence[torch.Tensor], seats: Sequence[bool],
               used: list[bool] | None) -> None:
    """The bucket's averages into ``.grad``, if this rank keeps them (else ``.grad`` is None).

    A slot that can be ``.grad`` (``seats``) becomes it, if :func:`fill` did not make it so
    already; else the averages are copied into the ``.grad`` tensors, in one batched copy
    (which casts: mixed precision's ``reduce_dtype``), or into new ones of ``.grad``'s dtype.
    ``used`` (with unused parameters allowed): whether any rank had a gradient for parameter k.
    """
    if not bucket.keep:
        return  # fill released the gradients; the reducer releases the buffer
    grads: list[torch.Tensor] = []
    averages: list[torch.Tensor] = []
    for k, view in zip(bucket.positions, bucket.views):
        param = params[k]
        grad = param.grad
        if grad is view or used is not None and not used[k]:
            continue  # seated already, or no rank has a gradient: leave .grad, as torch does
        if seats[k]:
            param.grad = view
        elif grad is None:
            param.grad = view.to(grad_dtype(param), copy=True)
        else:
            grads.append(grad)
            averages.append(view)
    if grads:
        torch._foreach_copy_(grads, averages)
