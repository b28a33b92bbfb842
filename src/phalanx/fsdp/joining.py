"""``fully_shard``'s part in :mod:`phalanx.uneven` (uneven inputs, ``phalanx.join``).

A model sharded by ``fully_shard`` is listed in the join as its root module
(``phalanx.join(model, optimizer)``). Unlike a DDP replica, a rank that has joined still holds
a shard of every parameter, which the others need and which nobody else updates. So:

* **all-gather** (forward, backward, prefetch): each unit announces its all-gather; a rank that
  has joined sends its real shard (the others need its rows), and drops what it receives.
* **reduce-scatter**: each unit announces it; a rank that has joined sends zeros and receives
  the average of its rows into its sharded ``.grad``, accumulated as on the others since its
  last step. The average is DDP's join's: over the initial world size
  (``divide_by_initial_world_size=True``, the default) or over the ranks still active at
  that reduce-scatter (``False``: a sum, divided once its sync point has named them).
* **optimizer step**: the plain optimizers listed in the join announce each ``step()`` of an
  active rank (an optimizer step pre-hook); a rank that has joined steps the same optimizer on
  its shards with those gradients, then clears them, so that its rows move as the others'.
  The active ranks' ``zero_grad()`` is not announced: the joined rank clears its gradients
  after each step it takes, so the others must step after each synchronised backward they
  want counted and zero their gradients after (or before the next backward), as usual.

When every rank has joined, the shards are already the ones every rank needs: nothing moves.
"""

from __future__ import annotations

import weakref
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..diagnostics import ledger
from ..errors import UsageError

if TYPE_CHECKING:
    from .unit import Unit

# The optimizers each fully_shard root in a running join steps on a joined rank (one root each).
_CLAIMED: weakref.WeakKeyDictionary[torch.optim.Optimizer, Any] = weakref.WeakKeyDictionary()


class FSDPAction(IntEnum):
    """What a ``fully_shard`` root announces to ranks that have joined (its codes travel in
    sync points: only add)."""

    ALL_GATHER = 1  # (unit index)
    REDUCE_SCATTER = 2  # (unit index)
    STEP = 3  # (optimizer index)


class JoinPart:
    """One ``fully_shard`` root's place in a running join.

    Args:
        root: the module listed in the join (its announcements name it).
        units: the units below it, in ``modules()`` order (the same on every rank).
        optimizers: the plain optimizers listed in the join (their steps are announced).
        divide_initial: the join's ``divide_by_initial_world_size``.
    """

    def __init__(self, root: Any, units: list[Unit], optimizers: list[torch.optim.Optimizer],
                 divide_initial: bool) -> None:
        self.root, self.units, self.optimizers = root, units, optimizers
        self.divide_initial = divide_initial
        self._stepping = False  # this rank steps an optimizer as a shadow: announce nothing
        self._fresh = True  # the next shadowed reduce-scatter starts new gradients
        self._hooks = [opt.register_step_pre_hook(self._announce_step) for opt in optimizers]

    def announce(self, unit: Unit, action: FSDPAction) -> tuple[int, ...] | None:
        """The announcement of ``unit``'s collective (``None`` outside the join)."""
        return ledger().shadow(self.root, action, self.units.index(unit))

    def divisor(self, pre_divide: float | None) -> Callable[[], float]:
        """What a reduce-scatter's sum is divided by after it lands (having been divided by
        ``pre_divide`` before): the number of ranks active at its sync point."""
        view = ledger().join
        assert view is not None  # called by a unit's reduce-scatter inside the join
        return lambda: len(view.active) / (pre_divide or 1)

    def _announce_step(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        if self._stepping:
            return
        book = ledger()
        shadow = book.shadow(self.root, FSDPAction.STEP, self.optimizers.index(optimizer))
        if shadow is not None:
            book.sync_point(f"fully_shard optimizer step {type(optimizer).__name__}", announce=shadow)

    def shadow(self, action: int, args: tuple[int, ...]) -> None:
        """On a rank that has joined: take part in ``action`` announced by the active ranks."""
        if action == FSDPAction.ALL_GATHER:
            self.units[args[0]].shadow_all_gather()
        elif action == FSDPAction.REDUCE_SCATTER:
            if self._fresh:  # the others zeroed their gradients before this backward
                self._fresh = False
                for unit in self.units:
                    unit.clear_sharded_grads()
            self.units[args[0]].shadow_reduce_scatter()
        elif action == FSDPAction.STEP:
            optimizer = self.optimizers[args[0]]
            self._stepping = True
            try:
                optimizer.step()
            finally:
                self._stepping = False
            optimizer.zero_grad()
            self._fresh = True
        else:
            raise UsageError(f"fully_shard under phalanx.join: unknown announcement {action} (ranks "
                             "running different phalanx versions?)")

    def leave(self) -> None:
        for hook in self._hooks:
            hook.remove()
        for optimizer in self.optimizers:
            _CLAIMED.pop(optimizer, None)
        for unit in self.units:
            unit.join = None


def begin(root: Any, units: list[Unit], join: Any) -> JoinPart:
    """``root`` enters ``join`` (every rank): refuse what a joined rank cannot shadow. Its
    optimizers: those of the join that step some of its parameters (a joined rank steps them)."""
    hsdp = [unit.name for unit in units if unit.replicate_group is not None]
    if hsdp:
        raise UsageError(f"phalanx.join does not support HSDP (a 2-D mesh) yet: fully_shard unit "
                         f"{hsdp[0]} is replicated across a mesh dimension; shard it on a 1-D mesh")
    twice = [unit.name for unit in units if unit.join is not None]
    if twice:
        raise UsageError(f"fully_shard unit {twice[0]} is in phalanx.join twice (list only the "
                         "root module of each fully_shard model)")
    mine = {id(s.sharded) for unit in units for s in unit.params.slots}
    optimizers = [opt for opt in join.optimizers
                  if any(id(p) in mine for group in opt.param_groups for p in group["params"])]
    shared = [opt for opt in optimizers if opt in _CLAIMED]
    if shared:
        raise UsageError(f"{type(shared[0]).__name__} steps the parameters of two fully_shard roots "
                         "in one phalanx.join: a rank that has joined would step it twice; give "
                         "each sharded model its own optimizer")
    _CLAIMED.update(dict.fromkeys(optimizers, root))
    part = JoinPart(root, units, optimizers, join.divide_by_initial_world_size)
    for unit in units:
        unit.join = part
    return part
