"""16-bit averaging that cannot overflow: fp16 and bf16 on the wire, fp32 sums, Gloo and NCCL.

torch's ``fp16_compress_hook`` casts ``gradient / world_size`` to fp16 and all-reduces it: a
gradient above 65504 x world size becomes ``inf``, small ones flush to zero, and the sum
itself is rounded to fp16 at every addition. Its ``bf16_compress_hook`` is refused by
torch's DDP without NCCL. :func:`average_16bit` instead sends each rank's chunk as 16-bit
values with a scale of their own and sums in fp32:

1. The buffer is cut into ``world_size`` chunks (the last one padded with zeros). Each chunk
   is scaled by a power of two that brings its largest magnitude into ``[2**14, 2**15)``
   (fp16: far from the 65504 limit, and small values stay far from fp16's subnormals; bf16
   has fp32's range and is sent unscaled), cast, and prefixed by its fp32 scale, carried
   bit for bit in two 16-bit slots.
2. ``all_to_all``: rank ``r`` receives every rank's chunk ``r`` (a reduce-scatter, which
   Gloo has no 16-bit form of), divides each by its scale and sums them in fp32, divided by
   the world size.
3. Its average chunk is scaled and cast the same way, and ``all_gather`` gives every rank
   every average chunk, cast back into the buffer.

Each rank sends ``2 (N - 1) / N`` of the buffer in 16-bit values, as a ring all-reduce
does, with one rounding per value on the way in and one on the way out whatever the world
size, and no extra collective for the scales.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from ..comm import all_gather_tensor
from ..ddp.comm_hook import GradBucket, PhasedHook, Phases

# An fp32 scale travels in the first two 16-bit slots of each chunk (4 bytes = 2 x 2 bytes).
HEADER = 2
# Scaled chunks reach at most 2**15 in magnitude: half of fp16's largest finite value (65504).
TARGET_EXPONENT = 15
# fp32's normal exponents: a scale stays a finite, normal power of two.
MIN_EXPONENT, MAX_EXPONENT = -126, 127
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def average_16bit(flat: torch.Tensor, dtype: torch.dtype, group: dist.ProcessGroup | None = None) -> Phases:
    """The phases that leave the average of ``flat`` (1-D, floating point) over ``group`` in
    ``flat``, sent as ``dtype`` (``torch.float16`` or ``torch.bfloat16``); returns ``flat``.

    A generator (see :class:`~phalanx.ddp.comm_hook.PhasedHook`): it yields the work of the
    ``all_to_all``, then of the ``all_gather``. ``flat`` serves as scratch space meanwhile.
    Elementwise work is done as same-dtype arithmetic and plain casting copies: on CPU, one
    op that mixes fp32 and 16-bit operands is 3-5x slower than the two.
    """
    world = dist.get_world_size(group)
    n = flat.numel()
    length = max(1, -(-n // world))  # elements per chunk, the last one padded
    send = torch.empty(world, HEADER + length, dtype=dtype, device=flat.device)
    rows = [flat[r * length : min(n, (r + 1) * length)] for r in range(world)]
    for r, row in enumerate(rows):
        _encode(row, send[r], dtype)
    received = torch.empty_like(send)
    yield dist.all_to_all_single(received.view(-1), send.view(-1), group=group, async_op=True)
    mine = torch.empty(length, dtype=flat.dtype, device=flat.device)
    decoded = torch.empty_like(mine)
    for r, scale in enumerate(_scales(received).tolist()):
        (mine if r == 0 else decoded).copy_(received[r, HEADER:])
        if r == 0:
            mine.mul_(1.0 / (scale * world))
        else:
            mine.add_(decoded, alpha=1.0 / (scale * world))
    out = torch.empty(HEADER + length, dtype=dtype, device=flat.device)
    _encode(mine, out, dtype)
    gathered = torch.empty(world * (HEADER + length), dtype=dtype, device=flat.device)
    yield all_gather_tensor(gathered, out, group=group, async_op=True)
    gathered = gathered.view(world, HEADER + length)
    for r, (row, scale) in enumerate(zip(rows, _scales(gathered).tolist())):
        row.copy_(gathered[r, HEADER : HEADER + row.numel()])
        if scale != 1.0:
            row.mul_(1.0 / scale)
    return flat


def _encode(values: torch.Tensor, into: torch.Tensor, dtype: torch.dtype) -> None:
    """``into`` = [scale as two 16-bit slots, values * scale cast to ``dtype``, zeros].
    ``values`` is scaled in place."""
    scale = _scale(values) if dtype == torch.float16 else 1.0
    into[:HEADER] = torch.tensor([scale], dtype=torch.float32, device=into.device).view(dtype)
    if scale != 1.0:
        values.mul_(scale)
    into[HEADER : HEADER + values.numel()].copy_(values)
    into[HEADER + values.numel() :].zero_()


def _scale(values: torch.Tensor) -> float:
    """The power of two that brings the largest finite magnitude of ``values`` to [2**14, 2**15)."""
    if values.numel() == 0:
        return 1.0
    low, high = torch.aminmax(values)
    largest = max(-low.item(), high.item())
    if not 0.0 < largest < float("inf"):  # zeros, or inf/nan that no scale can save: sent as they are
        return 1.0
    exponent = TARGET_EXPONENT - math.frexp(largest)[1]  # largest in [2**(e-1), 2**e)
    return 2.0 ** min(MAX_EXPONENT, max(MIN_EXPONENT, exponent))


def _scales(chunks: torch.Tensor) -> torch.Tensor:
    """The fp32 scales in the headers of ``chunks`` (one chunk per row)."""
    return chunks[:, :HEADER].contiguous().view(torch.float32).view(-1)


def _average_bucket(dtype: torch.dtype, group: Any, bucket: GradBucket) -> Phases:
    buffer = bucket.buffer()
    if buffer.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"16-bit compression averages float32/float64 gradients; bucket {bucket.index()} "
                        f"holds {buffer.dtype}")
    return (yield from average_16bit(buffer, dtype, group))


def _fp16(process_group: dist.ProcessGroup | None, bucket: GradBucket) -> Phases:
    return (yield from _average_bucket(torch.float16, process_group, bucket))


def _bf16(process_group: dist.ProcessGroup | None, bucket: GradBucket) -> Phases:
    return (yield from _average_bucket(torch.bfloat16, process_group, bucket))


fp16_compress_hook = PhasedHook(_fp16, "fp16_compress_hook")
fp16_compress_hook.__doc__ = """Average each bucket in fp16 on the wire, scaled per chunk so nothing
overflows, summed in fp32 (:func:`average_16bit`). ``state``: the process group (``None``:
the default group), as for torch's ``fp16_compress_hook``.

Example::

    >>> ddp.register_comm_hook(None, phalanx.comm_hooks.fp16_compress_hook)
"""
bf16_compress_hook = PhasedHook(_bf16, "bf16_compress_hook")
bf16_compress_hook.__doc__ = """Average each bucket in bf16 on the wire, summed in fp32
(:func:`average_16bit`); on Gloo as on NCCL. ``state``: the process group (``None``: the
default group), as for torch's ``bf16_compress_hook``.

Example::

    >>> ddp.register_comm_hook(None, phalanx.comm_hooks.bf16_compress_hook)
"""
