"""DistributedDataParallel's part in :mod:`phalanx.uneven` (uneven inputs).

On a rank that still has inputs, while others have joined, each synchronising forward's check
is waited for and announces the step; its verdict names the ranks still active, which set the
divisor of the average (the initial world size, or with ``divide_by_initial_world_size=False``
the active ranks) and the rank whose buffers are broadcast (the highest active one, as in
torch: rank 0 may have joined with stale buffers). Each bucket, the sparse gradients and the
buffer broadcast are announced by the reducer and the buffer sync themselves.

On a rank that has joined, :func:`shadow` takes part in each announced collective: zeros into
every bucket (and its control tail), the average back into ``.grad`` (a ZeRO shard it owns
steps with it), empty sparse gradients, the active rank's buffers received.

When every rank has joined, :func:`end` gives every rank the parameters and buffers of the
last rank to join (the highest of them), as torch's join does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .. import comm
from .checkin import BUCKET, BUFFERS, FORWARD, SPARSE


def begin(ddp: Any, join: Any) -> None:
    """``ddp`` is joinable number ``index`` of ``join``."""
    index = join.joinables.index(ddp)
    ddp._join_index = index
    ddp._join_divide_initial = join.divide_by_initial_world_size
    if ddp._reducer is not None:
        ddp._reducer.join_index = index


def step_settings(ddp: Any, verdict: Any) -> int | None:
    """After an active rank's forward check while ranks have joined: set the divisor of this
    step's average; return the rank whose buffers count (``None`` outside a join)."""
    if verdict is None or ddp._reducer is None:
        return None
    world = dist.get_world_size(ddp.process_group)
    ddp._reducer.set_divisor(world if ddp._join_divide_initial else verdict.count)
    return max(verdict.ranks)


def shadow(ddp: Any, action: int, verdict: Any) -> None:
    """A rank that has joined takes part in what an active rank's DDP announced."""
    reducer = ddp._reducer
    args = verdict.announce[3:]
    if action == FORWARD:
        return  # its collectives are announced one by one
    if action == BUFFERS:
        ddp._buffer_sync.receive(args[0])
    elif action == BUCKET:
        _shadow_bucket(reducer, args[0])
    elif action == SPARSE:
        for work in reducer._sparse.launch(nothing=True):
            work.wait()


def _shadow_bucket(reducer: Any, b: int) -> None:
    """Zeros into bucket ``b``'s collective (its tail too: no problem, no use reported); after
    the last bucket, the averages into ``.grad`` as a backward would write them."""
    bucket = reducer._buckets[b]
    if bucket.buffer is None:
        bucket.allocate()
    bucket.buffer.zero_()
    reducer.bucket_comm.launch(b, bucket.buffer).wait()
    if b < len(reducer._buckets) - 1:
        return
    tail = bucket.tail
    if tail[0].item() > 0:
        reducer._raise_problems()  # the active ranks raise: so does this one, with them
    used = (tail[1:] > 0).tolist() if reducer.allow_unused else None
    for k in range(len(reducer._buckets)):
        reducer._write_back(k, used)
    for each in reducer._buckets:
        if not each.keep:
            each.release()


def end(ddp: Any, last: int) -> None:
    """Every rank has joined: every rank takes rank ``last``'s parameters (and buffers, when
    the forwards broadcast them)."""
    tensors = list(ddp.module.parameters())
    if ddp.forward_sync_buffers:
        tensors += list(ddp.module.buffers())
    with torch.no_grad():
        comm.broadcast_tensors(tensors, src=last, group=ddp.process_group)


def leave(ddp: Any) -> None:
    """The join is over: the average is over the whole group again."""
    ddp._join_index = None
    if ddp._reducer is not None:
        ddp._reducer.join_index = None
        ddp._reducer.set_divisor(dist.get_world_size(ddp.process_group))
