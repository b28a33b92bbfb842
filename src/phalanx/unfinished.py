"""Work running in the background that must end before its process group does.

A checkpoint written in the background (``Checkpointer.save(blocking=False)``) issues its
collectives on a thread: if the group went first, the save would fail half-way, or hang.
Such work registers a ``finish`` callable with its group here (:func:`owe`) and removes it
when it has ended (:func:`settle`); :func:`phalanx.destroy_process_group` calls
:func:`finish` before it destroys anything, so the save is completed, and its outcome agreed
by every rank, first.

c10d's ``ProcessGroup`` takes no attributes of its own, so what a group is owed is kept here,
keyed weakly by the group (as its ledger is, :mod:`phalanx.diagnostics.attach`): it goes
with the group.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

# For each live group, the callables that finish its background work, in the order owed.
_OWED: weakref.WeakKeyDictionary[Any, list[Callable[[], Any]]] = weakref.WeakKeyDictionary()


def owe(group: Any, finish: Callable[[], Any]) -> None:
    """Register ``finish`` (a collective every rank of ``group`` calls) to run before
    ``group`` is destroyed, unless :func:`settle` removes it first."""
    _OWED.setdefault(group, []).append(finish)


def settle(group: Any, finish: Callable[[], Any]) -> None:
    """``finish`` has run (or need not): forget it. No-op if it is not registered."""
    owed = _OWED.get(group)
    if owed is not None and finish in owed:
        owed.remove(finish)


def finish(group: Any = None) -> BaseException | None:
    """Run what ``group`` is owed (``None``: every group's), each once, in the order
    registered; every one runs even if an earlier one raises. Returns the first error."""
    groups = list(_OWED) if group is None else [group]
    first = None
    for g in groups:
        for fn in list(_OWED.pop(g, [])):
            try:
                fn()
            except Exception as e:  # the caller decides: raise it, or log it
                first = first or e
    return first
