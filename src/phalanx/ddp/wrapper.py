"""DistributedDataParallel: one replica per process, gradients averaged during backward.

The wrapper is thin; the work is done by three objects it composes:

* :func:`phalanx.ddp.bucketing.plan_buckets` decides which gradient goes into which flat bucket;
* :class:`phalanx.ddp.reducer.Reducer` fills the buckets from grad-ready hooks and all-reduces each
  one as soon as it is complete, overlapping communication with the rest of the backward (or,
  after :meth:`DistributedDataParallel.shard_gradients`, reduces it to the rank that owns it:
  :mod:`phalanx.ddp.bucket_comm`);
* :class:`phalanx.ddp.buffer_sync.BufferSync` broadcasts rank 0's buffers (BatchNorm running
  statistics...) before a forward.

Argument checks, the ranks' agreement check and what ``shard_gradients`` needs of an optimizer
live in :mod:`phalanx.ddp.checks`.

A forward runs in three phases: before (move inputs to ``device_ids[0]``, broadcast buffers),
the module's own forward, after (arm the reducer for the backward that follows).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from .._logging import get_logger
from ..agreement import agree
from .bucket_comm import AllReduceMean, ReduceToOwner
from .bucketing import (
    DEFAULT_BUCKET_CAP_MB,
    FIRST_BUCKET_BYTES,
    MIB,
    BucketSpec,
    describe,
    plan_buckets,
)
from .buffer_sync import BufferSync
from .checks import (
    GradientOwners,
    agree_on_replicas,
    check_arguments,
    check_group,
    gradient_owners,
    input_device,
    verdict,
)
from .reducer import Reducer

_log0 = get_logger(__package__, rank_zero_only=True)


class DistributedDataParallel(nn.Module):
    """Data parallelism: a replica of ``module`` per process, gradients averaged in backward.

    A drop-in for :class:`torch.nn.parallel.DistributedDataParallel` (same arguments, same
    ``module.``-prefixed ``state_dict`` keys), written on c10d collectives. At construction
    every rank checks that all ranks hold the same parameters and buffers (names, shapes,
    dtypes, count) and the same settings, then takes rank 0's values. During ``backward()``
    gradients are copied into flat buckets (reverse registration order, about
    ``bucket_cap_mb`` each); each bucket's asynchronous all-reduce starts as soon as its last
    gradient is ready (the last bucket's when the backward is done: it also carries the
    ranks' error reports), buckets start in the same order on every rank, and ``backward()``
    returns only when every ``.grad`` holds the average over ranks.

    .. note::
        Gradient accumulation: inside :meth:`no_sync`, or with the public attribute
        ``require_backward_grad_sync = False`` set before the forward, backward only
        accumulates into ``.grad`` locally; the next synchronising backward averages the
        accumulated totals. The forward decides: run it inside the context. A synchronising
        forward arms the averaging for the next backward, and forwards run after it, before
        that backward (inside ``no_sync()``, under ``torch.no_grad()``), do not disarm it: one
        backward over a synchronising and a ``no_sync()`` forward averages the gradients of
        both, as torch's DDP does. With ``find_unused_parameters`` their graphs are walked too
        (torch raises when only such a later forward reaches a parameter).

    .. note::
        ``broadcast_buffers=True`` sends rank 0's buffers to every rank at the first forward
        and at the first forward after each synchronising forward (torch's schedule). Two
        forwards before one backward work: while a forward's graph waits for its backward,
        the received buffers are installed as new tensors instead of being copied into the
        old ones, which that graph may have saved (torch fails there with "modified by an
        inplace operation").

    .. note::
        ZeRO stage 2: with a :class:`~phalanx.ZeroRedundancyOptimizer` over this model,
        :meth:`shard_gradients` makes each bucket a reduce to the rank that owns its
        parameters, so after backward each rank holds only the averaged gradients it
        steps (about ``1/N`` of the gradient memory); see that method.

    .. note::
        With one process (world size 1) nothing is installed: no hooks, no copies, and the
        forward is the module's own.

    Args:
        module (nn.Module): the model, already on this process's device.
        device_ids (list, optional): ``None`` or ``[]`` for a CPU module or one that stays where
            it is; ``[local_rank]`` for a module on that single GPU: inputs are then moved
            there. A CPU module given ``device_ids`` raises ``ValueError``. Default ``None``.
        output_device (int or torch.device, optional): accepted for torch compatibility;
            must be ``None`` or ``device_ids[0]``. Outputs stay where the module puts them.
        broadcast_buffers (bool): broadcast rank 0's buffers before forwards (see note).
            Default ``True``.
        process_group (ProcessGroup, optional): the group to average over. Default ``None``
            (the world).
        bucket_cap_mb (float, optional): bucket size in MiB. Default ``None``: 25 MiB with a
            1 MiB first bucket, so the first all-reduce starts early; a number given
            explicitly caps every bucket, the first included (torch 2.13 does the same).
        find_unused_parameters (bool): after each forward, walk the autograd graph from the
            outputs (any nesting of tuples, lists, dicts, dataclasses); parameters it does
            not reach are settled at the start of backward so nothing waits for them, and
            parameters that get no gradient anywhere keep ``.grad`` untouched. Default ``False``.
        gradient_as_bucket_view (bool): make ``.grad`` a view into the bucket: no copy back,
            less memory. Works with ``zero_grad(set_to_none=True)``. Default ``False``.
        static_graph (bool): promise that the same parameters are used every iteration.
            Parameters may go unused (as with ``find_unused_parameters``), but they are
            learned once, from the first synchronising backward, instead of by a graph walk
            after every forward; from the second backward on their buckets no longer wait
            for them. A parameter learned unused that later gets a gradient raises
            ``UnusedParametersError``. Default ``False``.

    Raises:
        TypeError, ValueError: bad arguments (say which, and what was given).
        RankMismatchError: the ranks' parameters, buffers or settings differ (raised on
            every rank, naming the first difference).
        UnusedParametersError: from ``backward()``, on every rank, when a parameter got no
            gradient with ``find_unused_parameters=False``, or got one after its bucket was
            settled (e.g. ``static_graph`` learned it unused), even on one rank only (it
            names the ranks and parameters).

    .. warning::
        Every rank must run the same sequence of synchronising forwards and backwards: the
        collectives they issue must match.

    .. warning::
        Bucket all-reduces share ``process_group`` with every other collective run during
        the backward, e.g. :class:`~phalanx.SyncBatchNorm`'s. They must come in the same order
        on every rank, so with SyncBatchNorm inside, every rank must run the same graph:
        ``find_unused_parameters`` with rank-dependent branches can launch a bucket before
        SyncBatchNorm's all-reduce on one rank and after it on another (a Gloo error or a hang).
        torch's DDP has the same restriction. A separate group for the buckets would not lift
        it on NCCL (communicators used in different orders can deadlock) and ``new_group``
        would make construction a collective of the whole world, also for a subgroup.

    Example::

        >>> phalanx.init_process_group()
        >>> model = phalanx.DistributedDataParallel(Net().to(phalanx.get_device()))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> for x, y in loader:
        ...     opt.zero_grad()
        ...     loss_fn(model(x), y).backward()   # gradients averaged when this returns
        ...     opt.step()
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        broadcast_buffers: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
    ) -> None:
        super().__init__()
        check_group(process_group)
        flags = dict(broadcast_buffers=broadcast_buffers, find_unused_parameters=find_unused_parameters,
                     gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph)
        problem: Exception | None = None
        try:
            check_arguments(module, bucket_cap_mb, flags)
            self._device = input_device(module, device_ids, output_device)
        except (TypeError, ValueError) as e:
            problem = e
        # every rank learns of every rank's problem: none is left waiting
        agree_on_replicas(module, problem, bucket_cap_mb, flags, process_group)
        world = dist.get_world_size(process_group)
        self.module = module
        self.device_ids = list(device_ids) if device_ids else None
        self.output_device = output_device
        self.process_group = process_group
        self.bucket_cap_mb = bucket_cap_mb
        for name, value in flags.items():
            setattr(self, name, value)
        self.require_backward_grad_sync = True
        self._sync_buffers_next = True  # torch's schedule: the first forward broadcasts
        self._reducer: Reducer | None = None
        self._buffer_sync: BufferSync | None = None
        self.bucket_plan: list[BucketSpec] = []
        if world > 1:
            self._set_up_replicas(module, process_group, broadcast_buffers)

    def _set_up_replicas(self, module, group, broadcast_buffers) -> None:
        src = 0 if group is None else dist.get_global_rank(group, 0)
        with torch.no_grad():
            comm.broadcast_tensors(list(module.parameters()) + list(module.buffers()), src=src, group=group)
        self._build_reducer(None)
        if broadcast_buffers and any(b.numel() for b in module.buffers()):
            self._buffer_sync = BufferSync(module, group, src)

    def _build_reducer(self, owners: list[int | None] | None) -> None:
        """Plan the buckets (per owner, with ``owners``) and install a reducer for them."""
        named = list(self.module.named_parameters())
        caps = (DEFAULT_BUCKET_CAP_MB * MIB, FIRST_BUCKET_BYTES)
        if self.bucket_cap_mb is not None:
            caps = (int(self.bucket_cap_mb * MIB),) * 2
        self.bucket_plan = plan_buckets(named, *caps, owners=owners)
        if _log0.isEnabledFor(logging.DEBUG):
            _log0.debug("bucket plan, in launch order:\n%s", describe(self.bucket_plan))
        group = self.process_group
        strategy = AllReduceMean(group) if owners is None else ReduceToOwner(self.bucket_plan, group)
        if self._reducer is not None:
            self._reducer.close()  # its hooks must not act on the next backward
        self._reducer = Reducer(
            named,
            self.bucket_plan,
            strategy,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
        )

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._device is not None:
            inputs, kwargs = _to_device(inputs, self._device), _to_device(kwargs, self._device)
        if self._reducer is None:
            return self.module(*inputs, **kwargs)
        if self._buffer_sync is not None and self._sync_buffers_next:
            self._buffer_sync.sync(fresh=self._reducer.awaiting_backward)
        output = self.module(*inputs, **kwargs)
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        self._sync_buffers_next = sync
        self._reducer.prepare(sync, output)
        return output

    def shard_gradients(self, optimizer: GradientOwners) -> None:
        """ZeRO stage 2: each rank keeps only the averaged gradients its optimizer shard uses.

        The buckets are re-planned so that each holds the parameters of one owner (the rank
        whose ``optimizer`` shard updates them), and each bucket is reduced to its owner
        (``dist.reduce``) instead of all-reduced; the last bucket stays an all-reduce, since
        it carries the unused-parameter check every rank reads. Whole parameters are reduced
        to their owner: this is not a reduce-scatter of flat slices. After every
        synchronising backward, ``.grad`` holds the average on the owner and is ``None`` on
        the other ranks (released as soon as copied into its bucket, whose buffer is dropped
        at the end of the backward), so gradient memory per rank falls to about
        ``total / N`` plus the largest parameter. Parameters the optimizer does not hold
        are averaged on every rank as before; with one process nothing changes. A
        collective: call it on every rank, between iterations, after the optimizer has all
        its param groups.

        Args:
            optimizer (ZeroRedundancyOptimizer): the sharded optimizer over this model's
                parameters, on the same ranks as this DDP (any object with its
                ``process_group`` and ``owners_of()`` will do).

        Raises:
            TypeError: ``optimizer`` has no ``owners_of()``: not a sharded optimizer.
            ValueError: its process group has other ranks than this DDP's, or it holds none
                of this model's parameters.
            RuntimeError: called between a forward and its backward.
            RankMismatchError: the ranks disagree on owners or arguments (on every rank).

        .. warning::
            No rank holds the whole gradient any more: clip with the optimizer's
            :meth:`~phalanx.ZeroRedundancyOptimizer.clip_grad_norm_`, not
            ``torch.nn.utils.clip_grad_norm_``. Gradients cannot accumulate across
            synchronising backwards (non-owners hold none): accumulate micro-batches with
            :meth:`no_sync`, and ``zero_grad()`` after each ``step()``.

        Example::

            >>> ddp = phalanx.DistributedDataParallel(net, gradient_as_bucket_view=True)
            >>> opt = phalanx.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=1e-3)
            >>> ddp.shard_gradients(opt)
            >>> loss_fn(ddp(x), y).backward()    # .grad: averages for this rank's shard only
            >>> opt.clip_grad_norm_(1.0)         # the norm of the whole averaged gradient
            >>> opt.step()                       # owners step and broadcast the parameters
        """
        problem, owners = None, None
        try:
            mid_iteration = self._reducer is not None and self._reducer.awaiting_backward
            owners = gradient_owners(self.module, self.process_group, mid_iteration, optimizer)
        except (TypeError, ValueError, RuntimeError) as e:
            problem = e
        items = [verdict(problem)]
        if owners is not None:
            items += [(f"owner of {name}", owner) for (name, _), owner
                      in zip(self.module.named_parameters(), owners)]
        agree("shard_gradients() owners", self.process_group, items=items, problem=problem)
        if self._reducer is not None:
            self._build_reducer(owners)

    def gradient_bytes(self) -> int:
        """Bytes this rank holds for gradients now: ``.grad`` tensors and kept bucket buffers.

        Memory shared between them (``gradient_as_bucket_view=True``) is counted once.
        """
        tensors = [p.grad for p in self.module.parameters() if p.grad is not None]
        if self._reducer is not None:
            tensors += self._reducer.buffers()
        storages = {}
        for t in tensors:
            if t.layout == torch.strided:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            else:  # sparse: its dense size (averaged densely anyway)
                storages[id(t)] = t.numel() * t.element_size()
        return sum(storages.values())

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally for the forwards and backwards run inside.

        Example::

            >>> with ddp.no_sync():
            ...     for x in micro_batches[:-1]:
            ...         ddp(x).sum().backward()       # local accumulation only
            >>> ddp(micro_batches[-1]).sum().backward()  # averages the accumulated total
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous


def _to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with its tensors moved to ``device`` (tuples, lists, dicts, namedtuples)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_to_device(v, device) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _to_device(v, device)) for k, v in obj.items())
    return obj
