"""Pure planning: which parameter's gradient goes where in which flat buffer.

No communication and no autograd here, so the plan can be tested alone. The reducer turns a
plan into buffers (a :class:`Bucket` per :class:`BucketSpec`) and hooks.

The rules (those of torch's DDP, so bucket boundaries match at the same ``bucket_cap_mb``):

* only parameters that require a gradient are bucketed; a tensor listed twice (tied
  weights registered under two names) is bucketed once, under its first name;
* parameters are taken in *reverse* registration order, because the backward pass produces
  the gradients of the last layers first;
* a bucket holds one (device, dtype) only; each (device, dtype) fills its own open bucket;
* a bucket closes once it holds at least its cap; the first bucket of every (device, dtype)
  is capped at ``first_bucket_bytes`` (1 MiB) so the first all-reduce starts early, the
  rest at ``bucket_bytes``; or, with ``caps`` (torch's ``bucket_cap_mb_list``), the n-th
  bucket of each at ``caps[n]``, the last cap for the rest. A single tensor larger than the
  cap gets a bucket of its own.
* buckets are numbered by the position of their first parameter in that reversed order,
  which is the order the reducer launches them in on every rank.

With ``owners`` (ZeRO stage 2: the rank whose optimizer updates each parameter) a bucket
also holds one owner only: each (device, dtype, owner) fills its own open bucket, so the
bucket can be reduced to its owner alone. ``None`` is an owner too (parameters averaged on
every rank).

Parameters named in ``skip`` (those whose gradients come sparse: :mod:`phalanx.ddp.sparse`
reduces them) are in no bucket.

With ``reduce_dtype`` (mixed precision: :mod:`phalanx.ddp.mixed_precision`) every bucket of
floating-point gradients has that dtype, whatever the parameters': the caps count its bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Sequence

import torch

MIB = 1024 * 1024
# torch's DDP default bucket_cap_mb (nn/parallel/distributed.py): 25 MiB.
DEFAULT_BUCKET_CAP_MB = 25
# torch.distributed._DEFAULT_FIRST_BUCKET_BYTES: "Experiments showed 1MB is a reasonable value".
FIRST_BUCKET_BYTES = 1 * MIB
# A gradient of at least this many elements is divided on its way into its slot
# (``torch.div(grad, n, out=slot)``: one pass over it, as torch's reducer's ``mul_out``); smaller
# ones are copied in one batched copy and divided with the rest of the bucket (a call per
# gradient would cost more than the pass it saves).
DIVIDE_INTO_SLOT = 1 << 16


@dataclass(frozen=True)
class Slot:
    """One parameter's place in a bucket's flat buffer.

    Args:
        index: position of the parameter in the list given to :func:`plan_buckets`.
        name: the parameter's (first) name.
        offset: first element of its slice in the flat buffer.
        shape: the parameter's shape; its slice holds ``numel`` elements.
    """

    index: int
    name: str
    offset: int
    shape: torch.Size

    @property
    def numel(self) -> int:
        return self.shape.numel()


@dataclass(frozen=True)
class BucketSpec:
    """One flat buffer: its slots in the order the backward is expected to fill them.

    ``owner`` is the rank that keeps the bucket's averaged gradients (ZeRO stage 2), or
    ``None``: every rank keeps them.
    """

    device: torch.device
    dtype: torch.dtype
    slots: tuple[Slot, ...]
    owner: int | None = None

    @property
    def numel(self) -> int:
        if not self.slots:  # a bucket that only carries the reducer's control tail
            return 0
        last = self.slots[-1]
        return last.offset + last.numel

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def plan_buckets(
    named_params: Sequence[tuple[str, torch.Tensor]],
    bucket_bytes: int = DEFAULT_BUCKET_CAP_MB * MIB,
    first_bucket_bytes: int = FIRST_BUCKET_BYTES,
    owners: Sequence[int | None] | None = None,
    *,
    caps: Sequence[int] | None = None,
    skip: Collection[int] = (),
    reduce_dtype: torch.dtype | None = None,
) -> list[BucketSpec]:
    """Group ``named_params`` (registration order) into buckets, in launch order.

    Args:
        named_params: ``(name, tensor)`` pairs in registration order, as
            ``module.named_parameters()`` gives them.
        bucket_bytes: cap of every bucket but the first of each (device, dtype). Default 25 MiB.
        first_bucket_bytes: cap of the first bucket of each (device, dtype). Default 1 MiB.
        owners: the owner rank (or ``None``) of each entry of ``named_params``; buckets then
            never mix owners, and each owner's first bucket gets ``first_bucket_bytes``.
            Default ``None``: no owners.
        caps: the cap of the n-th bucket of each (device, dtype[, owner]) is
            ``caps[min(n, len(caps) - 1)]``; given, it replaces the two caps above (torch's
            ``bucket_cap_mb_list``). Default ``None``.
        skip: positions in ``named_params`` to leave out of every bucket (with every other
            name of the same tensor). Default: none.

    Returns:
        The buckets in launch order; :attr:`Slot.index` points back into ``named_params``.
        Empty when nothing requires a gradient.
    """
    caps = tuple(caps) if caps is not None else (first_bucket_bytes, bucket_bytes)
    if not caps or min(caps) <= 0:
        raise ValueError(f"bucket sizes must be positive, got caps of {list(caps)} bytes")
    if owners is not None and len(owners) != len(named_params):
        raise ValueError(
            f"owners must give one owner per parameter: {len(named_params)} parameters, got {len(owners)} owners"
        )
    seen = {id(named_params[i][1]) for i in skip}
    open_buckets: dict[tuple, list[int]] = {}  # (device, dtype, owner) -> indices in the open bucket
    open_bytes: dict[tuple, int] = {}
    closed_count: dict[tuple, int] = {}
    done: list[list[int]] = []
    for index in reversed(_distinct_trainable(named_params, seen)):
        tensor = named_params[index][1]
        dtype = _bucket_dtype(tensor, reduce_dtype)
        key = (tensor.device, dtype, None if owners is None else owners[index])
        members = open_buckets.setdefault(key, [])
        members.append(index)
        open_bytes[key] = open_bytes.get(key, 0) + tensor.numel() * dtype.itemsize
        cap = caps[min(closed_count.get(key, 0), len(caps) - 1)]
        if open_bytes[key] >= cap:
            done.append(members)
            closed_count[key] = closed_count.get(key, 0) + 1
            del open_buckets[key], open_bytes[key]
    done.extend(open_buckets.values())
    # Launch order: by the reversed position of each bucket's first parameter.
    done.sort(key=lambda members: -members[0])
    return [_spec(named_params, members, owners, reduce_dtype) for members in done]


def _distinct_trainable(named_params: Sequence[tuple[str, torch.Tensor]], seen: set[int]) -> list[int]:
    """Indices of the tensors that require grad, each tensor's first occurrence only."""
    keep = []
    for index, (_, tensor) in enumerate(named_params):
        if tensor.requires_grad and id(tensor) not in seen:
            seen.add(id(tensor))
            keep.append(index)
    return keep


