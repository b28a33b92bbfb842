"""DistributedDataParallel: one replica per process, gradients averaged during backward.

The wrapper is thin; the work is done by three objects it composes:

* :func:`phalanx.bucketing.plan_buckets` decides which gradient goes into which flat bucket;
* :class:`phalanx.reducer.Reducer` fills the buckets from grad-ready hooks and all-reduces each
  one as soon as it is complete, overlapping communication with the rest of the backward (or,
  after :meth:`DistributedDataParallel.shard_gradients`, reduces it to the rank that owns it:
  :mod:`phalanx.bucket_comm`);
* :class:`_BufferSync` broadcasts rank 0's buffers (BatchNorm running statistics...) before a
  forward.

A forward runs in three phases: before (move inputs to ``device_ids[0]``, broadcast buffers),
the module's own forward, after (arm the reducer for the backward that follows).
"""

from __future__ import annotations

from contextlib import contextmanager
from numbers import Real
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from . import comm
from .bucketing import DEFAULT_BUCKET_CAP_MB, FIRST_BUCKET_BYTES, MIB, BucketSpec, plan_buckets
from .errors import NotInitializedError
from .bucket_comm import AllReduceMean, ReduceToOwner
from .reducer import Reducer
from .zero import ZeroRedundancyOptimizer


