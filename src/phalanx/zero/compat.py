"""What ``ZeroRedundancyOptimizer`` keeps of torch's surface beyond its own methods: the
arguments and methods it refuses, with what to do instead, and ``torch.optim.Optimizer``'s
state-dict hooks, which its own ``state_dict``/``load_state_dict`` run as torch's do
(``docs/torch_surface.md`` lists the whole surface)."""

from __future__ import annotations

from typing import Any, Callable

from torch.optim import Optimizer

NO_JOIN = (
    "ZeroRedundancyOptimizer joins phalanx's join, not torch's Join: for uneven inputs use "
    "`with phalanx.join(model, optimizer):` (phalanx.Join([model, optimizer]))"
)


def check_flags(parameters_as_bucket_view: Any, overlap_with_ddp: Any) -> None:
    """Both flags are bools; ``overlap_with_ddp=True`` is refused saying what to use instead."""
    for name, value in (("parameters_as_bucket_view", parameters_as_bucket_view),
                        ("overlap_with_ddp", overlap_with_ddp)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    if overlap_with_ddp:
        raise ValueError(
            "overlap_with_ddp=True is not supported: it runs the optimizer step inside a torch "
            "DDP communication hook, and phalanx's DDP runs no ZeRO step in its hooks. Keep "
            "overlap_with_ddp=False (phalanx's DDP already overlaps the gradient all-reduce with "
            "the backward pass); "
            "to also cut gradient memory, call ddp.shard_gradients(zero) on every rank (ZeRO "
            "stage 2: each rank receives only the averaged gradients of the parameters it owns)"
        )


def with_state_dict_hooks(optimizer: Optimizer, build: Callable[[], dict]) -> dict:
    """``build()`` between the hooks of ``register_state_dict_pre_hook``/``_post_hook``."""
    for hook in getattr(optimizer, "_optimizer_state_dict_pre_hooks", {}).values():
        hook(optimizer)
    state_dict = build()
    for hook in getattr(optimizer, "_optimizer_state_dict_post_hooks", {}).values():
        result = hook(optimizer, state_dict)
        state_dict = state_dict if result is None else result
    return state_dict


def run_load_pre_hooks(optimizer: Optimizer, state_dict: dict) -> dict:
    """The ``register_load_state_dict_pre_hook`` hooks; each may return a new state dict."""
    for hook in getattr(optimizer, "_optimizer_load_state_dict_pre_hooks", {}).values():
        result = hook(optimizer, state_dict)
        state_dict = state_dict if result is None else result
    return state_dict


def run_load_post_hooks(optimizer: Optimizer) -> None:
    """The ``register_load_state_dict_post_hook`` hooks."""
    for hook in getattr(optimizer, "_optimizer_load_state_dict_post_hooks", {}).values():
        hook(optimizer)
