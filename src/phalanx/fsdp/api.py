"""``fully_shard``: torch 2.13's signature; what phalanx does not support yet is refused by
name (a ``ValueError``), never ignored."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor

from ..errors import NotInitializedError
from .module import FSDPModule
from .params import Params
from .unit import UNIT_ATTRIBUTE, Unit


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any = None,
) -> Any:
    """Shard ``module``'s parameters across the ranks: one unit, gathered for its forward and
    backward, its gradients reduce-scattered right after its backward.

    Call it bottom-up: on each block, then on the root. A call makes one unit of the
    parameters of ``module`` not already in a unit below it; each parameter becomes a
    DTensor sharded on dim 0 (``Shard(0)`` on a 1-D mesh, as torch's ``fully_shard``, so
    state dicts and ``torch.distributed.checkpoint`` interoperate), the unit's shards one
    flat buffer. ``module``'s class becomes ``FSDP<Class>``, a :class:`FSDPModule`.

    ``fully_shard([a, b])`` makes one unit of several modules (torch's grouped form: e.g.
    the embedding and the final norm, which run at either end of the forward): their
    parameters are gathered in one all-gather when the first of them runs, freed after the
    last, and reduced in one reduce-scatter; each module becomes an :class:`FSDPModule`.

    Args:
        module (nn.Module or list of nn.Module): the module to shard, or the modules of one
            unit (those nested in another of the list count once, as torch's).
        mesh (DeviceMesh, optional): a 1-D mesh: parameters sharded across its ranks; or a
            2-D mesh with named dimensions (replicate, shard), HSDP: sharded across the second
            dimension, replicated across the first (``(Replicate(), Shard(0))``), each
            reduce-scatter's result then averaged across the replicas by one all-reduce.
            Default: the default group's ranks, on the accelerator if there is one, else
            the CPU.
        reshard_after_forward (bool, optional): free the unsharded parameters after the
            forward and gather them again for the backward. Default ``None``: ``True``, but
            ``False`` for the root (the unit whose forward runs first).
        shard_placement_fn: only ``None`` (dim-0 shards).
        mp_policy (MixedPrecisionPolicy): the unsharded parameters' dtype (``param_dtype``:
            the shards are cast before the all-gather), the gradients' reduction dtype
            (``reduce_dtype``), the casts of the forward's inputs and outputs, as torch's.
            Default: none (the parameters' own dtype throughout).
        offload_policy (OffloadPolicy): ``CPUOffloadPolicy(pin_memory=...)``: the shards, their
            gradients and the optimizer state in host memory (pinned if asked, on an
            accelerator); each all-gather copies the unit's shards to the mesh's device, each
            reduced gradient shard is copied back. Default: no offload.
        ignored_params (set of nn.Parameter, optional): parameters left as they are: not
            sharded, their gradients not reduced.
        dp_mesh_dims: only ``None``.

    Returns:
        ``module``, now an :class:`FSDPModule` (a list: the same list, each module one).

    Raises:
        ValueError: for what phalanx does not support yet, naming it (parameters that are
            DTensors already: tensor parallelism), and for torch's own refusals (containers
            without ``forward``, scalar parameters, a second call on one module; at the first
            forward, a parameter in two units: tied weights sharded apart).

    Example::

        >>> for block in model.blocks:
        ...     phalanx.fully_shard(block)
        >>> phalanx.fully_shard(model)
        >>> optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    """
    modules = _roots(module)
    _refuse_unsupported(modules, reshard_after_forward, shard_placement_fn, offload_policy,
                        dp_mesh_dims)
    mesh = mesh or _default_mesh()
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}")
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise ValueError("Please init the 2D mesh for HSDP with mesh_dim_names specified "
                         "(init_device_mesh(..., mesh_dim_names=(\"replicate\", \"shard\")))")
    params, locations, managed = _managed_params(modules, ignored_params or set())
    offload = isinstance(offload_policy, CPUOffloadPolicy)
    _check_params(params, locations, mesh, offload)
    if offload:  # parameters may come from the host: their modules' buffers go to the mesh's device
        _move_buffers(managed, mesh)
    # torch's clamping: no cast for a parameter already in param_dtype (or not floating)
    floating = params and params[0].dtype.is_floating_point
    param_dtype = mp_policy.param_dtype if floating and mp_policy.param_dtype != params[0].dtype else None
    unit = Unit(modules, Params(params, locations, mesh, param_dtype, offload_policy),
                reshard_after_forward, mp_policy, originals=params)
    for m in modules:
        m.__dict__[UNIT_ATTRIBUTE] = unit
        m.__class__ = _fsdp_class(type(m))
    return module


def _state(module: nn.Module) -> Any:
    """``fully_shard.state(module)``, as torch's composable API has it: the unit's state as
    torch's helpers see it (:class:`~phalanx.fsdp.module.TorchStateView`: its pre- and
    post-forward; any other attribute of torch's ``FSDPState`` raises, naming it), or ``None``
    for a module ``fully_shard`` was not applied to."""
    return module._get_fsdp_state() if isinstance(module, FSDPModule) else None


fully_shard.state = _state  # type: ignore[attr-defined]


def _roots(module: Any) -> tuple[nn.Module, ...]:
    """The modules of the unit: ``module``, or those of a list not inside another of it
    (torch's ``_get_root_modules``), in the list's order."""
    if isinstance(module, nn.Module):
        return (module,)
    if not isinstance(module, (list, tuple)) or not all(isinstance(m, nn.Module) for m in module):
        raise ValueError("fully_shard expects an nn.Module or a list of nn.Module, got "
                         f"{_describe(module)}")
    if not module:
        raise ValueError("fully_shard expects an nn.Module or a list of nn.Module, got an empty list")
    within = {id(m): {id(sub) for sub in m.modules()} for m in module}
    return tuple(m for m in module
                 if not any(id(m) in subs for other, subs in within.items() if other != id(m)))


def _describe(module: Any) -> str:
    if isinstance(module, (list, tuple)):
        return f"a {type(module).__name__} of {', '.join(sorted({type(m).__name__ for m in module}))}"
    return type(module).__name__


def _refuse_unsupported(modules: tuple[nn.Module, ...], reshard_after_forward: Any,
                        shard_placement_fn: Any, offload_policy: Any, dp_mesh_dims: Any) -> None:
    for module in modules:
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is nn.Module.forward:
            raise ValueError("fully_shard does not support containers that do not implement "
                             f"forward: {module}")
        if isinstance(module, FSDPModule):
            raise ValueError("fully_shard has already been applied to this module "
                             f"({type(module).__name__}): each module can be sharded once")
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise ValueError(f"reshard_after_forward should be a bool or None, got {reshard_after_forward!r}: "
                         "phalanx does not support resharding to a smaller world size (an int) yet")
    if not isinstance(offload_policy, OffloadPolicy):
        raise ValueError("offload_policy should be an OffloadPolicy (OffloadPolicy() or "
                         f"CPUOffloadPolicy()), got {offload_policy!r}")
    for name, value, refused in (
            ("shard_placement_fn", shard_placement_fn, shard_placement_fn is not None),
            ("dp_mesh_dims", dp_mesh_dims, dp_mesh_dims is not None)):
        if refused:
            raise ValueError(f"phalanx.fully_shard does not support {name}={value!r} yet: "
                             "leave it at its default, or use torch's fully_shard")


def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise NotInitializedError("fully_shard needs a process group: call "
                                  "phalanx.init_process_group() first")
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return init_device_mesh(accelerator.type if accelerator else "cpu", (dist.get_world_size(),))


def _managed_params(modules: tuple[nn.Module, ...], ignored: set[nn.Parameter]
                    ) -> tuple[list[nn.Parameter], list[list[tuple[nn.Module, str]]], list[nn.Module]]:
    """The parameters of ``modules`` and of their submodules not in a unit already (each once,
    with every place it is held), and those modules, as torch's ``_get_managed_states``."""
    where: dict[nn.Parameter, list[tuple[nn.Module, str]]] = {}

    def visit(m: nn.Module, seen: dict[nn.Module, None]) -> None:
        if m not in modules and isinstance(m, FSDPModule):
            return
        seen[m] = None
        for name, p in m.named_parameters(recurse=False, remove_duplicate=False):
            if p not in ignored:
                where.setdefault(p, []).append((m, name))
        for child in m.children():
            if child not in seen:
                visit(child, seen)

    seen: dict[nn.Module, None] = {}  # (ordered)
    for module in modules:
        if module not in seen:
            visit(module, seen)
    return list(where), list(where.values()), list(seen)


def _check_params(params: list[nn.Parameter], locations: list[list[tuple[nn.Module, str]]],
                  mesh: DeviceMesh, offload: bool) -> None:
    # offloaded shards live on the host: parameters may come from there (torch moves them)
    devices = ("meta", mesh.device_type, "cpu") if offload else ("meta", mesh.device_type)
    for p, where in zip(params, locations):
        name = where[0][1]
        if isinstance(p, DTensor):  # torch's 2-D composition (TP x FSDP) shards the local part
            raise ValueError(
                f"phalanx.fully_shard does not support parameters that are DTensors already (tensor "
                f"parallelism, parallelize_module): {name} is one, {list(p.placements)} on {p.device_mesh}. "
                "Compose tensor parallelism with FSDP through torch's fully_shard "
                "(torch.distributed.fsdp.fully_shard(module, mesh=dp_mesh)), or shard the model with "
                "phalanx.fully_shard without tensor parallelism")
        if p.dim() == 0:
            raise ValueError("fully_shard doesn't support scalar parameters. "
                             f"Change {name} to a 1D tensor with numel equal to 1.")
        if p.device.type not in devices:
            raise ValueError(f"fully_shard: parameter {name} is on {p.device}, the mesh on "
                             f"{mesh.device_type}: move the module to the mesh's device first")
    dtypes = sorted({str(p.dtype) for p in params})
    if len(dtypes) > 1:
        raise ValueError(f"phalanx.fully_shard needs one dtype per unit, got {', '.join(dtypes)}: "
                         "shard the modules of each dtype as units of their own")


def _move_buffers(modules: list[nn.Module], mesh: DeviceMesh) -> None:
    """The buffers of ``modules`` on the mesh's device, as torch's ``fully_shard`` moves a
    unit's buffers (``_move_states_to_device``; meta ones stay for ``to_empty``)."""
    device = torch.device(mesh.device_type)
    for module in modules:
        for b in module.buffers(recurse=False):
            if not b.is_meta and b.device.type != device.type:
                b.data = b.to(device)


@functools.cache
def _fsdp_class(cls: type) -> type:
    """``FSDP<cls>``: :class:`FSDPModule` first in the method resolution order (torch's)."""
    return type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__deepcopy__": _no_deepcopy})


def _no_deepcopy(*args: Any) -> Any:
    raise AssertionError("FSDP does not support deepcopy. Please use state dict for serialization.")
