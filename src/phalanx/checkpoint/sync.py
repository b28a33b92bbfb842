"""How the ranks of a save or a load exchange data with the writer: the group's rank 0, or
while ranks have joined (phalanx.join) the highest rank still active.

Every helper takes the ``group`` (``None``: the world) and is a no-op exchange when there is
no process group or it has one rank. The ranks' verdicts travel through
:func:`phalanx.agreement.agree`; the errors they carry are made here.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..errors import CheckpointError, RankMismatchError

# A save's errors that reach the other ranks as they are; any other becomes a CheckpointError.
SAVE_ERRORS = (CheckpointError, RankMismatchError, TypeError, ValueError)


def as_shared(error: Exception, prefix: str = "", keep: tuple[type, ...] = (CheckpointError,)) -> Exception:
    """``error`` itself if it is one of ``keep``; else a CheckpointError of ``prefix``, its type
    and its message, caused by it."""
    if isinstance(error, keep):
        return error
    shared = CheckpointError(f"{prefix}{type(error).__name__}: {error}")
    shared.__cause__ = error
    return shared


def attempt(fn: Any, *args: Any) -> tuple[Any, Exception | None]:
    """``(fn(*args), None)``, or ``(None, the error as a CheckpointError)`` if it raised."""
    try:
        return fn(*args), None
    except Exception as e:
        return None, as_shared(e)


def distributed(group: dist.ProcessGroup | None) -> bool:
    return dist.is_initialized() and dist.get_world_size(group) > 1


def is_writer(group: dist.ProcessGroup | None, writer: int = 0) -> bool:
    """Whether this process is the writer: rank ``writer`` of ``group`` (or alone)."""
    return not dist.is_initialized() or dist.get_rank(group) == writer


def writer_global_rank(group: dist.ProcessGroup | None, writer: int = 0) -> int:
    return writer if group is None else dist.get_global_rank(group, writer)


def gather_to_writer(obj: Any, group: dist.ProcessGroup | None, writer: int = 0) -> list | None:
    """Every rank's ``obj`` on the writer (``None`` elsewhere)."""
    if not distributed(group):
        return [obj]
    out = [None] * dist.get_world_size(group) if is_writer(group, writer) else None
    dist.gather_object(obj, out, dst=writer_global_rank(group, writer), group=group)
    return out


def broadcast_from_writer(obj: Any, group: dist.ProcessGroup | None, writer: int = 0) -> Any:
    if not distributed(group):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=writer_global_rank(group, writer), group=group)
    return box[0]
