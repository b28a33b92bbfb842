"""torch's ``ZeroRedundancyOptimizer`` arguments and methods that phalanx refuses, with what
to do instead (``docs/torch_surface.md`` lists the whole surface)."""

from __future__ import annotations

from typing import Any

NO_JOIN = (
    "ZeroRedundancyOptimizer does not support torch's Join (uneven inputs across ranks), as "
    "phalanx's DDP does not: give every rank the same number of batches, e.g. with "
    "phalanx.DistributedSampler (padding, or drop_last=True)"
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
            "DDP communication hook, and phalanx's DDP has none. Keep overlap_with_ddp=False "
            "(phalanx's DDP already overlaps the gradient all-reduce with the backward pass); "
            "to also cut gradient memory, call ddp.shard_gradients(zero) on every rank (ZeRO "
            "stage 2: each rank receives only the averaged gradients of the parameters it owns)"
        )
