"""The inputs of each forward moved to where a DistributedDataParallel's inputs go
(``device_ids``, checked at construction by :mod:`phalanx.ddp.options`).

With ``device_ids=None`` (a CPU module, or one spread over devices) inputs stay where they
are; with ``[local_rank]`` (a module on that one GPU) they are moved to it. One device per
process: inputs are never scattered and outputs never gathered.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with its tensors moved to ``device`` (tuples, lists, dicts, namedtuples)."""
    return map_tensors(obj, lambda t: t.to(device, non_blocking=True))


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with ``fn`` applied to each of its tensors (tuples, lists, dicts, namedtuples)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    if isinstance(obj, dict):
        return type(obj)((k, map_tensors(v, fn)) for k, v in obj.items())
    return obj
