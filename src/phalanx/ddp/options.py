"""DistributedDataParallel's constructor arguments, checked and resolved in one place.

:func:`resolve_arguments`, called once by the wrapper, takes every argument as given and
returns :class:`Settings`, what the wrapper reads:

* ``process_group`` or a 1-D ``device_mesh`` (its group, as in torch): the group to average
  over, checked before any collective (its errors raise on this rank alone).
* the module (trainable parameters, none lazy) and the flags (``find_unused_parameters``,
  ``static_graph``, ``init_sync``, ``dim``...);
* ``broadcast_buffers`` (deprecated by torch 2.13) and ``forward_sync_buffers``: which of
  the construction broadcast and the before-forward broadcasts include the buffers;
* ``bucket_cap_mb`` and ``bucket_cap_mb_list``: the bucket caps;
* ``device_ids`` and ``output_device``: where inputs go (moved there by
  :mod:`phalanx.ddp.devices` at each forward);
* ``check_reduction``: deprecated, ignored, with torch's ``FutureWarning``;
* ``mixed_precision``: ``None`` or torch's ``_MixedPrecision`` of floating-point dtypes
  (:func:`~phalanx.ddp.mixed_precision.check_mixed_precision`), the same on every rank;
* ``delay_all_reduce_named_params``, ``param_to_hook_all_reduce``, and a
  module marked with parameters to ignore: refused (:func:`refuse_torch_only`), each with a
  message naming it and saying what phalanx does instead.

Every rank checks its arguments, and the verdicts are exchanged in the same collective as
the parameter descriptions and the settings (:func:`agree_on_replicas`,
:func:`phalanx.agreement.agree`), so one rank's bad argument is raised on every rank and
none waits; with ``init_sync=False`` there is no exchange and a rank raises alone. The
wrapper's docstring says what each argument does here; :data:`TORCH_ONLY_ATTRIBUTES`, why
torch's attributes that phalanx lacks are missing.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from numbers import Real
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..agreement import agree
from ..errors import NotInitializedError, UsageError
from .bucketing import DEFAULT_BUCKET_CAP_MB, FIRST_BUCKET_BYTES, MIB
from .checks import verdict
from .mixed_precision import check_mixed_precision, describe

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
class Settings:
    """What the constructor's arguments come to, checked (on every rank, unless ``init_sync=False``)."""

    group: dist.ProcessGroup | None  # the group to average over (None: the world)
    device_ids: list | None  # as given, as a list (None for None or [])
    device: torch.device | None  # where inputs go (None: they stay where they are)
    caps: tuple[int, ...]  # bucket caps in bytes (plan_buckets' caps)
    forward_sync_buffers: bool  # broadcast buffers before forwards
    init_sync_buffers: bool  # broadcast buffers at construction


def resolve_arguments(module: Any, process_group: Any, device_mesh: Any, device_ids: Any, output_device: Any,
                      dim: Any, buffers: tuple[Any, Any], caps: tuple[Any, Any], check_reduction: Any,
                      flags: dict[str, Any], torch_only: dict[str, Any]) -> Settings:
    """Check every argument and resolve them (see the module notes); raise ``TypeError``,
    ``ValueError`` or :class:`~phalanx.errors.UsageError`, on every rank with ``init_sync``.

    ``buffers`` is ``(broadcast_buffers, forward_sync_buffers)``, ``caps`` is
    ``(bucket_cap_mb, bucket_cap_mb_list)``; ``flags`` holds the boolean flags (``init_sync``
    among them) and ``torch_only`` ``mixed_precision`` and the arguments :func:`refuse_torch_only`
    takes, by name.
    """
    group = resolve_group(process_group, device_mesh)
    check_group(group)
    warn_check_reduction(check_reduction)
    problem, settings, agreed = None, None, {}
    try:
        settings, agreed = _checked(module, group, device_ids, output_device, dim, buffers, caps, flags, torch_only)
    except (TypeError, ValueError) as e:
        problem = e
    if flags["init_sync"] is not False:
        # every rank learns of every rank's problem: none is left waiting
        agree_on_replicas(module, problem, agreed, group)
    if problem is not None:  # init_sync=False: no exchange, this rank raises alone
        raise problem
    return settings  # type: ignore[return-value]  # not None: _checked raised otherwise


