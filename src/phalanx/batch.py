"""A constant global batch at any world size: how many micro-batches each rank accumulates.

An elastic job (``phalanx run --nnodes MIN:MAX``) resumes at whatever world size the nodes
present give. With a fixed per-rank batch the global batch, and with it the optimisation,
would change with the world size; :func:`accumulation_steps` keeps it: each optimizer step
trains on ``micro_batch x world_size x steps = global_batch`` samples. The sampler's global
cursor (:class:`phalanx.DistributedSampler`) serves every sample once whatever the world size.
"""

from __future__ import annotations

from . import process_group
from ._logging import get_logger

_log0 = get_logger(__name__, rank_zero_only=True)
# How many of the world sizes that would divide the global batch an error message lists.
_LISTED = 8


def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"Invalid {name} {value}, expected a positive integer")
    return value


def accumulation_steps(global_batch: int, micro_batch: int, world_size: int | None = None, *,
                       exact: bool = True) -> int:
    """How many micro-batches each rank accumulates per optimizer step, so that one step
    trains on ``global_batch`` samples at this world size.

    ``global_batch = micro_batch * world_size * steps``. Call it after each (re)start, with
    the sampler's and DataLoader's ``batch_size=micro_batch``; step the optimizer every
    ``steps`` micro-batches (under DDP's ``no_sync()`` for all but the last) and divide the
    loss by ``steps``.

    Args:
        global_batch (int): samples per optimizer step, over all ranks.
        micro_batch (int): samples per forward/backward on one rank.
        world_size (int, optional): default: the process group's (or the environment's).
        exact (bool): when ``global_batch`` is not a multiple of ``micro_batch *
            world_size``, raise (``True``, the default), or return the nearest count
            (at least 1) and log on rank 0 the global batch it gives (``False``).

    Returns:
        int: the number of micro-batches per optimizer step, at least 1.

    Raises:
        ValueError: it does not divide and ``exact`` is true; the message names the world
            sizes at which it would, and what ``exact=False`` would train on.
        TypeError: an argument that is not an int.

    Example::

        >>> steps = phalanx.accumulation_steps(256, 32)          # 8 ranks: 1, 4 ranks: 2
        >>> for i, (x, y) in enumerate(loader):
        ...     last = (i + 1) % steps == 0
        ...     with contextlib.nullcontext() if last else model.no_sync():
        ...         (loss_fn(model(x), y) / steps).backward()
        ...     if last:
        ...         optimizer.step(); optimizer.zero_grad()
    """
    _count("global_batch", global_batch)
    _count("micro_batch", micro_batch)
    world = _count("world_size", process_group.get_world_size() if world_size is None else world_size)
    per_step = micro_batch * world
    if global_batch % per_step == 0:
        return global_batch // per_step
    nearest = max(1, round(global_batch / per_step))
    if exact:
        sizes = [w for w in range(1, global_batch // micro_batch + 1)
                 if global_batch % (micro_batch * w) == 0][:_LISTED]
        raise ValueError(
            f"global_batch {global_batch} is not a multiple of micro_batch {micro_batch} x world "
            f"size {world} = {per_step}. It divides at world sizes "
            f"{', '.join(map(str, sizes)) or 'none (micro_batch does not divide it)'}; "
            f"accumulation_steps(..., exact=False) trains on the nearest, {nearest * per_step} "
            f"samples per step ({nearest} x {per_step})"
        )
    _log0.warning("global batch %d at world size %d: %d micro-batches of %d per rank train on %d "
                  "samples per step", global_batch, world, nearest, micro_batch, nearest * per_step)
    return nearest
