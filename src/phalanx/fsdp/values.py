"""Values put into a sharded model from outside: a unit adopts them into its flat buffer.

A unit keeps its shards in one flat buffer, each sharded parameter a DTensor viewing its
part, and puts its own Parameters back on the modules at every reshard. A tensor set on a
module in a parameter's place (``load_state_dict(sd, assign=True)``, as torch's FSDP2
example resumes; ``set_model_state_dict``; ``setattr(module, name, nn.Parameter(...))``;
``nn.Module._apply`` with ``torch.__future__.set_overwrite_module_params_on_conversion``)
would be dropped there. :func:`adopt` finds such a tensor first: it checks that it is the
shard this rank holds (a DTensor of the parameter's shape, dtype, placements and mesh, not on
the meta device), copies its local rows into the flat buffer (from whichever device they are
on), and puts the unit's own
Parameter back, the object an optimizer built before already holds. It runs after each
``load_state_dict`` of a module holding the unit's parameters (torch's post-hook, where
torch's ``fully_shard`` calls ``reset_sharded_param``), after ``nn.Module._apply``, when
``parameters()`` / ``named_parameters()`` of an :class:`FSDPModule` is asked for (an
optimizer built after a ``setattr`` gets the unit's own Parameters), and before each
all-gather. A tensor that is not such a shard raises ``ValueError`` naming the parameter.

Values written into the parameters themselves need no adopting: ``param.copy_(dtensor)``
and ``param.to_local().copy_(...)`` under ``torch.no_grad()``, ``nn.init.*_(param)``,
``load_state_dict`` without ``assign`` all write into the flat buffer. ``param.data = x``
does not change a DTensor's values (DTensor keeps its local tensor; torch's ``fully_shard``
loses them alike); one that changes the parameter's shape or dtype raises here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .params import Params, Slot


def adopt(params: Params, unit_name: str) -> None:
    """Copy into the flat buffer every shard a module holds in the place of one of the unit's
    sharded Parameters, and put the unit's own back (see the module notes). Nothing to do
    while the unit is unsharded (its modules hold the unsharded parameters)."""
    if params.unsharded:
        return
    for s in params.slots:
        for module, name in s.locations:
            held = getattr(module, name, None)
            if held is s.sharded:
                _check_own(params, s, module, name, unit_name)
                continue
            if held is not s.unsharded:  # (a module left holding it: nothing to copy)
                _check(params, s, held, _where(module, name, unit_name))
                with torch.no_grad():
                    s.shard_of(params.flat).copy_(held.to_local())
            setattr(module, name, s.sharded)


def _where(module: nn.Module, name: str, unit_name: str) -> str:
    return f"parameter {name!r} of {type(module).__name__} (fully_shard unit {unit_name})"


def _expected(params: Params, s: Slot) -> str:
    return (f"a DTensor of shape {tuple(s.shape)}, dtype {params.dtype}, placements "
            f"{params.placements} on mesh {params.mesh.mesh.tolist()}, {s.rows} local rows")


def _check(params: Params, s: Slot, held: Any, where: str) -> None:
    """``held`` is this rank's shard of slot ``s``, or ``ValueError`` saying what differs."""
    if held is None:
        raise ValueError(f"phalanx.fully_shard: {where} was removed; expected {_expected(params, s)}")
    if not isinstance(held, DTensor):
        raise ValueError(
            f"phalanx.fully_shard: {where} was set to a {type(held).__name__} of shape "
            f"{tuple(held.shape)}, expected {_expected(params, s)}: shard a whole tensor with "
            "distribute_tensor(full, param.device_mesh, param.placements), or load without "
            "assign=True")
    local = held.to_local()
    got = {"shape": tuple(held.shape), "dtype": held.dtype, "placements": tuple(held.placements),
           "mesh": held.device_mesh.mesh.tolist(), "local rows": local.shape[0]}
    want = {"shape": tuple(s.shape), "dtype": params.dtype, "placements": tuple(params.placements),
            "mesh": params.mesh.mesh.tolist(), "local rows": s.rows}
    differ = [f"{k} {got[k]} (expected {want[k]})" for k in want if got[k] != want[k]]
    if local.is_meta:
        differ.append("its local tensor is on the meta device (no values)")
    if differ:
        raise ValueError(f"phalanx.fully_shard: {where} was set to a DTensor that is not this "
                         f"rank's shard of it: {'; '.join(differ)}")


def _check_own(params: Params, s: Slot, module: nn.Module, name: str, unit_name: str) -> None:
    """The unit's own Parameter, unless ``.data`` was set to a tensor of another shape or
    dtype (a DTensor keeps its local tensor: the values were not taken)."""
    p = s.sharded
    if p.shape != s.shape or p.dtype != params.dtype:
        raise ValueError(
            f"phalanx.fully_shard: {_where(module, name, unit_name)} had its .data set to a "
            f"tensor of shape {tuple(p.shape)} and dtype {p.dtype} (expected {tuple(s.shape)}, "
            f"{params.dtype}): a DTensor parameter ignores .data = ...; write its values with "
            "param.copy_(value) under torch.no_grad(), or load_state_dict")
