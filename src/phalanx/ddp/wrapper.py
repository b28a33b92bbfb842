"""DistributedDataParallel: one replica per process, gradients averaged during backward.

The wrapper is thin: it holds the public surface and the settings; arguments are checked and
resolved by :mod:`phalanx.ddp.options`, pickling by :mod:`phalanx.ddp.pickling`, and the
per-process machinery is a :class:`~phalanx.ddp.runtime.Runtime`: the buckets
(:func:`~phalanx.ddp.bucketing.plan_buckets`), the :class:`~phalanx.ddp.reducer.Reducer` that
fills and reduces them during the backward (all-reduce, or after
:meth:`DistributedDataParallel.shard_gradients` a reduce to each bucket's owner), the
:class:`~phalanx.ddp.buffer_sync.BufferSync` that broadcasts rank 0's buffers before a forward.
A forward runs in three phases: before (inputs to ``device_ids[0]``, buffers broadcast), the
module's own, after (arm the reducer).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._C._dynamo.eval_frame import get_eval_frame_callback as _frame_hook
from torch.nn.parallel.distributed import DistributedDataParallel as TorchDDP

from ..hooks import GradBucket
from ..uneven import Join, Joinable
from .bucketing import FIRST_BUCKET_BYTES
from .checks import GradientOwners
from .compiled_autograd import compiled_autograd_enabled
from .hook_registration import builtin_hook
from .logging_data import STATIC_GRAPH_AGAIN, STATIC_GRAPH_FINDS_UNUSED, construction_data
from .options import NOTHING_IGNORED, TORCH_ONLY_ATTRIBUTES, check_group, resolve_arguments
from .pickling import picklable_state, unpickled_state
from .runtime import Runtime


class DistributedDataParallel(nn.Module, Joinable):
    """Data parallelism: a replica of ``module`` per process, gradients averaged in backward.

    A drop-in for :class:`torch.nn.parallel.DistributedDataParallel` (torch 2.13's arguments,
    same ``module.``-prefixed ``state_dict`` keys), written on c10d collectives. At construction
    every rank checks that all ranks hold the same parameters and buffers (names, shapes,
    dtypes, count) and the same settings, then takes rank 0's values. During ``backward()``
    gradients are copied into flat buckets (reverse registration order, about
    ``bucket_cap_mb`` each); each bucket's asynchronous all-reduce starts as soon as its last
    gradient is ready (the last bucket's when the backward is done: it also carries the
    ranks' error reports), buckets start in the same order on every rank, and ``backward()``
    returns only when every ``.grad`` holds the average over ranks. docs/torch_surface_ddp.md
    lists what of torch's DDP is supported, different, refused or coming.

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
        Buffers: rank 0's go to every rank at construction and at the first forward and the
        first forward after each synchronising forward (torch's schedule). Two forwards
        before one backward work: while a forward's graph waits for its backward, the
        received buffers are installed as new tensors instead of being copied into the old
        ones, which that graph may have saved (torch fails there with "modified by an
        inplace operation").

    .. note::
        As in torch: sparse gradients (``nn.Embedding(sparse=True)``...) are averaged as
        sparse tensors and stay sparse (:mod:`phalanx.ddp.sparse`); ``create_graph=True``
        averages the first-order gradients, with a warning (:mod:`phalanx.ddp.unusual`);
        ``torch.save``/``pickle``/``deepcopy`` work, loading into the default group of the
        loading process, without a collective (:mod:`phalanx.ddp.pickling`).

    .. note::
        ZeRO stage 2: with a :class:`~phalanx.ZeroRedundancyOptimizer` over this model,
        :meth:`shard_gradients` makes each bucket a reduce to the rank that owns its
        parameters, so after backward each rank holds only the averaged gradients it
        steps (about ``1/N`` of the gradient memory); see that method.

    .. note::
        Compiled autograd: with ``torch._dynamo.config.optimize_ddp = "python_reducer"`` (as
        torch's DDP requires), a forward with compiled autograd enabled arms one functional
        all-reduce per gradient, which compiled autograd captures and inductor buckets, instead
        of the buckets above (:mod:`phalanx.ddp.compiled_autograd` says what it refuses).

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
        dim (int): torch's dimension to scatter inputs along: unused, as inputs are never
            split with one device per process (in torch 2.13 either). Default ``0``.
        broadcast_buffers (bool, optional): ``False`` keeps buffers out of the construction
            broadcast and the forwards'. Deprecated by torch 2.13 for
            ``forward_sync_buffers`` (phalanx does not warn). Default ``None`` (``True``).
        init_sync (bool): ``False``: no collective at construction, neither the agreement
            check nor the broadcast (the replicas must be equal already; argument errors
            raise on their rank only). The same on every rank. Default ``True``.
        process_group (ProcessGroup, optional): the group to average over. Default ``None``
            (the world).
        bucket_cap_mb (float, optional): bucket size in MiB. Default ``None``: 25 MiB with a
            1 MiB first bucket, so the first all-reduce starts early; a number given
            explicitly caps every bucket, the first included (torch 2.13 does the same).
        find_unused_parameters (bool): after each forward, walk the autograd graph from the
            outputs (any nesting of tuples, lists, dicts, dataclasses); parameters it does
            not reach are settled at the start of backward so nothing waits for them, and
            parameters that get no gradient anywhere keep ``.grad`` untouched. Default ``False``.
        check_reduction: deprecated by torch; ignored, with torch's ``FutureWarning`` if true.
        gradient_as_bucket_view (bool): make ``.grad`` a view into the bucket: no copy back,
            one copy of the gradients instead of two. Works with both ``zero_grad`` modes.
            Default ``True`` (torch: ``False``; measured 3-4% faster on the 10.5M MLP); pass
            ``False`` for ``.grad`` tensors of their own (``p.grad.detach_()`` needs them).
        static_graph (bool): promise that the same parameters are used every iteration.
            Parameters may go unused (as with ``find_unused_parameters``), but they are
            learned once, from the first synchronising backward, instead of by a graph walk
            after every forward; from the second backward on their buckets no longer wait
            for them. A parameter learned unused that later gets a gradient raises
            ``UnusedParametersError``. Default ``False``.
        delay_all_reduce_named_params, param_to_hook_all_reduce: refused with ``ValueError``
            unless ``None`` (:mod:`phalanx.ddp.options` says why).
        mixed_precision (_MixedPrecision, optional): torch's
            ``torch.nn.parallel.distributed._MixedPrecision(param_dtype, reduce_dtype,
            buffer_dtype)``: forward and backward in ``param_dtype`` around fp32 master
            parameters (what the optimizer and ``state_dict`` see), gradients averaged in
            ``reduce_dtype`` (default ``param_dtype``) and written back in the masters' dtype,
            floating-point buffers cast to ``buffer_dtype`` (:mod:`phalanx.ddp.mixed_precision`).
            Default ``None``.
        device_mesh (DeviceMesh, optional): a 1-D mesh to average over, instead of
            ``process_group``. Default ``None``.
        skip_all_reduce_unused_params (bool): accepted; buckets are reduced anyway (the
            results are the same). Default ``False``.
        bucket_cap_mb_list (list of float, optional): each bucket's cap in MiB, in launch
            order, the last for the rest; overrides ``bucket_cap_mb``. Default ``None``.
        batched_grad_copy (bool): accepted; no effect (each gradient already takes one
            fused divide-and-copy). Default ``False``.
        forward_sync_buffers (bool, optional): broadcast rank 0's buffers before forwards
            (see the note), not at construction. Default ``None``: ``broadcast_buffers``.

    Raises:
        TypeError, ValueError: bad arguments (say which, and what was given).
        UsageError: what torch raises ``RuntimeError`` for (no trainable parameter, a lazy
            module, ``process_group`` with ``device_mesh``...); a ``ValueError`` too.
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

    .. warning::
        torch's DDP + RPC recipe (``torch.distributed.autograd.backward()``) is refused: a
        forward in a distributed autograd context raises ``UsageError`` (its gradients would
        bypass the averaging: :func:`~phalanx.ddp.checks.refuse_distributed_autograd`).

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
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = True,
        static_graph: bool = False,
        delay_all_reduce_named_params: Any = None,
        param_to_hook_all_reduce: Any = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: Sequence[float] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
    ) -> None:
        super().__init__()
        flags = dict(find_unused_parameters=find_unused_parameters, gradient_as_bucket_view=gradient_as_bucket_view,
                     static_graph=static_graph, init_sync=init_sync,
                     skip_all_reduce_unused_params=skip_all_reduce_unused_params, batched_grad_copy=batched_grad_copy)
        torch_only = dict(delay_all_reduce_named_params=delay_all_reduce_named_params, device_mesh=device_mesh,
                          param_to_hook_all_reduce=param_to_hook_all_reduce, mixed_precision=mixed_precision)
        args = resolve_arguments(module, process_group, device_mesh, device_ids, output_device, dim,
                                 (broadcast_buffers, forward_sync_buffers), (bucket_cap_mb, bucket_cap_mb_list),
                                 check_reduction, flags, torch_only)
        self._device, self._caps = args.device, args.caps
        self.module = module
        self.device_ids = args.device_ids
        self.output_device = output_device
        self.dim = dim
        self.process_group = args.group
        self.device_mesh = device_mesh
        self.bucket_cap_mb = bucket_cap_mb
        self.bucket_cap_mb_list = bucket_cap_mb_list
        # torch's name, read by Dynamo's DDPOptimizer to split a compiled graph into buckets;
        # never below its first-bucket cap (1 MiB), which it asserts
        self.bucket_bytes_cap = max(*self._caps, FIRST_BUCKET_BYTES)
        self.forward_sync_buffers = args.forward_sync_buffers
        self.mixed_precision = mixed_precision
        for name, value in flags.items():
            setattr(self, name, value)
        self.require_backward_grad_sync = True
        self._set_up()
        if self._runtime.reducer is not None and init_sync:
            self._runtime.broadcast_state(args.init_sync_buffers)

    def _set_up(self) -> None:
        """The runtime: hooks, buckets and buffer sync (none with one process); no collective."""
        self._runtime = Runtime(self.module, self.process_group, self._device, self._caps,
                                bucket_cap_mb=self.bucket_cap_mb, mixed_precision=self.mixed_precision,
                                find_unused_parameters=self.find_unused_parameters,
                                gradient_as_bucket_view=self.gradient_as_bucket_view, static_graph=self.static_graph)
        self.bucket_plan = self._runtime.bucket_plan
        self._construction_data = construction_data(
            self.module, self.process_group, self._device, (self.bucket_cap_mb, self.bucket_cap_mb_list),
            dict(broadcast_buffers=self.forward_sync_buffers, find_unused_parameters=self.find_unused_parameters,
                 gradient_as_bucket_view=self.gradient_as_bucket_view))

    @property
    def forward(self) -> Callable[..., Any]:
        """The forward (called as ``ddp(*inputs, **kwargs)``): the eager one, or with compiled
        autograd enabled the traceable one of :mod:`phalanx.ddp.compiled_autograd`. Chosen by
        attribute lookup, before Dynamo picks up a frame: under ``torch.compile(ddp)`` the eager
        one is skipped as a whole (no graph break), and a compiled training step inlines the
        traceable one (no graph break either)."""
        if self._runtime.reducer is not None and compiled_autograd_enabled():
            return self._compiled_autograd_forward
        return self._eager_forward

    # Under torch.compile, Dynamo runs this frame and the two around the module as they are
    # (checks, collectives and hooks stay eager: no graph break, no recompile) and compiles the
    # module's frames underneath, as it does with torch's DDP.forward.
    @torch.compiler.disable(recursive=False)
    def _eager_forward(self, *inputs: Any, **kwargs: Any) -> Any:
        runtime = self._runtime
        if runtime.reducer is None:
            inputs, kwargs, _ = runtime.before_forward(inputs, kwargs, self.require_backward_grad_sync,
                                                       self.forward_sync_buffers)
            return runtime.precision.after_forward(self.module(*inputs, **kwargs))
        # Dynamo's frame hook set (torch.compile around): the phases as calls it skips; else the
        # same functions called as they are (a skipped call costs a tiny model's step more than
        # the work inside it)
        eager = _frame_hook() is None
        inputs, kwargs, sync = (runtime.before_forward_eager if eager else runtime.before_forward)(
            inputs, kwargs, self.require_backward_grad_sync, self.forward_sync_buffers)
        # this DDP is the one whose buckets Dynamo's DDPOptimizer splits a compiled graph at while
        # its module runs (torch's own hook, DistributedDataParallel._get_active_ddp_module(),
        # which torch's DDP sets the same way), so that each bucket's gradients are ready, and
        # its all-reduce launched, while the rest of the compiled backward still runs
        previous, TorchDDP._active_ddp_module = TorchDDP._active_ddp_module, self
        try:
            output = runtime.module(*inputs, **kwargs)  # self.module (found without __getattr__)
        finally:
            TorchDDP._active_ddp_module = previous
        return (runtime.after_forward_eager if eager else runtime.after_forward)(output, sync)

    def _compiled_autograd_forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """The forward under compiled autograd: :meth:`Runtime.compiled_autograd_forward`."""
        return self._runtime.compiled_autograd_forward(inputs, kwargs, self.require_backward_grad_sync,
                                                       self.forward_sync_buffers)

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Context manager for uneven inputs across ranks: torch's ``DistributedDataParallel.join``.

        ``with model.join(): <training loop>``: a rank that runs out of batches leaves the block
        and shadows the others' steps until every rank has (:mod:`phalanx.uneven`; to include a
        ZeroRedundancyOptimizer, a Checkpointer or a PreemptionHandler, use
        ``phalanx.join(model, optimizer, ...)``).

        Args:
            divide_by_initial_world_size (bool): average over the initial world size even when
                some ranks have joined (their contribution is zero), as torch; ``False``: over
                the ranks still active. Default ``True``.
            enable (bool): ``False`` does nothing (inputs must be even). Default ``True``.
            throw_on_early_termination (bool): raise on every rank as soon as one runs out,
                naming it. Default ``False``.
        """
        return Join([self], enable=enable, throw_on_early_termination=throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    # phalanx.join (ddp/joining.py)
    def join_begin(self, join: Join) -> None:
        self._runtime.join.begin(join.joinables.index(self), join.divide_by_initial_world_size,
                                 any(j.join_steps_with_gradients for j in join.joinables), self._runtime.reducer)

    def join_shadow(self, action: int, verdict: Any) -> None:
        self._runtime.join.shadow(action, verdict, self._runtime.reducer, self._runtime.buffer_sync)

    def join_end(self, join: Join, last: int) -> None:
        self._runtime.join.end(self.module, self.forward_sync_buffers, last)

    def join_leave(self) -> None:
        self._runtime.join.leave(self._runtime.reducer)
        self._runtime.check.restart()  # the ranks stepped different numbers of times

    @property
    def broadcast_buffers(self) -> bool:
        """torch 2.13's deprecated name of :attr:`forward_sync_buffers`."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    def will_sync_module_buffers(self) -> bool:
        """Whether synchronising forwards broadcast rank 0's buffers (torch's meaning: with
        ``forward_sync_buffers`` and a module that has buffers)."""
        return bool(self.forward_sync_buffers) and any(True for _ in self.module.buffers())

    def __getstate__(self) -> dict[str, Any]:
        return picklable_state(self.__dict__, self.process_group, self.device_mesh)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(unpickled_state(state))
        check_group(self.process_group)
        self._set_up()  # without shard_gradients' owners: its optimizer is not in the pickle

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in TORCH_ONLY_ATTRIBUTES:
                raise AttributeError(f"phalanx's DistributedDataParallel has no {name!r}: "
                                     f"{TORCH_ONLY_ATTRIBUTES[name]}") from None
            raise

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
            UsageError: called between a forward and its backward (a ``RuntimeError`` too).
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
        self._runtime.shard_gradients(optimizer)
        self.bucket_plan = self._runtime.bucket_plan

    def register_comm_hook(self, state: Any, hook: Callable[[Any, GradBucket], torch.futures.Future]) -> None:
        """Reduce each bucket with ``hook(state, bucket)`` (torch's contract) instead of the all-reduce.

        The contract is in :mod:`phalanx.hooks`; where phalanx differs from torch, in
        :mod:`phalanx.ddp.hook_comm`: torch's hooks work unchanged (PowerSGD also with several
        buckets on Gloo, bf16 also without NCCL); :mod:`phalanx.comm_hooks` has phalanx's. Call
        it on every rank, once, before the first forward (torch's documentation: before the
        first backward), and again after unpickling. With sparse gradients the hook reduces the dense buckets; the sparse
        gradients are averaged as without a hook.

        Raises:
            TypeError: ``hook`` is not callable (torch's words), or cannot be called as
                ``hook(state, bucket)``.
            ValueError: its annotations are not torch's (:mod:`phalanx.ddp.hook_registration`).
            UsageError: registered already (torch's words), after a forward, or with
                :meth:`shard_gradients`. From the backward: the hook returned no future.

        Example::

            >>> ddp.register_comm_hook(None, phalanx.comm_hooks.bf16_compress_hook)
        """
        self._register(state, hook, builtin=False)

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        """torch's built-in hook ``dist.BuiltinCommHookType.ALLREDUCE`` or ``FP16_COMPRESS``,
        as its Python twin in torch's ``default_hooks`` (the same gradients), over this DDP's
        group; the rules of :meth:`register_comm_hook`."""
        self._register(self.process_group, builtin_hook(comm_hook_type), builtin=True, name=str(comm_hook_type))

    def _register(self, state: Any, hook: Any, builtin: bool, name: str | None = None) -> None:
        with self._runtime.log.errors():
            self._runtime.register_comm_hook(state, hook, builtin)
        self._runtime.log.comm_hook = name or getattr(hook, "__qualname__", type(hook).__qualname__)
        self.bucket_plan = self._runtime.bucket_plan

    def _get_ddp_logging_data(self) -> dict[str, int | str]:
        """torch's logging data: settings, bucket sizes, the iteration count, the last error.

        The keys for which phalanx has torch's fact, in torch's types (``int`` or ``str``);
        :mod:`phalanx.ddp.logging_data` says what each means and docs/ddp.md which of torch's
        keys are left out (the timings among them: phalanx measures nothing while training).

        Example::

            >>> ddp._get_ddp_logging_data()["bucket_sizes"]   # bytes per bucket, in launch order
            '1049600, 4198400'
        """
        return {**self._construction_data, **self._runtime.logging_data()}

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """Sample every ``sample_rate``-th iteration after the first 10 (torch's default 100):
        which iteration the logging data's ``iteration`` (and the keys read at it) reports.

        Raises:
            ValueError: ``sample_rate`` below 1 (torch's words).
        """
        with self._runtime.log.errors():
            self._runtime.log.set_rate(sample_rate)

    def _set_static_graph(self) -> None:
        """``static_graph=True`` after construction (torch's private way): call it before the
        first synchronising forward; a second call only warns, in torch's words.

        Raises:
            UsageError: a synchronising forward ran already (torch's ``RuntimeError`` and words).
        """
        if self.static_graph:
            warnings.warn(STATIC_GRAPH_AGAIN, stacklevel=2)
            return
        with self._runtime.log.errors():
            self._runtime.set_static_graph()
        self.static_graph = True
        if self.find_unused_parameters:
            warnings.warn(STATIC_GRAPH_FINDS_UNUSED, stacklevel=2)

    def gradient_bytes(self) -> int:
        """Bytes this rank holds for gradients now: ``.grad`` tensors and kept bucket buffers.

        Memory shared between them (``gradient_as_bucket_view=True``) is counted once.
        """
        return self._runtime.gradient_bytes()

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, params_and_buffers_to_ignore: Any) -> None:
        """torch's way to keep parameters and buffers out of DDP: refused (``ValueError``)."""
        raise ValueError(f"_set_params_and_buffers_to_ignore_for_model is torch's: {NOTHING_IGNORED}")

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


# torch's helpers that unwrap a DDP (torch.distributed.checkpoint.state_dict's keys without
# "module.", a script's `model.module if isinstance(model, DDP) else model`) test isinstance
# against torch's class. It is an ABC (torch's Joinable), so phalanx's registers as a virtual
# subclass: a state dict's keys and a script's checks are the same after the import swap.
TorchDDP.register(DistributedDataParallel)
