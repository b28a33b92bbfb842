"""torch 2.13's ``DistributedDataParallel`` arguments beyond phalanx's core ones: each is
taken with torch's meaning, or refused with a message naming it and saying what phalanx
does instead.

* ``device_mesh``: a 1-D mesh; its group is the one averaged over (as in torch).
* ``broadcast_buffers`` (deprecated by torch 2.13) and ``forward_sync_buffers``: which of
  the construction broadcast and the before-forward broadcasts include the buffers.
* ``bucket_cap_mb`` and ``bucket_cap_mb_list``: the bucket caps.
* ``check_reduction``: deprecated, ignored, with torch's ``FutureWarning``.
* ``delay_all_reduce_named_params``, ``param_to_hook_all_reduce``, ``mixed_precision``, and a
  module marked with parameters to ignore: refused (:func:`refuse_torch_only`).

``dim``, ``init_sync``, ``skip_all_reduce_unused_params`` and ``batched_grad_copy`` are
checked with the other flags (:mod:`phalanx.ddp.checks`); the wrapper's docstring says what
each does here. :func:`resolve_arguments` runs every check of the arguments.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from numbers import Real
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import UsageError
from .bucketing import DEFAULT_BUCKET_CAP_MB, FIRST_BUCKET_BYTES, MIB
from .checks import check_flags, check_module
from .devices import input_device

# torch 2.13's text, word for word, so that filters written for torch's warning match ours.
CHECK_REDUCTION_WARNING = (
    "The `check_reduction` argument in `DistributedDataParallel` module is deprecated. "
    "Please avoid using it."
)
BOTH_BUFFER_FLAGS_WARNING = (
    "Both `broadcast_buffers` and `forward_sync_buffers` were given: `broadcast_buffers` is "
    "ignored (torch 2.13 deprecates it for `forward_sync_buffers`)."
)
NOTHING_IGNORED = (
    "phalanx's DistributedDataParallel averages every trainable parameter and broadcasts every "
    "buffer; it ignores none. Freeze parameters (requires_grad=False) to keep their gradients out"
)


@dataclass(frozen=True)
class Arguments:
    """What the constructor's arguments come to."""

    device: torch.device | None  # where inputs go (None: they stay where they are)
    caps: tuple[int, ...]  # bucket caps in bytes (plan_buckets' caps)
    forward_sync_buffers: bool  # broadcast buffers before forwards
    init_sync_buffers: bool  # broadcast buffers at construction
    settings: dict[str, Any]  # what every rank must hold alike


def resolve_arguments(module: Any, device_ids: Any, output_device: Any, dim: Any, flags: dict[str, Any],
                      buffers: tuple[Any, Any], bucket_cap_mb: Any, bucket_cap_mb_list: Any,
                      torch_only: dict[str, Any]) -> Arguments:
    """Check every argument (``TypeError``, ``ValueError``), and resolve them.

    ``buffers`` is ``(broadcast_buffers, forward_sync_buffers)``; ``torch_only`` holds the
    arguments :func:`refuse_torch_only` takes, by name.
    """
    check_module(module)
    check_flags(flags, dim)
    refuse_torch_only(module, **torch_only)
    forward_sync, init_buffers = buffer_flags(*buffers)
    caps = bucket_caps(bucket_cap_mb, bucket_cap_mb_list)
    device = input_device(module, device_ids, output_device)
    settings = {"bucket_cap_mb": bucket_cap_mb, "broadcast_buffers": forward_sync, "init_sync_buffers": init_buffers,
                "bucket_cap_mb_list": bucket_cap_mb_list, **flags}
    return Arguments(device, caps, forward_sync, init_buffers, settings)