class DistributedDataParallel(nn.Module):
    """Data parallelism: a replica of ``module`` per process, gradients averaged in backward.

    A drop-in for :class:`torch.nn.parallel.DistributedDataParallel` (same arguments, same
    ``module.``-prefixed ``state_dict`` keys), written on c10d collectives. At construction
    every rank checks that all ranks hold the same parameters and buffers (names, shapes,
    dtypes, count) and the same settings, then takes rank 0's values. During ``backward()``
    gradients are copied into flat buckets (reverse registration order, about
    ``bucket_cap_mb`` each); each bucket's asynchronous all-reduce starts as soon as its last
    gradient is ready, buckets start in the same order on every rank, and ``backward()``
    returns only when every ``.grad`` holds the average over ranks.

    .. note::
        Gradient accumulation: inside :meth:`no_sync`, or with the public attribute
        ``require_backward_grad_sync = False`` set before the forward, backward only
        accumulates into ``.grad`` locally; the next synchronising backward averages the
        accumulated totals. The forward decides: run it inside the context.

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
            gradient with ``find_unused_parameters=False`` (it names the parameters).

    .. warning::
        Every rank must run the same sequence of synchronising forwards and backwards: the
        collectives they issue must match.

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
        _check_group(process_group)
        flags = dict(broadcast_buffers=broadcast_buffers, find_unused_parameters=find_unused_parameters,
                     gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph)
        problem: Exception | None = None
        try:
            _check_arguments(module, bucket_cap_mb, flags)
            self._device = _input_device(module, device_ids, output_device)
        except (TypeError, ValueError) as e:
            problem = e
        world = dist.get_world_size(process_group)
        if world > 1:  # every rank learns of every rank's problem: none is left waiting
            _check_same_everywhere(module, problem, bucket_cap_mb, flags, process_group)
        if problem is not None:
            raise problem
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
        self._buffer_sync: _BufferSync | None = None
        self.bucket_plan: list[BucketSpec] = []
        if world > 1:
            self._set_up_replicas(module, process_group, broadcast_buffers)

    def _set_up_replicas(self, module, group, broadcast_buffers) -> None:
        src = 0 if group is None else dist.get_global_rank(group, 0)
        with torch.no_grad():
            comm.broadcast_tensors(list(module.parameters()) + list(module.buffers()), src=src, group=group)
        self._build_reducer(None)
        if broadcast_buffers and any(b.numel() for b in module.buffers()):
            self._buffer_sync = _BufferSync(module, group, src)

    def _build_reducer(self, owners: list[int | None] | None) -> None:
        """Plan the buckets (per owner, with ``owners``) and install a reducer for them."""
        named = list(self.module.named_parameters())
        caps = (DEFAULT_BUCKET_CAP_MB * MIB, FIRST_BUCKET_BYTES)
        if self.bucket_cap_mb is not None:
            caps = (int(self.bucket_cap_mb * MIB),) * 2
        self.bucket_plan = plan_buckets(named, *caps, owners=owners)
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

    def shard_gradients(self, optimizer: ZeroRedundancyOptimizer) -> None:
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
                parameters, on the same ranks as this DDP.

        Raises:
            TypeError: ``optimizer`` is not a :class:`~phalanx.ZeroRedundancyOptimizer`.
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
            owners = _gradient_owners(self, optimizer)
        except (TypeError, ValueError, RuntimeError) as e:
            problem = e
        if dist.get_world_size(self.process_group) > 1:
            refused = "accepted" if problem is None else f"refused: {problem}"
            items = [("arguments", refused)]
            if owners is not None:
                items += [(f"owner of {name}", owner) for (name, _), owner
                          in zip(self.module.named_parameters(), owners)]
            comm.check_same_across_ranks(items, "shard_gradients() owners", self.process_group)
        if problem is not None:
            raise problem
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


class _BufferSync:
    """Overwrites every rank's buffers with rank ``src``'s.

    In place normally; with ``fresh=True`` (a graph may have saved the old buffers for its
    backward) the values land in new tensors that replace the old ones in every module that
    registers them, so the saved ones keep their version and the backward still works.
    """

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None, src: int) -> None:
        self.module = module
        self.group = group
        self.src = src
        self.is_src = dist.get_rank() == src

    def sync(self, fresh: bool) -> None:
        buffers = list(self.module.buffers())
        if not fresh or self.is_src:  # rank src only reads its buffers
            comm.broadcast_tensors(buffers, src=self.src, group=self.group)
            return
        received = [torch.empty_like(b) for b in buffers]
        comm.broadcast_tensors(received, src=self.src, group=self.group)
        replace = {id(old): new for old, new in zip(buffers, received)}
        for sub in self.module.modules():
            for name, old in sub._buffers.items():
                if old is not None and id(old) in replace:
                    sub._buffers[name] = replace[id(old)]


def _gradient_owners(ddp: DistributedDataParallel, optimizer: Any) -> list[int | None]:
    """The owner of each of ``ddp.module.named_parameters()``, or a ValueError/TypeError."""
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        raise TypeError(
            "shard_gradients() needs a phalanx.ZeroRedundancyOptimizer (it says which rank owns "
            f"each parameter), got {type(optimizer).__name__}"
        )
    ours = dist.get_process_group_ranks(ddp.process_group or dist.group.WORLD)
    theirs = dist.get_process_group_ranks(optimizer.process_group or dist.group.WORLD)
    if ours != theirs:
        raise ValueError(
            "shard_gradients() needs the optimizer sharded over the ranks DDP averages over: "
            f"DDP has global ranks {ours}, the optimizer {theirs}"
        )
    if ddp._reducer is not None and ddp._reducer.awaiting_backward:
        raise RuntimeError(
            "shard_gradients() was called between a forward and its backward; call it between "
            "iterations (after backward(), or before the first forward)"
        )
    owners = optimizer.owners_of(p for _, p in ddp.module.named_parameters())
    if all(owner is None for owner in owners):
        raise ValueError(
            "shard_gradients() needs the optimizer of this model: it holds none of the "
            f"{len(owners)} parameters of this DistributedDataParallel's module"
        )
    return owners


def _check_group(group: Any) -> None:
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    if not dist.is_initialized():
        raise NotInitializedError(
            "DistributedDataParallel needs a process group: call phalanx.init_process_group() first "
            "(it runs as a single process when nothing in the environment says otherwise)"
        )


def _check_arguments(module: Any, bucket_cap_mb: Any, flags: dict[str, Any]) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if bucket_cap_mb is not None:
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, Real):
            raise TypeError(f"bucket_cap_mb must be a number of MiB or None, got {type(bucket_cap_mb).__name__}")
        if not bucket_cap_mb * MIB >= 1:  # a bucket of at least one byte; also refuses NaN
            raise ValueError(f"bucket_cap_mb must be positive (MiB per bucket), got {bucket_cap_mb}")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError(
            "DistributedDataParallel needs a module with at least one parameter that requires a "
            "gradient; this one has none (nothing to average)"
        )


def _input_device(module: nn.Module, device_ids: Any, output_device: Any) -> torch.device | None:
    """Where inputs must go: ``device_ids[0]``, or ``None`` to leave them where they are."""
    if not device_ids:
        if output_device is not None:
            raise ValueError(f"output_device={output_device!r} needs device_ids; got device_ids={device_ids!r}")
        return None
    if not isinstance(device_ids, (list, tuple)):
        raise TypeError(f"device_ids must be a list such as [local_rank], got {type(device_ids).__name__}")
    if len(device_ids) != 1:
        raise ValueError(f"device_ids must name exactly one device (this process's), got {list(device_ids)}")
    want = _as_cuda_device(device_ids[0])
    have = {t.device for t in module.parameters()} | {t.device for t in module.buffers()}
    if have != {want}:
        found = ", ".join(sorted(str(d) for d in have))
        raise ValueError(
            f"device_ids={list(device_ids)} is for a module on {want}, but the module's tensors are on "
            f"{found}. For a CPU module (or one spread over devices) leave device_ids=None; otherwise "
            f"move the module there first (module.to({str(want)!r}))"
        )
    if output_device is not None and _as_cuda_device(output_device) != want:
        raise ValueError(f"output_device must be None or device_ids[0] ({want}), got {output_device!r}")
    return want


def _as_cuda_device(device: Any) -> torch.device:
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cuda", device)
    if isinstance(device, (str, torch.device)):
        return torch.device(device)
    raise TypeError(f"a device id must be an int or a torch.device, got {type(device).__name__}")


def _check_same_everywhere(module, problem, bucket_cap_mb, flags, group) -> None:
    """One collective: every rank's argument problem, settings, parameters and buffers agree."""
    items: list[tuple[str, Any]] = [("arguments", "accepted" if problem is None else f"refused: {problem}")]
    if problem is None:
        settings = ", ".join(f"{k}={v}" for k, v in {"bucket_cap_mb": bucket_cap_mb, **flags}.items())
        items.append(("settings", settings))
        items += [(n, _describe(p) + ("" if p.requires_grad else " frozen")) for n, p in module.named_parameters()]
        items += [(f"buffer {n}", _describe(b)) for n, b in module.named_buffers()]
    comm.check_same_across_ranks(items, "DistributedDataParallel parameters, buffers and settings", group)


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)} {t.dtype}"


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
