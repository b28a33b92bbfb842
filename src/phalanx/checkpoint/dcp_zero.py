"""A sharded optimizer (phalanx's :class:`~phalanx.ZeroRedundancyOptimizer`, ZeRO-1 and ZeRO-2)
in the sharded format: each rank writes the optimizer state of the parameters it owns.

**The entries are those of a plain optimizer.** ``get_optimizer_state_dict`` names a plain
optimizer's state ``optimizer.state.<parameter name>.<state name>`` (``exp_avg``, ...), whole
tensors, and its hyper-parameters ``optimizer.param_groups`` with parameter names. A ZeRO
rank offers exactly those entries for the parameters it owns (whole tensors: ZeRO shards by
parameter, not by rows), and no others. DCP's plans then hold each optimizer entry on one
rank only, so its owner writes it, with no planner of phalanx's needed for it; the replicated
model tensors are spread over the ranks on top of that (:func:`~phalanx.checkpoint.dcp_engine.balance`
counts the entries only one rank holds first). The directory is the one a DDP job with the
plain optimizer would write, except for who wrote which entry: DDP with the plain optimizer,
``fully_shard`` (DCP cuts each whole tensor into rows) and one process load it as they load
their own, and a ZeRO job loads any of theirs.

Why not one ``ShardedTensor``/``DTensor`` per state with a planner: ZeRO owns whole
parameters, so a per-parameter entry is the shard; a ``Shard(0)`` view would cut tensors
that no rank holds in rows and lose the plain-optimizer naming every other layout reads.

**Loading into ZeRO, at any world size.** Each rank asks DCP only for the entries of the
parameters it owns at the world size it runs at, allocated from the checkpoint's metadata
(their saved shape and dtype: the local optimizer need not have taken a step), so it reads
its owned state and the model, nothing else. The result is handed to
``ZeroRedundancyOptimizer.load_state_dict`` keyed by global index, with the saved
hyper-parameters, as its own consolidated format; it keeps its own entries.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import _init_optim_state

from ..errors import CheckpointError

_OTHER = ("params", "param_names")


def is_zero(optimizer: Any) -> bool:
    """Whether ``optimizer`` is sharded by parameter owner as phalanx's
    ``ZeroRedundancyOptimizer`` (``consolidate_state_dict`` and ``param_owners``)."""
    return hasattr(optimizer, "consolidate_state_dict") and hasattr(optimizer, "param_owners")


def _params(zero: Any) -> list[torch.Tensor]:
    """Every parameter of ``zero``, by global index (param-group order)."""
    return [p for group in zero.param_groups for p in group["params"]]


def _names(module: torch.nn.Module, params: list[torch.Tensor]) -> list[str]:
    """Each parameter's name in ``module`` (a tied one: its first name, as torch's
    ``get_optimizer_state_dict`` names it)."""
    names: dict[int, str] = {}
    for name, p in module.named_parameters():
        names.setdefault(id(p), name)
    missing = [i for i, p in enumerate(params) if id(p) not in names]
    if missing:
        raise ValueError(f"The optimizer holds {len(missing)} tensor(s) that are not parameters of the "
                         f"model (global indices {missing[:5]}): the sharded format names optimizer "
                         "state by parameter name")
    return [names[id(p)] for p in params]


def param_groups(module: torch.nn.Module, zero: Any) -> list[dict]:
    """``zero``'s param groups as ``get_optimizer_state_dict`` gives a plain optimizer's:
    hyper-parameters, and the parameters by name."""
    return _groups(zero, _names(module, _params(zero)))


def _groups(zero: Any, names: list[str]) -> list[dict]:
    groups, start = [], 0
    for group in zero.param_groups:
        end = start + len(group["params"])
        groups.append({**{k: v for k, v in group.items() if k not in _OTHER}, "params": names[start:end]})
        start = end
    return groups


def _owned(zero: Any) -> list[int]:
    rank = zero.rank
    return [i for i, owner in enumerate(zero.param_owners) if owner == rank]


def optimizer_tree(module: torch.nn.Module, zero: Any) -> dict:
    """This rank's part of ``zero``'s state as ``get_optimizer_state_dict`` would name a plain
    optimizer's: ``{"state": {name: {...}}`` for the parameters this rank owns (the live
    tensors), ``"param_groups": [...]}`` (every group, parameters by name). A local optimizer
    without state gets it first, as torch does for a plain one (a step with zero gradients
    and learning rate 0; no collective)."""
    _init_optim_state(zero.optim)
    params = _params(zero)
    names = _names(module, params)
    state = zero.optim.state
    return {"state": {names[i]: dict(state[params[i]]) for i in _owned(zero) if params[i] in state},
            "param_groups": _groups(zero, names)}


def targets(module: torch.nn.Module, zero: Any, metadata: Metadata) -> dict:
    """``{"state": {name: {state name: empty tensor}}}``: what this rank reads of a sharded
    checkpoint's optimizer state, the entries of the parameters it owns, shaped as saved."""
    names = _names(module, _params(zero))
    mine = {names[i] for i in _owned(zero)}
    found: dict[str, dict[str, torch.Tensor]] = {}
    places = metadata.planner_data or {}
    for key, meta in metadata.state_dict_metadata.items():
        at = places.get(key)
        if (isinstance(meta, TensorStorageMetadata) and at is not None and len(at) == 4
                and tuple(at[:2]) == ("optimizer", "state") and at[2] in mine):
            found.setdefault(at[2], {})[at[3]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    return {"state": found}


def load(module: torch.nn.Module, zero: Any, loaded: dict, path: Any) -> None:
    """Hand ``loaded`` (this rank's owned entries by parameter name, any non-tensor state,
    and the saved ``param_groups``) to ``zero.load_state_dict`` keyed by global index."""
    params = _params(zero)
    names = _names(module, params)
    saved_groups = loaded.get("param_groups")
    if not isinstance(saved_groups, list) or len(saved_groups) != len(zero.param_groups):
        got = len(saved_groups) if isinstance(saved_groups, list) else "no"
        raise CheckpointError(f"Checkpoint {path}: its optimizer state has {got} parameter groups, "
                              f"the optimizer given has {len(zero.param_groups)}")
    groups, start = [], 0
    for g, (saved, ours) in enumerate(zip(saved_groups, zero.param_groups)):
        end = start + len(ours["params"])
        theirs, here = list(saved.get("params", ())), names[start:end]
        if sorted(theirs) != sorted(here):
            extra, lacking = sorted(set(theirs) - set(here)), sorted(set(here) - set(theirs))
            raise CheckpointError(f"Checkpoint {path}: parameter group {g} of its optimizer holds other "
                                  f"parameters than the optimizer given: only there {extra[:3]}, "
                                  f"only here {lacking[:3]} ({len(theirs)} there, {len(here)} here)")
        groups.append({**{k: v for k, v in saved.items() if k not in _OTHER},
                       "params": list(range(start, end))})
        start = end
    saved_state = loaded.get("state", {})
    state = {i: saved_state[n] for i, n in enumerate(names) if n in saved_state}
    try:
        zero.load_state_dict({"state": state, "param_groups": groups})
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"Checkpoint {path}: its optimizer state does not fit the optimizer "
                              f"given: {e}") from e