def resolve_group(process_group: Any, device_mesh: Any) -> Any:
    """The group to average over: ``process_group``, or the group of a 1-D ``device_mesh``."""
    if device_mesh is None:
        return process_group
    if process_group is not None:
        raise UsageError(
            "DistributedDataParallel takes process_group or device_mesh, not both: got "
            f"process_group={process_group!r} and device_mesh={device_mesh!r}"
        )
    if device_mesh.ndim != 1:
        raise UsageError(
            "DistributedDataParallel takes a 1-D device_mesh (its dimension is the ranks to "
            f"average over), got a {device_mesh.ndim}-D mesh {device_mesh}; pass the "
            "data-parallel dimension, e.g. mesh['dp']"
        )
    return device_mesh.get_group(mesh_dim=0)


def refuse_torch_only(module: nn.Module, delay_all_reduce_named_params: Any,
                      param_to_hook_all_reduce: Any, mixed_precision: Any, device_mesh: Any) -> None:
    """Raise ``ValueError`` for the torch arguments phalanx does not take."""
    if delay_all_reduce_named_params is not None or param_to_hook_all_reduce is not None:
        raise ValueError(
            "delay_all_reduce_named_params and param_to_hook_all_reduce are torch's (all-reduce "
            "some parameters in one go once another one's gradient is ready); phalanx's "
            "DistributedDataParallel does not hold parameters back: it averages every trainable "
            "parameter in its buckets during the backward. Leave both None"
        )
    if mixed_precision is not None:
        raise ValueError(
            f"mixed_precision={mixed_precision!r} is torch DDP's prototype (parameters cast to "
            "a lower dtype around forward and backward); phalanx does not cast: it averages "
            "gradients in the parameters' own dtype. Use torch.autocast, or convert the module "
            "(module.to(torch.bfloat16)) before wrapping it"
        )
    ignored = getattr(module, "_ddp_params_and_buffers_to_ignore", None)
    if ignored:
        raise ValueError(f"the module names parameters and buffers for DDP to ignore ({sorted(ignored)}, "
                         f"set by _set_params_and_buffers_to_ignore_for_model): {NOTHING_IGNORED}")
    if device_mesh is not None:
        # imported only for a mesh: it takes time
        from torch.distributed.tensor import DTensor

        tensors = [n for n, p in module.named_parameters() if isinstance(p, DTensor)]
        if tensors:
            raise ValueError(
                f"parameters {tensors} are DTensors (tensor parallelism on the mesh); phalanx's "
                "DistributedDataParallel takes plain tensors only: it does not localise "
                "DTensor parameters as torch's DDP + TP does"
            )


def buffer_flags(broadcast_buffers: bool | None, forward_sync_buffers: bool | None) -> tuple[bool, bool]:
    """``(before forwards, at construction)``: whether buffers are broadcast then (torch 2.13).

    ``forward_sync_buffers`` decides the forwards and leaves the construction broadcast on;
    without it, ``broadcast_buffers`` decides both (default ``True``).
    """
    for name, value in (("broadcast_buffers", broadcast_buffers), ("forward_sync_buffers", forward_sync_buffers)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name} must be True, False or None, got {value!r}")
    if forward_sync_buffers is not None:
        if broadcast_buffers is not None:
            warnings.warn(BOTH_BUFFER_FLAGS_WARNING, FutureWarning, stacklevel=4)
        return forward_sync_buffers, True
    both = True if broadcast_buffers is None else broadcast_buffers
    return both, both


def warn_check_reduction(check_reduction: Any) -> None:
    if check_reduction:  # torch's test: any true value
        warnings.warn(CHECK_REDUCTION_WARNING, FutureWarning, stacklevel=3)


