"""What goes into a checkpoint and comes out of it, for one process (no communication).

Unwrapping a model, capturing and restoring RNG states, checking that a state can be loaded
safely, that a saved model state fits a model, and giving a rank its comm state.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any, Mapping

import torch
from torch.nn.parallel import DataParallel, DistributedDataParallel

from ..ddp import DistributedDataParallel as PhalanxDDP
from ..errors import CheckpointError

_WRAPPERS = (PhalanxDDP, DistributedDataParallel, DataParallel)

# What torch.load(weights_only=True) rebuilds besides tensors and containers (tried on torch 2.13).
_LEAF_TYPES = (type(None), bool, int, float, complex, str, bytes, bytearray,
               torch.dtype, torch.device, torch.Size)
_MAPPING_TYPES = (dict, OrderedDict, Counter)
_SEQUENCE_TYPES = (list, tuple, set)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` without DDP (phalanx's, torch's), DataParallel or ``torch.compile`` wrappers."""
    while True:
        if isinstance(model, _WRAPPERS):
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
            model = model._orig_mod  # torch.compile's wrapper; its class lives in torch._dynamo
        else:
            return model


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states: Python, torch CPU, current CUDA device, numpy (if importable)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    np = _numpy()
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype(np.int64)), int(pos),
                          int(has_gauss), float(gauss))
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Set the RNG states :func:`capture_rng_state` returned (those this process has)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())
    np = _numpy()
    if "numpy" in state and np is not None:
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.cpu().numpy().astype(np.uint32), pos, has_gauss, gauss))


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def check_loadable(value: Any, where: str) -> None:
    """Raise ``TypeError`` naming the first part of ``value`` that safe loading cannot rebuild."""
    stack = [(value, where)]
    while stack:
        item, at = stack.pop()
        kind = type(item)
        if kind in _LEAF_TYPES or isinstance(item, torch.Tensor):
            continue
        if kind in _MAPPING_TYPES:
            for key, sub in item.items():
                stack += [(key, f"{at} (key {key!r})"), (sub, f"{at}[{key!r}]")]
        elif kind in _SEQUENCE_TYPES:
            stack += [(sub, f"{at}[{i}]") for i, sub in enumerate(item)]
        else:
            raise TypeError(
                f"Cannot checkpoint {at}: it is a {kind.__module__}.{kind.__qualname__}. A "
                "checkpoint holds only what safe loading (torch.load weights_only=True) "
                "rebuilds: tensors, numbers, strings, bytes, bools, None, torch dtypes, devices "
                "and sizes, and lists, tuples, sets and dicts of them"
            )


def check_fits(module: torch.nn.Module, saved: Mapping[str, Any], path: Path) -> None:
    """Raise naming the first key or shape that differs between ``saved`` and ``module``."""
    mine = module.state_dict()
    missing = [k for k in mine if k not in saved]
    unexpected = [k for k in saved if k not in mine]
    if missing or unexpected:
        # The first few names are enough to recognise the cause (another model, a prefix).
        parts = [f"{len(keys)} {what} key(s) {keys[:3]}"
                 for what, keys in (("missing", missing), ("unexpected", unexpected)) if keys]
        raise CheckpointError(f"Checkpoint {path} does not fit the model: {', '.join(parts)}")
    for key, tensor in mine.items():
        other = saved[key]
        if isinstance(tensor, torch.Tensor) and (
            not isinstance(other, torch.Tensor) or other.shape != tensor.shape
        ):
            theirs = tuple(other.shape) if isinstance(other, torch.Tensor) else type(other).__name__
            raise CheckpointError(
                f"Checkpoint {path} does not fit the model: {key!r} has shape {theirs} in the "
                f"checkpoint and {tuple(tensor.shape)} in the model"
            )


def load_comm_state(obj: Any, saved: list | None, path: Path, rank: int, world: int) -> None:
    """Give ``obj`` (a Checkpointer's ``comm_state``) this rank's entry of ``saved``."""
    if saved is None:
        raise CheckpointError(f"Checkpoint {path} holds no comm_state, but a comm_state was given")
    if len(saved) != world:
        raise CheckpointError(
            f"Checkpoint {path} holds the comm_state of {len(saved)} ranks, this run has {world}: it is "
            "each rank's own (error feedback, local parameters), so it resumes at the same world size "
            "only; pass comm_state=None to start it afresh"
        )
    try:
        obj.load_state_dict(saved[rank])
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"Checkpoint {path}: its comm_state does not fit the comm_state given: {e}") from e
