"""``initialize``: a sharded model's parameters set as ``model.apply(fn)`` sets them on the
whole model, with one unit gathered at a time: built on the meta device and sharded, a model
is never whole on any rank, and its initial values are those of one process (torch's
``fully_shard`` leaves the initialisation to DTensor's random operators, which on the CPU
give every rank's shard the same numbers)."""

from __future__ import annotations

from typing import Callable, Iterator

from torch import nn

from .unit import Unit, unit_of


def initialize(module: nn.Module, fn: Callable[[nn.Module], None]) -> nn.Module:
    """Apply ``fn`` to every submodule of ``module`` (and ``module``) in ``nn.Module.apply``'s
    order, each seeing its parameters whole.

    For a module holding a unit's parameters, the unit is gathered first (its current values),
    ``fn`` runs, every rank keeps its rows of the result, and the unit is freed again. ``fn``
    must do the same on every rank: seed the random generator alike first, as for a model
    built alike on every rank.

    Args:
        module (nn.Module): a model sharded with ``fully_shard``, its parameters on the meta
            device or not.
        fn (callable): ``fn(submodule)``, e.g. one that calls ``reset_parameters()``.

    Returns:
        ``module``.

    Raises:
        ValueError: for a unit with a mixed-precision ``param_dtype`` (its unsharded
            parameters would round the values).

    Example::

        >>> with torch.device("meta"):
        ...     model = GPT()
        >>> for block in model.blocks:
        ...     fully_shard(block)
        >>> fully_shard(model)
        >>> torch.manual_seed(0)   # alike on every rank
        >>> initialize(model, lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    """
    owners = _owners(module)
    for unit in set(owners.values()):
        if unit.params.compute_dtype != unit.params.dtype:
            raise ValueError(f"initialize: unit {unit.name} gathers {unit.params.compute_dtype} "
                             f"(mp_policy.param_dtype) for {unit.params.dtype} shards: initialise "
                             "before sharding with a mixed-precision policy, or without one")
    for sub in _apply_order(module):
        unit = owners.get(sub)
        if unit is None:
            fn(sub)
            continue
        unit.unshard()
        unit.wait_for_unshard()
        fn(sub)
        unit.params.keep_own_rows()
        unit.reshard()
    return module


def _owners(module: nn.Module) -> dict[nn.Module, Unit]:
    """Each module holding a unit's parameters, and that unit."""
    owners: dict[nn.Module, Unit] = {}
    for sub in module.modules():
        unit = unit_of(sub)
        if unit is not None:
            for s in unit.params.slots:
                for holder, _ in s.locations:
                    owners[holder] = unit
    return owners


def _apply_order(module: nn.Module) -> Iterator[nn.Module]:
    """``nn.Module.apply``'s order: each child's (recursively), then the module itself."""
    for child in module.children():
        yield from _apply_order(child)
    yield module