def _spec(named_params: Sequence[tuple[str, torch.Tensor]], members: list[int],
          owners: Sequence[int | None] | None, reduce_dtype: torch.dtype | None) -> BucketSpec:
    slots, offset = [], 0
    for index in members:
        name, tensor = named_params[index]
        slots.append(Slot(index, name, offset, tensor.shape))
        offset += tensor.numel()
    first = named_params[members[0]][1]
    owner = None if owners is None else owners[members[0]]
    return BucketSpec(first.device, _bucket_dtype(first, reduce_dtype), tuple(slots), owner)


def _bucket_dtype(tensor: torch.Tensor, reduce_dtype: torch.dtype | None) -> torch.dtype:
    return reduce_dtype if reduce_dtype is not None and tensor.is_floating_point() else tensor.dtype


def describe(plan: Sequence[BucketSpec]) -> str:
    """One line per bucket: size and parameter names. DistributedDataParallel logs it at
    DEBUG (rank 0) each time it plans its buckets: ``logging.getLogger("phalanx").setLevel("DEBUG")``."""
    lines = []
    for i, bucket in enumerate(plan):
        names = ", ".join(slot.name for slot in bucket.slots)
        owner = "" if bucket.owner is None else f" for rank {bucket.owner}"
        lines.append(f"bucket {i}{owner}: {bucket.nbytes / MIB:.2f} MiB {bucket.dtype} on {bucket.device}: {names}")
    return "\n".join(lines)


class Bucket:
    """Runtime state of one :class:`BucketSpec`: its buffer, its slot views, what is pending.

    A kept bucket's buffer lives as long as the reducer; a bucket this rank does not keep
    gets one at its first gradient of a backward (:meth:`allocate`), dropped at the end.
    """

    def __init__(self, spec: BucketSpec, first: int, tail: int, keep: bool,
                 envelope: tuple[int, int] | None = None) -> None:
        self.spec = spec
        self.first = first  # position (launch order) of its first parameter
        self.keep = keep
        self._tail_numel = tail
        # (head, size): the buffer sits in a larger one, after a head of ``head`` values, padded
        # with zeros to ``size``: a sync point's envelope the bucket carries (phalanx.ledger)
        self._envelope = envelope
        self.envelope: torch.Tensor | None = None
        self.head: torch.Tensor | None = None  # the envelope's head, where a sync point goes
        self.buffer: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        self.grads: torch.Tensor | None = None  # the buffer without the tail
        self.tail: torch.Tensor | None = None
        # per slot, whether its gradient is divided on its way in (DIVIDE_INTO_SLOT); () if none is
        large = tuple(s.numel >= DIVIDE_INTO_SLOT for s in spec.slots)
        self.large = large if any(large) else ()
        if keep:
            self.allocate(torch.zeros)
        self.pending = len(spec.slots)

    def allocate(self, factory: Any = torch.empty) -> None:
        spec = self.spec
        numel = spec.numel + self._tail_numel
        if self._envelope is None:
            self.buffer = factory(numel, dtype=spec.dtype, device=spec.device)
        else:
            start, size = self._envelope
            self.envelope = torch.zeros(size, dtype=spec.dtype, device=spec.device)
            self.head, self.buffer = self.envelope[:start], self.envelope[start:start + numel]
        self.views = [self.buffer[s.offset : s.offset + s.numel].view(s.shape) for s in spec.slots]
        self.grads = self.buffer[: spec.numel]
        self.tail = self.buffer[spec.numel :]

    def release(self) -> None:
        self.buffer, self.views, self.grads, self.tail, self.envelope, self.head = None, [], None, None, None, None

    @property
    def positions(self) -> range:
        return range(self.first, self.first + len(self.spec.slots))
