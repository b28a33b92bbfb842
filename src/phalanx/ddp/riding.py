"""The forward's sync point riding a DDP step's only bucket (:mod:`phalanx.ddp.checkin`).

A model whose gradients fit one small float32 CPU bucket, all-reduced as it is (no comm hook,
no ZeRO owner, no sparse gradients), gives that bucket a larger buffer, the *envelope* every
sync point has (:mod:`phalanx.ledger.syncpoint`): the check's head, then the gradients and the
control tail, then zeros. The forward's check is not sent on its own: the bucket takes it
(:meth:`BucketRide.take`, the head copied with the gradients) and, once summed, hands the
summed head to the ledger (:meth:`BucketRide.arrived`), which raises on every rank before any
gradient is used if the ranks disagree.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..ledger import Ledger, syncpoint
from .bucket_comm import AllReduceMean, BucketComm
from .bucketing import Bucket, BucketSpec


def envelope(plan: Sequence[BucketSpec], tail: int, bucket_comm: BucketComm, sparse: bool,
             book: Ledger) -> tuple[int, int] | None:
    """Where a sync point's head goes in the only bucket, and the envelope's size, when that
    bucket can carry the forward's sync point: diagnostics on, one bucket of the sync point's
    dtype on the CPU that fits after the head, all-reduced as it is (no comm hook, no ZeRO
    owner), no sparse gradients (their collectives come before it). ``None`` otherwise: the
    sync point goes alone."""
    if not book.enabled or len(plan) != 1 or sparse or not isinstance(bucket_comm, AllReduceMean):
        return None
    spec, world = plan[0], dist.get_world_size(bucket_comm.group)
    start, size = syncpoint.head_size(world), syncpoint.envelope_size(world)
    if (spec.dtype != syncpoint.envelope_dtype(world) or spec.device.type != "cpu"
            or start + spec.numel + tail > size or not book.rides_on(bucket_comm.group)):
        return None
    return start, size


def signature(plan: Sequence[BucketSpec], tail: int) -> str:
    """What a riding check names (and fingerprints), ``"DDP bucket 0 float32[22]"``: ranks that
    would sum different buckets disagree."""
    return f"DDP bucket 0 {str(plan[0].dtype).removeprefix('torch.')}[{plan[0].numel + tail}]"


class BucketRide:
    """The sync point riding the bucket of this backward, from its launch to its sums.

    Args:
        group: the DDP's process group.
    """

    __slots__ = ("group", "ride", "_head", "_raw")

    def __init__(self, group: Any) -> None:
        self.group = group
        self.ride: Any = None  # the ledger's Ride taken by the bucket in flight
        # the bucket's head last filled, and its memory as a NumPy array: the check's head is
        # written into it and the sums compared as bytes with the unanimous ones (torch's copy
        # and comparison of a few values cost a latency-bound step more than the rest of its
        # check); made again when the bucket allocates another head
        self._head: Any = None
        self._raw: Any = None

    def take(self, book: Ledger, bucket: Bucket, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The tensor to all-reduce for ``bucket``: its envelope, the pending sync point's head
        queued in ``copies`` (:func:`~phalanx.ddp.slots.fill`), or, with no sync point waiting to
        ride (another collective sent it), the bucket's buffer alone."""
        self.ride = book.take_ride(self.group)
        if self.ride is None:
            return bucket.buffer
        head = bucket.head
        if head is not self._head:
            self._head, self._raw = head, raw_memory(head)
        if self._raw is not None:
            self._raw[:] = self.ride.payload[5]  # (NumPy: a third of the instructions of torch's copy)
        else:
            copies.append((head, self.ride.head))
        return bucket.envelope

    def arrived(self, book: Ledger, bucket: Bucket) -> None:
        """The bucket that carried the forward's sync point is summed: its verdict first (a
        mismatch raises on every rank before any gradient is used)."""
        ride, self.ride = self.ride, None
        head = bucket.head
        raw = self._raw if head is self._head else None  # (take() viewed the head it filled)
        if raw is not None and raw.tobytes() == ride.payload[4]:
            return  # every rank agrees (Ledger.arrived's first test, inline: every step passes it)
        try:
            book.arrived(ride, head, raw)
        except BaseException:
            # another rank's payload of another layout met this one: clear the padding
            bucket.envelope[bucket.head.numel():].zero_()
            raise


def raw_memory(tensor: torch.Tensor) -> Any:
    """``tensor``'s memory as a NumPy array sharing it (``.tobytes()`` reads it in one call), or
    ``None`` where NumPy cannot view it."""
    try:
        return tensor.numpy()
    except (RuntimeError, TypeError):  # no NumPy, or a tensor it cannot hold
        return None
