"""Thin helpers over torch.distributed collectives.

Every helper takes a ``group`` (``None`` means the default group) and uses c10d's
collectives; nothing here moves bytes by itself.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

from .errors import RankMismatchError

# torch's DDP broadcasts module states in 250 MiB coalesced chunks (distributed.py,
# _DEFAULT_BROADCAST_BUCKET); the same bound keeps our temporary flat buffers modest.
BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous 1-D buffer holding ``tensors`` back to back (same dtype and device)."""
    if len(tensors) == 1:
        return tensors[0].detach().reshape(-1).clone()
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` back into ``tensors`` in place."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n


def _chunks(tensors: Iterable[torch.Tensor], limit: int) -> Iterable[list[torch.Tensor]]:
    """Group tensors by (device, dtype) into lists of at most ``limit`` bytes (one may exceed it)."""
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        groups[(t.device, t.dtype)].append(t)
    for same in groups.values():
        chunk: list[torch.Tensor] = []
        size = 0
        for t in same:
            nbytes = t.numel() * t.element_size()
            if chunk and size + nbytes > limit:
                yield chunk
                chunk, size = [], 0
            chunk.append(t)
            size += nbytes
        if chunk:
            yield chunk


def broadcast_tensors(
    tensors: Sequence[torch.Tensor],
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    chunk_bytes: int = BROADCAST_CHUNK_BYTES,
) -> None:
    """Overwrite ``tensors`` on every rank with rank ``src``'s values, in coalesced chunks.

    ``src`` is a global rank, as in ``torch.distributed.broadcast``.
    """
    tensors = [t for t in tensors if t.numel() > 0]
    if not tensors or dist.get_world_size(group) == 1:
        return
    for chunk in _chunks(tensors, chunk_bytes):
        flat = flatten(chunk)
        dist.broadcast(flat, src=src, group=group)
        if dist.get_rank() != src:
            unflatten_into(flat, chunk)


def all_gather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``obj``, indexed by rank within ``group``."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def check_same_across_ranks(
    items: Sequence[tuple[str, Any]],
    what: str,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Raise on every rank unless all ranks hold the same ``items``.

    ``items`` is a list of ``(name, description)`` pairs, e.g. a parameter's name and its
    ``(shape, dtype)``. The error names the first position where ranks differ, what each
    rank has there, and which ranks agree with rank 0.

    Raises:
        RankMismatchError: on every rank of ``group``, never on only some of them.
    """
    gathered = all_gather_object(list(items), group)
    reference = gathered[0]
    differing = [r for r, theirs in enumerate(gathered) if theirs != reference]
    if not differing:
        return
    first = differing[0]
    theirs = gathered[first]
    for i in range(max(len(reference), len(theirs))):
        mine = reference[i] if i < len(reference) else None
        other = theirs[i] if i < len(theirs) else None
        if mine != other:
            break
    ranks = ", ".join(str(r) for r in differing)
    raise RankMismatchError(
        f"{what} differ across ranks: ranks {ranks} disagree with rank 0 "
        f"({len(reference)} vs {len(theirs)} entries on rank 0 and rank {first}). "
        f"First difference at position {i}: rank 0 has {_describe(mine)}, "
        f"rank {first} has {_describe(other)}"
    )


def _describe(item: tuple[str, Any] | None) -> str:
    if item is None:
        return "nothing"
    name, desc = item
    return f"{name!r} {desc}"


def all_reduce_any(flag: bool, group: dist.ProcessGroup | None = None) -> bool:
    """True on every rank if ``flag`` is true on any rank (one small all-reduce)."""
    device = _collective_device(group)
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item() > 0)


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a small tensor must live for ``group``'s backend (NCCL wants the current GPU)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