def bucket_caps(bucket_cap_mb: Any, bucket_cap_mb_list: Any) -> tuple[int, ...]:
    """The cap in bytes of the first bucket of each (device, dtype), of the second..., the
    last cap holding for the rest (see :func:`~phalanx.ddp.bucketing.plan_buckets`).

    Default: 25 MiB with a 1 MiB first bucket; ``bucket_cap_mb`` alone caps every bucket,
    the first included (torch 2.13 does the same); ``bucket_cap_mb_list`` gives each bucket
    its own cap and overrides ``bucket_cap_mb`` (torch's meaning).
    """
    if bucket_cap_mb_list is not None:
        if isinstance(bucket_cap_mb_list, (str, bytes)) or not hasattr(bucket_cap_mb_list, "__iter__"):
            raise TypeError(f"bucket_cap_mb_list must be a list of MiB, got {type(bucket_cap_mb_list).__name__}")
        caps = [_mib("bucket_cap_mb_list items", mb, "numbers of MiB") for mb in bucket_cap_mb_list]
        if caps:
            return tuple(caps)
    if bucket_cap_mb is None:
        return (FIRST_BUCKET_BYTES, DEFAULT_BUCKET_CAP_MB * MIB)
    return (_mib("bucket_cap_mb", bucket_cap_mb, "a number of MiB or None"),)


def _mib(name: str, value: Any, expected: str) -> int:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__}")
    if not value * MIB >= 1:  # a bucket of at least one byte; also refuses NaN
        raise ValueError(f"{name} must be positive (MiB per bucket), got {value}")
    return int(value * MIB)


def is_default_group(group: Any) -> bool:
    """Whether ``group`` means the default (world) group of whichever process holds it."""
    return group is None or (dist.is_initialized() and group == dist.group.WORLD)


# Public attributes and methods of torch's DDP that phalanx's does not have, and why: the
# wrapper's AttributeError for each says so (docs/torch_surface_ddp.md lists them).
_LOGGING = "phalanx has no DDP logger; for the bucket plan set logging.getLogger('phalanx') to DEBUG"
_ONE_DEVICE = ("with one device per process inputs are moved to device_ids[0], never scattered, and "
               "outputs are never gathered")
_CAPS = "phalanx keeps the arguments (bucket_cap_mb, bucket_cap_mb_list); the planned buckets are in bucket_plan"
_WHERE = "the module's parameters say where it is (next(ddp.parameters()).device)"
_BUFFERS = "phalanx broadcasts every buffer of the module: module.buffers(), module.named_buffers()"
_TORCH_JOIN = ("it serves torch's Join; phalanx's DDP joins phalanx.Join: `with model.join():` or "
               "`with phalanx.join(model, optimizer, ...):`")
TORCH_ONLY_ATTRIBUTES = {
    "join_hook": _TORCH_JOIN,
    "join_device": _TORCH_JOIN,
    "join_process_group": _TORCH_JOIN,
    "reducer": "it is torch's C++ dist.Reducer; phalanx's reducer is its own and private (the buckets "
               "are in bucket_plan)",
    "logger": _LOGGING,
    "_get_ddp_logging_data": _LOGGING,
    "scatter": _ONE_DEVICE,
    "gather": _ONE_DEVICE,
    "to_kwargs": _ONE_DEVICE,
    "use_side_stream_for_tensor_copies": "inputs are moved with non_blocking=True on the current stream",
    "_register_fused_optim": "no optimizer step runs inside the backward; call optimizer.step() after "
                             "backward()",
    "_set_static_graph": "pass static_graph=True to the constructor",
    "bucket_bytes_cap": _CAPS,
    "bucket_bytes_cap_list": _CAPS,
    "bucket_bytes_cap_default": _CAPS,
    "broadcast_bucket_size": "the construction broadcast goes in chunks of phalanx.comm.BROADCAST_CHUNK_BYTES",
    "parameters_to_ignore": NOTHING_IGNORED,
    "modules_buffers": _BUFFERS,
    "named_module_buffers": _BUFFERS,
    "buffer_hook": "rank 0's buffers are broadcast by phalanx itself before forwards: there is no buffer "
                   "comm hook",
    "device": _WHERE,
    "device_type": _WHERE,
    "is_multi_device_module": _WHERE,
}
