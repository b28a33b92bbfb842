"""16-bit averaging in one all-reduce, with fp16 that cannot overflow; Gloo and NCCL.

torch's ``fp16_compress_hook`` casts ``gradient / world_size`` to fp16 and all-reduces it: a
gradient above 65504 x world size becomes ``inf``, and small ones flush to zero. Its
``bf16_compress_hook`` is refused by torch's DDP without NCCL. :func:`average_16bit` sends
the same bytes in the same single all-reduce (so a bucket's communication overlaps the rest
of the backward, as torch's does), and:

* **bf16** has fp32's range: the values are divided by the world size, cast and summed, as
  torch's bf16 hook does (on Gloo too: Gloo sums bf16).
* **fp16** is multiplied by a power-of-two scale (exact) that every rank agrees on, chosen
  so that the largest *sum of the ranks' largest magnitudes* lands in ``[2**11, 2**12)``:
  every partial sum of the all-reduce stays below ``2**15``, half of fp16's largest finite
  value (65504), with room for the gradients to grow 8x before the next rescale, and small
  values stay far from fp16's subnormals. Each rank appends its own largest scaled
  magnitude to the all-reduce; their sum comes back to every rank, identical, and proves
  the bound (``<= 2**15``: no partial sum can have overflowed) and sets the next backward's
  scale, so no collective is spent on agreeing it. When the proof fails (the gradients grew
  more than 8x, or a first call with nothing remembered) the ranks agree on a scale with a
  one-number all-reduce of their largest magnitudes and send again; ``inf`` or ``nan`` that
  no scale can save are sent unscaled, as torch would.

The scale is remembered per bucket in ``memory`` (phalanx's DDP gives each hooked bucket
one; see :func:`~phalanx.hooks.bucket_memory`). Without one (torch's DDP,
:class:`~phalanx.DiLoCo`) every call agrees on its scale first.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from ..hooks import GradBucket, PhasedHook, Phases, bucket_memory

# The sum of the ranks' largest scaled magnitudes is brought to [2**11, 2**12) ...
TARGET_EXPONENT = 12
# ... and must come back at most 2**15 (half of fp16's 65504) for the all-reduce to be valid.
LIMIT = 2.0**15
# fp32's normal exponents: a scale stays a finite, normal power of two.
MIN_EXPONENT, MAX_EXPONENT = -126, 127
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def average_16bit(flat: torch.Tensor, dtype: torch.dtype, group: dist.ProcessGroup | None = None,
                  memory: dict | None = None) -> Phases:
    """The phases that leave the average of ``flat`` (1-D, floating point) over ``group`` in
    ``flat``, sent as ``dtype`` (``torch.float16`` or ``torch.bfloat16``); returns ``flat``.

    A generator (see :class:`~phalanx.hooks.PhasedHook`): it yields the work of each
    collective: normally one all-reduce; for fp16 a one-number all-reduce first when no
    agreed scale is in ``memory``, and a second all-reduce after a failed bound (module
    notes). ``memory``: a dict kept between calls for the same tensor (the same on every
    rank), or ``None``.
    """
    world = dist.get_world_size(group)
    n = flat.numel()
    if dtype == torch.bfloat16:
        send = flat.div_(world).to(dtype)
        yield dist.all_reduce(send, group=group, async_op=True)
        return flat.copy_(send)
    send = torch.empty(n + 1, dtype=dtype, device=flat.device)  # the values, then the bound
    scale = None if memory is None else memory.get("scale")
    applied = 1.0  # the scale flat is multiplied by so far
    while True:
        agreed = scale is None
        if agreed:
            scale = yield from _agreed_scale(flat, applied, group)
        if scale != applied:
            flat.mul_(scale / applied)
            applied = scale
        send[:n].copy_(flat)
        send[n] = _largest(send[:n])  # on the device: no wait for a GPU in the backward
        yield dist.all_reduce(send, group=group, async_op=True)
        bound = send[n].item()
        if bound <= LIMIT or agreed:  # proven; or inf/nan that no scale can save
            break
        scale = None  # the gradients grew beyond the remembered scale: agree on a new one
    if memory is not None and 0.0 < bound <= LIMIT:
        memory["scale"] = _clamp(scale * 2.0 ** (TARGET_EXPONENT - math.frexp(bound)[1]))
    flat.copy_(send[:n])
    return flat.mul_(1.0 / (applied * world))


def _agreed_scale(flat: torch.Tensor, applied: float, group: Any) -> Phases:
    """One all-reduce of the ranks' largest magnitudes (of ``flat / applied``): the scale
    that brings their sum to ``[2**11, 2**12)``; 1.0 for zeros, ``inf`` or ``nan``."""
    total = (_largest(flat) / applied).float().reshape(1)
    yield dist.all_reduce(total, group=group, async_op=True)
    return scale_for(total.item())


def scale_for(total: float) -> float:
    """The power of two that brings ``total`` (a sum of largest magnitudes) into
    ``[2**11, 2**12)``; 1.0 for zero, ``inf`` or ``nan``, which no scale can help."""
    if not 0.0 < total < float("inf"):
        return 1.0
    return _clamp(2.0 ** (TARGET_EXPONENT - math.frexp(total)[1]))  # total in [2**(e-1), 2**e)


def _clamp(scale: float) -> float:
    exponent = math.frexp(scale)[1] - 1
    return 2.0 ** min(MAX_EXPONENT, max(MIN_EXPONENT, exponent))


def _largest(values: torch.Tensor) -> torch.Tensor:
    """The largest magnitude in ``values`` (``inf``/``nan`` if any is), a 0-d tensor."""
    if values.numel() == 0:
        return torch.zeros((), dtype=values.dtype, device=values.device)
    low, high = torch.aminmax(values)
    return torch.maximum(high, -low)  # nan if either is


def _average_bucket(dtype: torch.dtype, group: Any, bucket: GradBucket) -> Phases:
    buffer = bucket.buffer()
    if buffer.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"16-bit compression averages float32/float64 gradients; bucket {bucket.index()} "
                        f"holds {buffer.dtype}")
    return (yield from average_16bit(buffer, dtype, group, bucket_memory(bucket)))


def _fp16(process_group: dist.ProcessGroup | None, bucket: GradBucket) -> Phases:
    return (yield from _average_bucket(torch.float16, process_group, bucket))


def _bf16(process_group: dist.ProcessGroup | None, bucket: GradBucket) -> Phases:
    return (yield from _average_bucket(torch.bfloat16, process_group, bucket))


# One all-reduce per bucket: the next phase (the decoding) waits for the end of the backward,
# so the next buckets' all-reduces are launched while this one is on the wire.
fp16_compress_hook = PhasedHook(_fp16, "fp16_compress_hook", eager=False)
fp16_compress_hook.__doc__ = """Average each bucket in fp16 on the wire, with a power-of-two scale the
ranks agree on so nothing overflows (:func:`average_16bit`); one all-reduce per bucket, as
torch's. ``state``: the process group (``None``: the default group), as for torch's
``fp16_compress_hook``.

Example::

    >>> ddp.register_comm_hook(None, phalanx.comm_hooks.fp16_compress_hook)
"""
bf16_compress_hook = PhasedHook(_bf16, "bf16_compress_hook", eager=False)
bf16_compress_hook.__doc__ = """Average each bucket in bf16 on the wire (:func:`average_16bit`); on Gloo
as on NCCL. ``state``: the process group (``None``: the default group), as for torch's
``bf16_compress_hook``.

Example::

    >>> ddp.register_comm_hook(None, phalanx.comm_hooks.bf16_compress_hook)
"""
