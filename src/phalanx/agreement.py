"""Cross-rank agreement: each rank checks locally, then every rank learns every rank's verdict.

A check that involves several ranks must end the same way on all of them: if one rank raised
and the others went on, they would wait for it in their next collective until the timeout.
So each rank first checks what it can alone, then one exchange, :func:`agree`, tells every
rank what every rank found, and all of them raise, or none does.

The verdicts:

* ``items``: ``(name, description)`` pairs that must be identical on every rank (parameter
  shapes and settings, ZeRO owners...). A rank that differs from rank 0 makes every rank
  raise :class:`~phalanx.errors.RankMismatchError` naming the first differing position and
  what rank 0 and that rank have there.
* ``problem``: what this rank found wrong, an exception, or ``None``. If every rank reports
  the same problem, each raises it as it is; otherwise every rank raises one error, of the
  first problem's type, naming each problem and its ranks (``"<what> failed on rank 1:
  ..."``).
* ``decided_by=r``: only rank ``r`` checks (a checkpoint's writer); every rank raises rank
  ``r``'s problem with its type and message. All is well in one 1-element broadcast.

A rank raises its own exception object (traceback and cause intact); the others raise a
rebuilt one of its type, or of its nearest base among phalanx's errors, ``ValueError``,
``TypeError`` and ``RuntimeError``; anything else becomes a ``RuntimeError`` naming the type.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import torch
import torch.distributed as dist

from . import comm, errors
from .diagnostics import ledger

# The exception types a peer's problem is raised as on the other ranks, by name.
_REBUILDABLE = {cls.__name__: cls for cls in (
    errors.CheckpointError, errors.RankMismatchError, errors.UnusedParametersError,
    errors.NotInitializedError, errors.EnvironmentConfigError, errors.UsageError,
    ValueError, TypeError, RuntimeError,
)}


def agree(
    what: str,
    group: dist.ProcessGroup | None = None,
    *,
    items: Sequence[tuple[str, Any]] = (),
    problem: BaseException | None = None,
    decided_by: int | None = None,
    keep: comm.LastWorks | None = None,
) -> None:
    """Raise on every rank of ``group``, or on none: see the module notes.

    Args:
        what: what is being agreed on, for the messages ("Loading ckpt-5.ckpt", ...).
        group: the ranks that agree. Default ``None``: the world.
        items: ``(name, description)`` pairs every rank must hold alike.
        problem: what this rank found wrong, or ``None``.
        decided_by: the rank (within ``group``) whose problem alone counts. Default ``None``:
            every rank's.
        keep: where to keep the exchange's work handle (see :class:`~phalanx.comm.LastWorks`);
            only the ``decided_by`` exchange is asynchronous.

    Raises:
        RankMismatchError: ``items`` differ between ranks.
        Exception: the problem(s) reported, as described in the module notes.
    """
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        if problem is not None:
            raise problem
        return
    if decided_by is not None:
        _follow(decided_by, problem, group, keep)
        return
    # recorded as "agreement": what is agreed on may differ between ranks (a checkpoint's path)
    with ledger().collective("agreement", group=group, announced=True):
        everyone = comm.all_gather_object((_describe(problem), list(items)), group)
    _check_same([theirs for _, theirs in everyone], what)
    problems = {rank: p for rank, (p, _) in enumerate(everyone) if p is not None}
    if not problems:
        return
    if len(problems) == len(everyone) and len({_alike(p) for p in problems.values()}) == 1:
        raise problem  # every rank has this same problem: its own, as it is
    by_message: dict[str, list[int]] = {}
    for rank, described in problems.items():
        by_message.setdefault(_alike(described)[1], []).append(rank)
    parts = [f"on {errors.ranks_text(ranks)}: {msg}" for msg, ranks in by_message.items()]
    first_type = next(iter(problems.values()))[0]
    raise _rebuild((first_type, f"{what} failed " + "; ".join(parts))) from problem


def _follow(decider: int, problem: BaseException | None, group: dist.ProcessGroup | None,
            keep: comm.LastWorks | None) -> None:
    """Every rank raises what rank ``decider`` (in ``group``) reported, if anything; the
    others' problems are not looked at."""
    src = decider if group is None else dist.get_global_rank(group, decider)
    failed = torch.tensor([problem is not None], device=comm.collective_device(group))
    box = [_describe(problem)]
    with ledger().collective("agreement", (failed,), group, announced=True) as c:
        work = dist.broadcast(failed, src=src, group=group, async_op=True)
        c.wait(work)
        if keep is not None:
            keep.hold(work)
        if failed.item():
            dist.broadcast_object_list(box, src=src, group=group)
    if not failed.item():
        return
    if dist.get_rank(group) == decider:
        raise problem
    raise _rebuild(box[0])


def _describe(problem: BaseException | None) -> tuple[str, str] | None:
    """``(type name, message)``: phalanx's errors and the rebuildable types say their message,
    others are prefixed with their type (``"OSError: [Errno 28] ..."``)."""
    if problem is None:
        return None
    kind = next((c for c in type(problem).__mro__ if _REBUILDABLE.get(c.__name__) is c), None)
    if kind is None:
        return RuntimeError.__name__, f"{type(problem).__name__}: {problem}"
    return kind.__name__, str(problem)


def _alike(described: tuple[str, str]) -> tuple[str, str]:
    """A problem as compared between ranks: memory addresses in its message (an object's
    default repr, ``<object object at 0x7f...>``) differ from rank to rank, the problem does not."""
    name, message = described
    return name, re.sub(r"\b0x[0-9a-fA-F]+", "0x...", message)


def _rebuild(described: tuple[str, str]) -> BaseException:
    name, message = described
    return _REBUILDABLE[name](message)


def _check_same(gathered: list[list[tuple[str, Any]]], what: str) -> None:
    """Raise RankMismatchError (every rank sees the same ``gathered``) unless all are equal."""
    reference = gathered[0]
    differing = [r for r, theirs in enumerate(gathered) if theirs != reference]
    if not differing:
        return
    first = differing[0]
    theirs = gathered[first]
    i = next(i for i in range(max(len(reference), len(theirs)))
             if i >= len(reference) or i >= len(theirs) or reference[i] != theirs[i])
    mine = reference[i] if i < len(reference) else None
    other = theirs[i] if i < len(theirs) else None
    raise errors.RankMismatchError(
        f"{what} differ across ranks: ranks {', '.join(map(str, differing))} disagree with rank 0 "
        f"({len(reference)} vs {len(theirs)} entries on rank 0 and rank {first}). "
        f"First difference at position {i}: rank 0 has {_item(mine)}, rank {first} has {_item(other)}"
    )


def _item(item: tuple[str, Any] | None) -> str:
    if item is None:
        return "nothing"
    name, description = item
    return f"{name!r} {description}"
