"""What a DistributedDataParallel runs on each process, around its module.

:class:`Runtime` holds the per-process machinery of one DDP, everything that is rebuilt
after unpickling (:mod:`phalanx.ddp.pickling`) rather than stored: the bucket plan and the
:class:`~phalanx.ddp.reducer.Reducer` installed for it (rebuilt by ``shard_gradients`` and
``register_comm_hook``), the :class:`~phalanx.ddp.buffer_sync.BufferSync`, the step check,
the DDP's part in a join, the mixed-precision swap; and the phases of a forward run around the
module: before (inputs to ``device_ids[0]``, the step's sync point, buffers broadcast), after
(arm the reducer), and the traceable forward of :mod:`phalanx.ddp.compiled_autograd`. The
wrapper keeps the public surface and the settings a user may change between forwards
(``require_backward_grad_sync``, ``forward_sync_buffers``), which it passes in.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from .. import comm
from .._logging import get_logger
from ..diagnostics import ledger
from ..errors import UsageError
from ..ledger.log import call_site, describe_tensors
from .bucket_comm import AllReduceMean, ReduceToOwner
from .bucketing import BucketSpec, describe, plan_buckets
from .buffer_sync import BUFFERS, BufferSync
from .checkin import CHECK, EVALUATION, StepCheck
from .checks import GradientOwners, agree_on_owners, refuse_distributed_autograd, rpc_agent_set
from .compiled_autograd import (PYTHON_REDUCER, TRACED_REDUCTION, boundary_key, enable_inductor_bucketing,
                                optimize_ddp_mode, refusal, step_boundary)
from .devices import to_device
from .hook_comm import HookComm
from .hook_registration import SHARDED_WITH_HOOK, check_registration
from .joining import JoinPart
from .logging_data import STATIC_GRAPH_TOO_LATE, DDPLog, runtime_data
from .mixed_precision import precision_for
from .reducer import Reducer, tensor_bytes
from .sparse import sparse_positions

_log0 = get_logger(__package__, rank_zero_only=True)


class Runtime:
    """One DistributedDataParallel's machinery on this process (see the module notes).

    With one process (world size 1) there is no reducer and no buffer sync: a forward only
    moves and casts its inputs. No collective at construction.

    Args:
        module: the wrapped module.
        group: the process group (``None``: the world).
        device: where inputs go (``device_ids[0]``), or ``None``.
        caps: the bucket caps in bytes, in launch order (:mod:`phalanx.ddp.options`).
        bucket_cap_mb: the DDP's ``bucket_cap_mb``, handed to inductor's DDP fusion.
        mixed_precision: torch's ``_MixedPrecision``, or ``None``.
        find_unused_parameters, gradient_as_bucket_view, static_graph: the DDP's settings.
    """

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None, device: torch.device | None,
                 caps: Any, *, bucket_cap_mb: float | None, mixed_precision: Any, find_unused_parameters: bool,
                 gradient_as_bucket_view: bool, static_graph: bool) -> None:
        self.module, self.group, self.device, self.caps = module, group, device, caps
        self.mixed_precision = mixed_precision
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.sync_buffers_next = True  # torch's schedule: the first forward broadcasts
        self.forwarded = False  # a forward ran: too late to register a comm hook
        self.comm_hook: tuple[Any, Any] | None = None  # (state, hook) of register_comm_hook
        self.reducer: Reducer | None = None
        self.buffer_sync: BufferSync | None = None
        self.bucket_plan: list[BucketSpec] = []
        self.sparse_names: list[str] = []
        self.owners: list[int | None] | None = None  # shard_gradients' owner of each parameter
        self.log = DDPLog()  # what _get_ddp_logging_data() needs besides the settings
        self.check = StepCheck(group)
        self.join = JoinPart(group)  # its place in a running phalanx.join
        self.precision = precision_for(module, mixed_precision)
        self.casts = mixed_precision is not None  # else precision's phases do nothing: not called
        if dist.get_world_size(group) == 1:
            return
        self.build_reducer(None)
        # under compiled autograd a compiled graph records its collectives (compiled_boundary)
        self.ledgered, self.key = ledger().enabled, boundary_key(self)
        self.described = {BUFFERS: describe_tensors(module.buffers()),
                          TRACED_REDUCTION: describe_tensors(self.reducer.params)}
        if optimize_ddp_mode() == PYTHON_REDUCER:  # as torch's DDP, at construction
            enable_inductor_bucketing(bucket_cap_mb)
        if any(b.numel() for b in module.buffers()):
            self.buffer_sync = BufferSync(module, group, rank_zero(group))

    def broadcast_state(self, with_buffers: bool) -> None:
        """Rank 0's parameters (and buffers, ``with_buffers``) to every rank: a collective."""
        tensors = list(self.module.parameters()) + (list(self.module.buffers()) if with_buffers else [])
        with torch.no_grad(), ledger().collective("DDP initial broadcast", tensors, self.group):
            comm.broadcast_tensors(tensors, src=rank_zero(self.group), group=self.group)

    def build_reducer(self, owners: list[int | None] | None) -> None:
        """Plan the buckets (per owner, with ``owners``) and install a reducer for them."""
        self.owners = owners
        named = list(self.module.named_parameters())
        sparse = sparse_positions(self.module, named)
        self.bucket_plan = plan_buckets(named, owners=owners, caps=self.caps, skip=sparse,
                                        reduce_dtype=self.precision.reduce_dtype)
        if not self.bucket_plan:  # only sparse parameters: a bucket for the control tail alone
            self.bucket_plan = [BucketSpec(named[sparse[0]][1].device, torch.float32, ())]
        if _log0.isEnabledFor(logging.DEBUG):
            _log0.debug("bucket plan, in launch order:\n%s", describe(self.bucket_plan))
        group = self.group
        if self.comm_hook is not None:
            strategy = HookComm(self.bucket_plan, named, *self.comm_hook, group)
        else:
            strategy = AllReduceMean(group) if owners is None else ReduceToOwner(self.bucket_plan, group)
        if self.reducer is not None:
            self.reducer.close()  # its hooks must not act on the next backward
        self.reducer = Reducer(
            named,
            self.bucket_plan,
            strategy,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
            sparse_params=[named[i] for i in sparse],
        )
        self.reducer.on_backward_done = self.backward_done
        self.reducer.on_problem = self.log.record
        self.reducer.join_index = self.join.index  # rebuilt inside a join: still in it
        self.sparse_names = [named[i][0] for i in sparse]

    def shard_gradients(self, optimizer: GradientOwners) -> None:
        """``DistributedDataParallel.shard_gradients``: agree on the owners, re-plan per owner."""
        if self.comm_hook is not None:
            raise UsageError(f"shard_gradients() after register_comm_hook(): {SHARDED_WITH_HOOK}")
        mid_iteration = self.reducer is not None and self.reducer.awaiting_backward
        owners = agree_on_owners(self.module, self.group, mid_iteration, optimizer)
        if self.reducer is not None:
            self.build_reducer(owners)

    def register_comm_hook(self, state: Any, hook: Any, builtin: bool) -> None:
        """``DistributedDataParallel.register_comm_hook``'s checks, then buckets reduced by ``hook``."""
        sharded = self.reducer is not None and isinstance(self.reducer.bucket_comm, ReduceToOwner)
        check_registration(hook, self.comm_hook, self.forwarded, sharded, builtin)
        self.comm_hook = (state, hook)
        if self.reducer is not None:
            self.build_reducer(None)

    def set_static_graph(self) -> None:
        """``DistributedDataParallel._set_static_graph``: the reducer rebuilt with ``static_graph``,
        before the first synchronising forward (torch's rule; no collective)."""
        if self.log.sync_forwards:
            raise UsageError(f"{STATIC_GRAPH_TOO_LATE} This DistributedDataParallel ran {self.log.sync_forwards} "
                             "synchronising forward(s) already: pass static_graph=True to the constructor, "
                             "or call _set_static_graph() before training")
        self.static_graph = True
        if self.reducer is not None:
            self.build_reducer(self.owners)

    def logging_data(self) -> dict[str, int | str]:
        """The keys of the DDP's logging data that change after construction
        (:func:`~phalanx.ddp.logging_data.runtime_data`)."""
        unused = None if self.reducer is None else self.reducer.unused_params()
        return runtime_data(self.log, self.bucket_plan, unused, self.static_graph)

    def gradient_bytes(self) -> int:
        """Bytes of the ``.grad`` tensors and kept bucket buffers, shared memory counted once."""
        tensors = [p.grad for p in self.module.parameters() if p.grad is not None]
        return tensor_bytes(tensors + (self.reducer.buffers() if self.reducer is not None else []))

    def before_forward_eager(self, inputs: Any, kwargs: Any, require_sync: bool,
                             sync_buffers: bool, rides: bool = True) -> tuple[Any, Any, bool]:
        """Inputs to the device; with a reducer: the step's sync point (riding the bucket where
        ``rides`` and the reducer can carry it), the buffer broadcast; returns whether this
        forward's backward averages. Eager: called where Dynamo does not trace (see
        :meth:`before_forward`)."""
        if self.device is not None:
            inputs, kwargs = to_device(inputs, self.device), to_device(kwargs, self.device)
        if self.casts:
            inputs, kwargs = self.precision.before_forward(inputs, kwargs)
        self.forwarded = True
        sync = torch.is_grad_enabled() and require_sync
        self.log.sync_forwards += sync  # torch's DDP iteration count
        if self.reducer is None:
            return inputs, kwargs, sync
        if rpc_agent_set():  # (the test of refuse_distributed_autograd, inline: every step asks)
            refuse_distributed_autograd()
        broadcasts = self.sync_buffers_next and sync_buffers and self.buffer_sync is not None
        verdict = self.check.forward(sync, broadcasts, self.join.index, self.reducer.ride if rides else "")
        # while ranks have joined (a verdict): this step's divisor and whose buffers count
        src = None if verdict is None else self.join.step_settings(verdict, self.reducer)
        if broadcasts:
            self.buffer_sync.sync(fresh=self.reducer.awaiting_backward, src=src,
                                  shadow=self.join.buffers_shadow(src))
        return inputs, kwargs, sync

    before_forward = torch.compiler.disable(before_forward_eager)

    def after_forward_eager(self, output: Any, sync: bool) -> Any:
        """Arm the reducer after a forward (eager, as :meth:`before_forward_eager`)."""
        self.sync_buffers_next = sync
        self.reducer.traced.armed = False  # this backward is the reducer's
        self.reducer.prepare(sync, output)
        return self.precision.after_forward(output) if self.casts else output

    after_forward = torch.compiler.disable(after_forward_eager)

    def compiled_autograd_forward(self, inputs: Any, kwargs: Any, require_sync: bool, sync_buffers: bool) -> Any:
        """The forward under compiled autograd (:mod:`phalanx.ddp.compiled_autograd`): traceable,
        it arms the per-parameter functional all-reduces instead of the reducer."""
        settings = dict(find_unused_parameters=self.find_unused_parameters, static_graph=self.static_graph,
                        mixed_precision=self.mixed_precision is not None, comm_hook=self.comm_hook is not None,
                        shard_gradients=isinstance(self.reducer.bucket_comm, ReduceToOwner))
        why = refusal(optimize_ddp_mode(), settings, self.sparse_names, self.join.index is not None)
        if why is not None:
            raise UsageError(why)
        if torch.compiler.is_compiling():  # the graph records the step at its boundary
            self.forwarded = True
            sync = torch.is_grad_enabled() and require_sync
            broadcasts = self.sync_buffers_next and sync_buffers and self.buffer_sync is not None
            checked = self.ledgered and (sync or broadcasts)
            what = CHECK if torch.is_grad_enabled() else EVALUATION
            if checked:
                step_boundary(self.reducer.params[0], self.key, False, what, sync, broadcasts)
            if self.device is not None:
                inputs, kwargs = to_device(inputs, self.device), to_device(kwargs, self.device)
            if broadcasts:
                with torch.no_grad():
                    self.reducer.traced.broadcast_buffers(list(self.module.buffers()))
            output = self.module(*inputs, **kwargs)
            if checked:
                leaves = (t for t in tree_leaves(output) if isinstance(t, torch.Tensor))
                step_boundary(next(leaves, self.reducer.params[0]), self.key, True, what, sync, broadcasts)
        else:  # compiled autograd around an eager forward: the eager checks and broadcast
            inputs, kwargs, sync = self.before_forward(inputs, kwargs, require_sync, sync_buffers,
                                                       rides=False)  # the traced reduction follows
            if sync and self.ledgered:
                self.record_traced_reduction(call_site(2))
            output = self.module(*inputs, **kwargs)
        self.sync_buffers_next = sync
        self.reducer.traced.armed = sync
        return output

    def compiled_boundary(self, at_end: bool, what: str, sync: bool, broadcasts: bool) -> None:
        """A compiled forward's graph at its start and end (:func:`step_boundary`): start the
        step's sync point (waited for at once before a buffer broadcast); at the end, wait for
        it (a mismatch raises before the backward graph's all-reduces, which cannot wait for it)
        and record what the graph issues this step. No step clock: the graph's waits are not seen."""
        book = ledger()
        if not at_end:
            book.sync_point(f"{what} (compiled)", self.group, site=call_site(1), wait=broadcasts)
            return
        book.settle()
        site = call_site(1)
        if broadcasts:
            book.collective(f"{BUFFERS} (compiled)", group=self.group, site=site,
                            described=self.described[BUFFERS]).end()
        if sync:
            self.record_traced_reduction(site)

    def record_traced_reduction(self, site: str) -> None:
        """Record the per-parameter all-reduces a compiled autograd backward issues, as one."""
        ledger().collective(TRACED_REDUCTION, group=self.group, site=site,
                            described=self.described[TRACED_REDUCTION]).end()

    def backward_done(self) -> None:
        """The reducer's end of a synchronising backward: the step clock, the masters back."""
        self.check.backward_done()
        if self.casts:
            self.precision.restore()


def rank_zero(group: dist.ProcessGroup | None) -> int:
    """The global rank of ``group``'s rank 0, whose parameters and buffers everyone takes."""
    return 0 if group is None else dist.get_global_rank(group, 0)
