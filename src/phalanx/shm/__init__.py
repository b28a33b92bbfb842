"""Same-host shared-memory collectives for CPU tensors: a c10d backend, ``"phalanx_shm"``.

Importing this package registers the backend with torch
(``torch.distributed.Backend.register_backend``), so a plain torch script can name it::

    import phalanx.shm
    torch.distributed.init_process_group("phalanx_shm")      # or new_group(backend="phalanx_shm")

A group whose members are all on this host (checked at creation from each member's host
name, boot id and PID namespace, and by every member opening the segment) runs
all_reduce, reduce, broadcast, all_gather (list and tensor forms), reduce_scatter (both
forms), all_to_all_single and barrier over one shared segment; every other operation, and
every operation of a group that spans hosts, runs on Gloo. See docs/shared_memory.md.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from .channel import layout
from .group import BACKEND_NAME, ShmProcessGroup
from .segment import open_segment

# Bytes of each member's staging slot (two per member: one per half). 4 MiB: large enough
# that a step's fixed cost (tens of microseconds) is small against its copy, small enough
# that a world of 8 maps 64 MiB.
CAPACITY = 4 << 20

__all__ = ["BACKEND_NAME", "CAPACITY", "ShmProcessGroup", "create", "uses_shared_memory"]


def create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup | object:
    """c10d's creator for ``"phalanx_shm"``: a :class:`ShmProcessGroup` when every member is
    on this host, else the group's plain Gloo backend (collective: every member calls it)."""
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
    gloo._set_sequence_number_for_group()
    segment = open_segment(dist.PrefixStore("shm/", store), rank, size, layout(size, CAPACITY)[1],
                           timeout)
    if segment is None:
        return gloo
    return ShmProcessGroup(rank, size, segment, gloo, CAPACITY, timeout)


def uses_shared_memory(group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``group`` (default: the world) runs its collectives over shared memory."""
    group = group if group is not None else dist.group.WORLD
    return isinstance(group, ShmProcessGroup)


if BACKEND_NAME not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND_NAME, create, devices=["cpu"])