def _checked(module: Any, group: Any, device_ids: Any, output_device: Any, dim: Any, buffers: tuple[Any, Any],
             caps: tuple[Any, Any], flags: dict[str, Any], torch_only: dict[str, Any]) -> tuple[Settings, dict]:
    """This rank's checks, in order: the settings, and what every rank must hold alike."""
    check_module(module)
    check_flags(flags, dim)
    torch_only = dict(torch_only)
    mixed_precision = torch_only.pop("mixed_precision")
    check_mixed_precision(mixed_precision)
    refuse_torch_only(module, **torch_only)
    forward_sync, init_buffers = buffer_flags(*buffers)
    bucket_cap_mb, bucket_cap_mb_list = caps
    byte_caps = bucket_caps(bucket_cap_mb, bucket_cap_mb_list)
    device = input_device(module, device_ids, output_device)
    agreed = {"bucket_cap_mb": bucket_cap_mb, "broadcast_buffers": forward_sync, "init_sync_buffers": init_buffers,
              "bucket_cap_mb_list": bucket_cap_mb_list, "mixed_precision": describe(mixed_precision), **flags}
    listed = list(device_ids) if device_ids else None
    return Settings(group, listed, device, byte_caps, forward_sync, init_buffers), agreed


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


def check_group(group: Any) -> None:
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    if not dist.is_initialized():
        raise NotInitializedError(
            "DistributedDataParallel needs a process group: call phalanx.init_process_group() first "
            "(it runs as a single process when nothing in the environment says otherwise)"
        )


def check_module(module: Any) -> None:
    """A module DDP can average: trainable parameters, all initialised (torch raises
    ``RuntimeError`` for both: :class:`~phalanx.errors.UsageError` is one too)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    lazy = [n for n, p in module.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)]
    if lazy:
        raise UsageError(
            f"DistributedDataParallel needs initialised parameters; {lazy} are not (a lazy module): "
            "run one forward pass through the module before wrapping it"
        )
    if not any(p.requires_grad for p in module.parameters()):
        raise UsageError(
            "DistributedDataParallel needs a module with at least one parameter that requires a "
            "gradient; this one has none (nothing to average)"
        )


def check_flags(flags: dict[str, Any], dim: Any) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int (the batch dimension), got {dim!r}")


def refuse_torch_only(module: nn.Module, delay_all_reduce_named_params: Any,
                      param_to_hook_all_reduce: Any, device_mesh: Any) -> None:
    """Raise ``ValueError`` for the torch arguments phalanx does not take."""
    if delay_all_reduce_named_params is not None or param_to_hook_all_reduce is not None:
        raise ValueError(
            "delay_all_reduce_named_params and param_to_hook_all_reduce are torch's (all-reduce "
            "some parameters in one go once another one's gradient is ready); phalanx's "
            "DistributedDataParallel does not hold parameters back: it averages every trainable "
            "parameter in its buckets during the backward. Leave both None"
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
            warnings.warn(BOTH_BUFFER_FLAGS_WARNING, FutureWarning, stacklevel=5)  # the user's line
        return forward_sync_buffers, True
    both = True if broadcast_buffers is None else broadcast_buffers
    return both, both


def warn_check_reduction(check_reduction: Any) -> None:
    if check_reduction:  # torch's test: any true value
        warnings.warn(CHECK_REDUCTION_WARNING, FutureWarning, stacklevel=4)  # the user's line


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


def agree_on_replicas(module, problem, settings: dict[str, Any], group) -> None:
    """One exchange: every rank's argument problem, settings, parameters and buffers agree,
    or every rank raises (the first difference, or the problem all ranks share)."""
    items: list[tuple[str, Any]] = [verdict(problem)]
    if problem is None:
        items.append(("settings", ", ".join(f"{k}={v}" for k, v in settings.items())))
        items += [(n, _describe(p) + ("" if p.requires_grad else " frozen")) for n, p in module.named_parameters()]
        items += [(f"buffer {n}", _describe(b)) for n, b in module.named_buffers()]
    agree("DistributedDataParallel parameters, buffers and settings", group, items=items, problem=problem)


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)} {t.dtype}"


def is_default_group(group: Any) -> bool:
    """Whether ``group`` means the default (world) group of whichever process holds it."""
    return group is None or (dist.is_initialized() and group == dist.group.WORLD)


# Public attributes and methods of torch's DDP that phalanx's does not have, and why: the
# wrapper's AttributeError for each says so (docs/torch_surface_ddp.md lists them).
_LOGGING = ("phalanx has no DDP logger; _get_ddp_logging_data() gives its logging data, and with "
            "logging.getLogger('phalanx') at DEBUG the bucket plan is logged")
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
    "scatter": _ONE_DEVICE,
    "gather": _ONE_DEVICE,
    "to_kwargs": _ONE_DEVICE,
    "use_side_stream_for_tensor_copies": "inputs are moved with non_blocking=True on the current stream",
    "_register_fused_optim": "no optimizer step runs inside the backward; call optimizer.step() after "
                             "backward()",
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
