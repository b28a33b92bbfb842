"""What the units under one root share through an iteration: the order they ran forward in
(for prefetching), the end-of-backward callback, the reduce-scatters in flight.

**Prefetch** (torch's FSDP2 defaults, and its explicit lists): a unit's all-gather is started
one unit early, so that it travels while the current unit computes. In the forward, after a
unit has its parameters, it starts the gather of the unit that began its forward next in the
previous iteration; in the backward, after a unit has its parameters, it starts the gather
of the unit whose forward finished before its own (the next one backward).
``set_modules_to_forward_prefetch`` and ``set_modules_to_backward_prefetch`` replace these
choices for one unit.
"""

from __future__ import annotations

from enum import Enum, auto
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..comm import LastWorks
from .collectives import Pending, all_reduce
from .compile import eager_hook
from .params import Params, Slot

if TYPE_CHECKING:
    from .unit import Unit


class Stage(Enum):
    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()


def division(dtype: torch.dtype, world: int) -> tuple[Any, float | None, float | None]:
    """(reduce op, divisor before, divisor after), as torch's FSDP averages a gradient
    (``_get_gradient_divide_factors``): ``AVG`` for fp32 and bf16; for other dtypes a sum of
    gradients divided first by a power of two near sqrt(world), against overflow, then by
    the rest."""
    if dtype in (torch.float32, torch.bfloat16):
        return dist.ReduceOp.AVG, None, None
    pre = 1
    while world % pre == 0 and world / pre > pre:
        pre *= 2
    return dist.ReduceOp.SUM, pre, world / pre


class Reduction:
    """One unit's reduce-scatter in flight and where its result goes: ``output`` is laid out
    like the shards of ``slots`` (their offsets count in it), then one flag per slot (above
    zero: some rank had its gradient). HSDP (``replicate``: the replicas' group, the reduce
    op, the unit's name): once the reduce-scatter has landed, ``output`` is reduced across the
    replicas with one all-reduce, as torch's ``foreach_reduce``."""

    def __init__(self, pending: Pending, output: torch.Tensor, slots: list[Slot],
                 post_divide: float | Callable[[], float] | None, params: Params,
                 replicate: tuple[Any, Any, str] | None = None) -> None:
        self.pending, self.output, self.slots = pending, output, slots
        self.post_divide, self.params = post_divide, params
        self._replicate = replicate
        self._all_reduce: Pending | None = None

    @property
    def replicated(self) -> bool:
        """HSDP: an all-reduce across the replicas follows the reduce-scatter."""
        return self._replicate is not None

    def start_all_reduce(self) -> None:
        """HSDP: wait for the reduce-scatter and start the all-reduce across the replicas
        (once; nothing without replicas)."""
        if self._replicate is None or self._all_reduce is not None:
            return
        self.pending.wait()
        group, op, unit = self._replicate
        self._all_reduce = all_reduce(self.output, op, group, unit)

    def finish(self) -> None:
        """Land the reduced shards in ``.grad`` (offloaded: copies to the host, asynchronous
        from an accelerator into pinned memory: :func:`synchronize_offload` before use)."""
        self.pending.wait()
        self.start_all_reduce()
        if self._all_reduce is not None:
            self._all_reduce.wait()
        # a join dividing by the ranks still active: known once the collective's sync point is
        divide = self.post_divide() if callable(self.post_divide) else self.post_divide
        with torch.no_grad():
            if divide not in (None, 1):
                self.output.div_(divide)
            used = self.output[-len(self.slots):].tolist()
            for s, flag in zip(self.slots, used):
                if flag <= 0:
                    continue  # no rank had a gradient for it: .grad stays as it is (torch's)
                accumulate = s.sharded.grad is not None
                grad = self.params.grad_shard(s.shard_of(self.output).to(s.sharded.dtype), accumulate)
                if not accumulate:  # the parameter's own spec (its shape, stride, dtype and
                    # placements), as torch's _from_local_no_grad: DTensor.from_local builds a
                    # new one, 19 us against 2 us per gradient (measured, torch 2.13 CPU)
                    s.sharded.grad = DTensor(grad, s.sharded._spec, requires_grad=False)
                else:
                    s.sharded.grad.to_local().add_(grad)


