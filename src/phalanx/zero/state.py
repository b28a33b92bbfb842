"""The state dict of :class:`~phalanx.zero.ZeroRedundancyOptimizer`: packing and loading.

Format (a superset of ``torch.optim.Optimizer.state_dict()``, so each loads into the other)::

    {
        "state": {global_index: {"exp_avg": tensor, "step": tensor, ...}, ...},
        "param_groups": [{"lr": ..., ..., "params": [global indices],
                          "param_names": [...]  # only when built from named parameters
                         }, ...],
        "zero": {"format": 1, "world_size": N, "param_shapes": [[out, in], [out], ...]},
    }

A parameter's global index is its position when the param groups are read in order, first
group first, exactly as torch numbers them. Nothing depends on the world size it was saved
at (``"world_size"`` is informational): loading maps each saved entry to the parameter at
the same position and hands each rank the entries of the parameters it owns. Tensors are
CPU copies; the structure holds only dicts, lists, numbers, strings and tensors, so
``torch.load(..., weights_only=True)`` reads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import chain
from typing import Any

import torch

# The key of phalanx's own entry, and the version of what it holds (bump on a change).
ZERO_KEY = "zero"
FORMAT_VERSION = 1


def pack(
    param_groups: list[dict[str, Any]],
    state: dict[int, dict[str, Any]],
    params: list[torch.Tensor],
    world_size: int,
) -> dict[str, Any]:
    """The state dict of groups ``param_groups`` holding ``params``, with gathered ``state``."""
    groups, start = [], 0
    for group in param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = list(range(start, start + len(group["params"])))
        start += len(group["params"])
        groups.append(packed)
    return {
        "state": {i: state[i] for i in sorted(state)},
        "param_groups": groups,
        ZERO_KEY: {
            "format": FORMAT_VERSION,
            "world_size": world_size,
            "param_shapes": [list(p.shape) for p in params],
        },
    }


def localize(
    state_dict: Any,
    param_groups: list[dict[str, Any]],
    params: list[torch.Tensor],
    local_index: list[list[int]],
) -> dict[str, Any]:
    """Check that ``state_dict`` fits, and return this rank's share as a local state dict.

    ``local_index[g]`` lists the global indices of group ``g``'s parameters this rank owns, in
    the order the local optimizer holds them.

    Raises:
        TypeError, ValueError: the dict is malformed or does not fit (naming what differs).
    """
    global_of = _match(state_dict, param_groups, params)
    saved_state = state_dict["state"]
    by_global = {global_of[sid]: value for sid, value in saved_state.items()}
    state: dict[int, Any] = {}
    groups = []
    local = 0
    for saved, mine in zip(state_dict["param_groups"], local_index):
        ids = []
        for i in mine:
            if i in by_global:
                state[local] = by_global[i]
            ids.append(local)
            local += 1
        group = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
        group["params"] = ids
        groups.append(group)
    return {"state": state, "param_groups": groups}


def _match(
    state_dict: Any, param_groups: list[dict[str, Any]], params: list[torch.Tensor]
) -> dict[Any, int]:
    """Map each saved parameter id to a global index, or raise naming the first misfit."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            "state_dict must be a dict as returned by ZeroRedundancyOptimizer.state_dict(), "
            f"got {type(state_dict).__name__}"
        )
    missing = [k for k in ("state", "param_groups") if k not in state_dict]
    if missing:
        raise ValueError(
            f"state_dict lacks {missing}: expected an optimizer state dict with keys 'state' "
            f"and 'param_groups', got keys {sorted(map(str, state_dict))}"
        )
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups):
        raise ValueError(
            f"state_dict does not fit: it has {len(saved_groups)} parameter groups, "
            f"this optimizer has {len(param_groups)}"
        )
    for g, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        _check_group(g, saved, group)
    saved_ids = chain.from_iterable(saved["params"] for saved in saved_groups)
    global_of = {sid: i for i, sid in enumerate(saved_ids)}
    unknown = [sid for sid in state_dict["state"] if sid not in global_of]
    if unknown:
        raise ValueError(
            f"state_dict does not fit: it has state for parameter ids {unknown[:5]} "
            "that none of its parameter groups lists"
        )
    shapes = (state_dict.get(ZERO_KEY) or {}).get("param_shapes")
    if shapes is not None:
        _check_shapes(shapes, param_groups, params)
    return global_of


def _check_group(g: int, saved: Any, group: dict[str, Any]) -> None:
    if not isinstance(saved, Mapping) or "params" not in saved:
        raise ValueError(
            f"state_dict does not fit: parameter group {g} there should be a dict with a "
            f"'params' list, got {saved!r:.80}"
        )
    saved_count, count = len(saved["params"]), len(group["params"])
    if saved_count != count:
        raise ValueError(
            f"state_dict does not fit: parameter group {g} holds {saved_count} parameters "
            f"there and {count} in this optimizer"
        )
    names, saved_names = group.get("param_names"), saved.get("param_names")
    if names is None or saved_names is None:
        return
    for j, (theirs, ours) in enumerate(zip(saved_names, names)):
        if theirs != ours:
            raise ValueError(
                f"state_dict does not fit: parameter {j} of group {g} is named {theirs!r} "
                f"there and {ours!r} in this optimizer"
            )


def _check_shapes(
    shapes: list[list[int]], param_groups: list[dict[str, Any]], params: list[torch.Tensor]
) -> None:
    if len(shapes) != len(params):
        raise ValueError(
            f"state_dict does not fit: it records {len(shapes)} parameter shapes, "
            f"this optimizer has {len(params)} parameters"
        )
    for i, (saved, p) in enumerate(zip(shapes, params)):
        if tuple(saved) != tuple(p.shape):
            raise ValueError(
                f"state_dict does not fit: {_label(i, param_groups)} has shape "
                f"{tuple(saved)} there and {tuple(p.shape)} in this optimizer"
            )


def _label(index: int, param_groups: list[dict[str, Any]]) -> str:
    """``"parameter 3 (group 1, 'fc.bias')"``: a global index, its group, and its name."""
    position = index
    for g, group in enumerate(param_groups):
        if position < len(group["params"]):
            names = group.get("param_names")
            name = f", {names[position]!r}" if names else ""
            return f"parameter {index} (group {g}{name})"
        position -= len(group["params"])
    return f"parameter {index}"
