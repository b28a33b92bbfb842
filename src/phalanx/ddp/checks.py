"""DistributedDataParallel's argument checks, its cross-rank agreement check, and what
``shard_gradients`` needs of an optimizer.

Arguments are checked on every rank and the verdicts exchanged in the same collective as the
parameter descriptions (:func:`phalanx.agreement.agree`), so one rank's bad argument is
raised on every rank and none waits.
"""

from __future__ import annotations

from numbers import Real
from typing import Any, Iterable, Protocol

import torch
import torch.distributed as dist
from torch import nn

from ..agreement import agree
from ..errors import NotInitializedError
from .bucketing import MIB


class GradientOwners(Protocol):
    """What ``shard_gradients`` needs of a sharded optimizer (such as
    :class:`~phalanx.ZeroRedundancyOptimizer`): its group, and which rank owns a parameter."""

    process_group: dist.ProcessGroup | None

    def owners_of(self, params: Iterable[torch.Tensor]) -> list[int | None]: ...


def check_group(group: Any) -> None:
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    if not dist.is_initialized():
        raise NotInitializedError(
            "DistributedDataParallel needs a process group: call phalanx.init_process_group() first "
            "(it runs as a single process when nothing in the environment says otherwise)"
        )


def check_arguments(module: Any, bucket_cap_mb: Any, flags: dict[str, Any]) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if bucket_cap_mb is not None:
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, Real):
            raise TypeError(f"bucket_cap_mb must be a number of MiB or None, got {type(bucket_cap_mb).__name__}")
        if not bucket_cap_mb * MIB >= 1:  # a bucket of at least one byte; also refuses NaN
            raise ValueError(f"bucket_cap_mb must be positive (MiB per bucket), got {bucket_cap_mb}")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError(
            "DistributedDataParallel needs a module with at least one parameter that requires a "
            "gradient; this one has none (nothing to average)"
        )


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


def verdict(problem: Exception | None) -> tuple[str, str]:
    """The arguments' item in an agreement: every rank learns which ranks refused them."""
    return ("arguments", "accepted" if problem is None else f"refused: {problem}")


def agree_on_replicas(module, problem, bucket_cap_mb, flags, group) -> None:
    """One exchange: every rank's argument problem, settings, parameters and buffers agree,
    or every rank raises (the first difference, or the problem all ranks share)."""
    items: list[tuple[str, Any]] = [verdict(problem)]
    if problem is None:
        settings = ", ".join(f"{k}={v}" for k, v in {"bucket_cap_mb": bucket_cap_mb, **flags}.items())
        items.append(("settings", settings))
        items += [(n, _describe(p) + ("" if p.requires_grad else " frozen")) for n, p in module.named_parameters()]
        items += [(f"buffer {n}", _describe(b)) for n, b in module.named_buffers()]
    agree("DistributedDataParallel parameters, buffers and settings", group, items=items, problem=problem)


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)} {t.dtype}"


def gradient_owners(module: nn.Module, group: dist.ProcessGroup | None, mid_iteration: bool,
                    optimizer: Any) -> list[int | None]:
    """The owner of each of ``module.named_parameters()`` by ``optimizer``, for
    ``shard_gradients``; or a TypeError, ValueError or RuntimeError saying what is wrong."""
    if not callable(getattr(optimizer, "owners_of", None)) or not hasattr(optimizer, "process_group"):
        raise TypeError(
            "shard_gradients() needs a sharded optimizer such as phalanx.ZeroRedundancyOptimizer "
            f"(its owners_of() says which rank owns each parameter), got {type(optimizer).__name__}"
        )
    ours = dist.get_process_group_ranks(group or dist.group.WORLD)
    theirs = dist.get_process_group_ranks(optimizer.process_group or dist.group.WORLD)
    if ours != theirs:
        raise ValueError(
            "shard_gradients() needs the optimizer sharded over the ranks DDP averages over: "
            f"DDP has global ranks {ours}, the optimizer {theirs}"
        )
    if mid_iteration:
        raise RuntimeError(
            "shard_gradients() was called between a forward and its backward; call it between "
            "iterations (after backward(), or before the first forward)"
        )
    owners = list(optimizer.owners_of(p for _, p in module.named_parameters()))
    if all(owner is None for owner in owners):
        raise ValueError(
            "shard_gradients() needs the optimizer of this model: it holds none of the "
            f"{len(owners)} parameters of this DistributedDataParallel's module"
        )
    return owners