class Iteration:
    """The shared state of the units under one root (see the module notes)."""

    def __init__(self, units: list[Unit]) -> None:
        self.units = units
        self.reductions: list[Reduction] = []  # in flight: the last unit's (HSDP: two units')
        self._pinned: set[torch.device] = set()  # devices copying reduced gradients to pinned memory
        self.callback_queued = False
        self.started: list[Unit] = []  # this iteration's units, as their forwards began
        self.previous: list[Unit] = []  # the last iteration's
        self.finished: list[Unit] = []  # this iteration's units, as their forwards ended
        self._backward: list[Unit] | None = None  # of those, the ones still to go backward
        # the last collective waited for, dropped by this thread, not Gloo's (comm.LastWorks);
        # one only: a finished work may keep its buffers, a unit's size
        self.last = LastWorks()

    # ---- prefetch -------------------------------------------------------------------------
    def begin(self) -> None:
        """The root's forward begins: a new iteration."""
        if self.started:
            self.previous = self.started
        self.started, self.finished = [], []

    def forward_next(self, unit: Unit) -> list[Unit]:
        """``unit`` began its forward: the unit to prefetch (the one that began after it in
        the previous iteration, if it is the one at this place in it)."""
        self.started.append(unit)
        at = len(self.started) - 1
        if at + 1 < len(self.previous) and self.previous[at] is unit:
            return [self.previous[at + 1]]
        return []

    def backward_next(self, unit: Unit) -> list[Unit]:
        """``unit`` begins its backward: the unit to prefetch (the one whose forward ended
        before ``unit``'s, last use first)."""
        if self._backward is None:
            self._backward = list(self.finished)
        for i in range(len(self._backward) - 1, -1, -1):
            if self._backward[i] is unit:
                del self._backward[i]
                return self._backward[i - 1:i] if i else []
        return []

    # ---- reduce-scatters ------------------------------------------------------------------
    def add(self, reduction: Reduction) -> None:
        """A unit's reduce-scatter has started: the ones before it land in ``.grad`` now, so
        that one unit's buffers travel at a time, not every unit's until the end of the
        backward (torch's FSDP2 waits for the previous reduce-scatter when the next starts).
        HSDP: the previous one's all-reduce across the replicas starts instead, and lands at
        the next unit's."""
        keep = [r for r in self.reductions[-1:] if r.replicated]
        self._land(self.reductions[:len(self.reductions) - len(keep)])
        for r in keep:
            r.start_all_reduce()
        self.reductions = keep + [reduction]

    def _land(self, reductions: list[Reduction]) -> None:
        for r in reductions:
            r.finish()
            if r.params.pinned:
                self._pinned.add(r.params.device)
        if reductions:
            self.last.hold(reductions[-1])

    # ---- the end of the backward ----------------------------------------------------------
    def queue_end_of_backward(self) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(eager_hook(self.end_of_backward))

    def end_of_backward(self) -> None:
        """Units whose backward began but did not finish (parameters without gradients;
        the root, whose inputs need none) finish; every reduce-scatter lands in ``.grad``.
        A unit this backward did not reach keeps its reduce-scatter for the backward that
        does (torch's chunked loss: the head's backward on each chunk, then the trunk's), and
        is resharded as torch's (unless ``reshard_after_backward`` is off)."""
        self.callback_queued = False
        self._backward = None
        for unit in reversed(self.units):
            if unit.stage is not Stage.POST_BACKWARD:
                if unit.backward_began():
                    unit.post_backward()
                elif unit.reshard_after_backward:
                    unit.reshard()
            unit.wait_for_unshard()  # a prefetch its backward did not use lands now, not stale later
            unit.stage = Stage.IDLE
            unit.to_run.clear()  # (modules of a unit called on their own after the root's forward)
        reductions, self.reductions = self.reductions, []
        self._land(reductions)
        devices, self._pinned = self._pinned, set()
        synchronize_offload(devices)


def synchronize_offload(devices: set[torch.device]) -> None:
    """Wait for the asynchronous copies of reduced gradients into pinned host memory from
    ``devices`` (the optimizer reads them next on the CPU), as torch's ``finalize_backward``
    waits for its ``grad_offload_event``: the copies run on the device's current stream."""
    for device in devices:
        torch.accelerator.current_stream(device).synchronize()
