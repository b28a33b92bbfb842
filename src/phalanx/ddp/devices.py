"""Where a DistributedDataParallel's inputs go: ``device_ids`` and ``output_device`` checked
at construction, and the inputs of each forward moved there.

With ``device_ids=None`` (a CPU module, or one spread over devices) inputs stay where they
are; with ``[local_rank]`` (a module on that one GPU) they are moved to it. One device per
process: inputs are never scattered and outputs never gathered.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def input_device(module: nn.Module, device_ids: Any, output_device: Any) -> torch.device | None:
    """Where inputs must go: ``device_ids[0]``, or ``None`` to leave them where they are."""
    if not device_ids:
        if output_device is not None:
            raise ValueError(f"output_device={output_device!r} needs device_ids; got device_ids={device_ids!r}")
        return None
    if not isinstance(device_ids, (list, tuple)):
        raise TypeError(f"device_ids must be a list such as [local_rank], got {type(device_ids).__name__}")
    if len(device_ids) != 1:
        raise ValueError(f"device_ids must name exactly one device (this process's), got {list(device_ids)}")
    want = _as_cuda_device(device_ids[0])
    have = {t.device for t in module.parameters()} | {t.device for t in module.buffers()}
    if have != {want}:
        found = ", ".join(sorted(str(d) for d in have))
        raise ValueError(
            f"device_ids={list(device_ids)} is for a module on {want}, but the module's tensors are on "
            f"{found}. For a CPU module (or one spread over devices) leave device_ids=None; otherwise "
            f"move the module there first (module.to({str(want)!r}))"
        )
    if output_device is not None and _as_cuda_device(output_device) != want:
        raise ValueError(f"output_device must be None or device_ids[0] ({want}), got {output_device!r}")
    return want


def _as_cuda_device(device: Any) -> torch.device:
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cuda", device)
    if isinstance(device, (str, torch.device)):
        return torch.device(device)
    raise TypeError(f"a device id must be an int or a torch.device, got {type(device).__name__}")


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with its tensors moved to ``device`` (tuples, lists, dicts, namedtuples)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(to_device(v, device) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    if isinstance(obj, dict):
        return type(obj)((k, to_device(v, device)) for k, v in obj.items())
    return obj
