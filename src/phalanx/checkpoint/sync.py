"""How the ranks of a checkpoint agree: one outcome on every rank, errors raised everywhere.

The group's rank 0 is the writer. Every helper takes the ``group`` (``None``: the world) and is
a no-op exchange when there is no process group or it has one rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .. import comm
from ..errors import CheckpointError, RankMismatchError

# Errors sent from one rank to the others keep their type; anything else becomes a CheckpointError.
_SHARED_ERRORS = (CheckpointError, RankMismatchError, TypeError, ValueError)


def attempt(fn: Any, *args: Any) -> tuple[Any, str | None]:
    """``(fn(*args), None)``, or ``(None, message)`` if it raised."""
    try:
        return fn(*args), None
    except Exception as e:
        return None, str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"


def agree(failure: str | None, group: dist.ProcessGroup | None, what: str) -> None:
    """Raise the same ``CheckpointError`` on every rank if ``failure`` is set on any."""
    failures = comm.all_gather_object(failure, group) if distributed(group) else [failure]
    by_message: dict[str, list[int]] = {}
    for rank, message in enumerate(failures):
        if message is not None:
            by_message.setdefault(message, []).append(rank)
    if not by_message:
        return
    if len(by_message) == 1 and len(next(iter(by_message.values()))) == len(failures):
        raise CheckpointError(next(iter(by_message)))
    parts = [f"on rank(s) {', '.join(map(str, ranks))}: {msg}" for msg, ranks in by_message.items()]
    raise CheckpointError(f"{what} failed " + "; ".join(parts))


def distributed(group: dist.ProcessGroup | None) -> bool:
    return dist.is_initialized() and dist.get_world_size(group) > 1


def is_writer(group: dist.ProcessGroup | None) -> bool:
    return not dist.is_initialized() or dist.get_rank(group) == 0


def writer_global_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_global_rank(group, 0)


def gather_to_writer(obj: Any, group: dist.ProcessGroup | None) -> list | None:
    """Every rank's ``obj`` on the group's rank 0 (``None`` elsewhere)."""
    if not distributed(group):
        return [obj]
    out = [None] * dist.get_world_size(group) if is_writer(group) else None
    dist.gather_object(obj, out, dst=writer_global_rank(group), group=group)
    return out


def broadcast_from_writer(obj: Any, group: dist.ProcessGroup | None) -> Any:
    if not distributed(group):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=writer_global_rank(group), group=group)
    return box[0]


def share_outcome(
    error: Exception | None, group: dist.ProcessGroup | None
) -> tuple[tuple[str, str] | None, dist.Work | None]:
    """The writer's outcome on every rank: ``(None or (error type, message), work handle)``.

    The caller keeps the handle, so that Gloo's worker thread never drops the last C++
    reference to the flag tensor. In torch 2.13 that drop takes the GIL; if it comes while
    the interpreter exits (a save is often a script's last collective) the process aborts
    with "terminate called without an active exception".
    """
    if not distributed(group):
        return describe(error), None
    failed = torch.tensor([error is not None], device=comm.collective_device(group))
    work = dist.broadcast(failed, src=writer_global_rank(group), group=group, async_op=True)
    work.wait()
    if not failed.item():
        return None, work
    return broadcast_from_writer(describe(error), group), work


def shareable(error: Exception, what: str) -> Exception:
    if isinstance(error, _SHARED_ERRORS):
        return error
    return CheckpointError(f"{what}: {type(error).__name__}: {error}")


def describe(error: Exception | None) -> tuple[str, str] | None:
    if error is None:
        return None
    kind = next(cls for cls in _SHARED_ERRORS if isinstance(error, cls))
    return kind.__name__, str(error)


def rebuild(outcome: tuple[str, str]) -> Exception:
    kind, message = outcome
    return {cls.__name__: cls for cls in _SHARED_ERRORS}[kind](message)
