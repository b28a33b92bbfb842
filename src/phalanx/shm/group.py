"""The process group: torch's collectives on CPU tensors over the shared segment, the rest on
the Gloo group created beneath it.

``ShmProcessGroup`` is a ``torch.distributed.ProcessGroup`` subclass (c10d does not let Python
subclass its ``Backend``). It registers its Gloo group as the group's CPU backend, so every
operation it does not override (gather, scatter, send/recv, the coalesced forms, functional
collectives...) goes to Gloo through c10d's own dispatch; an overridden operation whose
arguments it does not serve (several tensors per call, a dtype outside
:data:`~phalanx.shm.ops.DTYPES`, PREMUL_SUM, another device) is handed to Gloo explicitly.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (AllgatherOptions, AllreduceOptions, AllToAllOptions,
                                        BarrierOptions, BroadcastOptions, ReduceOptions,
                                        ReduceScatterOptions)

from . import ops
from .channel import Channel
from .segment import Segment
from .worker import ShmWork, Worker

BACKEND_NAME = "phalanx_shm"
_SUM = dist.ReduceOp.SUM
_STRIDED = torch.strided


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as one flat run of elements: a view when contiguous, else a copy."""
    return t.view(-1) if t.is_contiguous() else t.contiguous().view(-1)


def _in_turn(runs: list[Callable[[], None]]) -> Callable[[], None]:
    """One run of several collectives, one after the other (a coalesced call's)."""
    def run() -> None:
        for one in runs:
            one()
    return run


def _options(opts: Any, kind: type, timeout: Any = None, **fields: Any) -> Any:
    """``opts`` when it is already a ``kind`` (c10d's options), else a ``kind`` built from the
    other call forms' arguments: torch's ``ProcessGroup`` methods are overloaded in C++
    (``pg.allreduce(tensor)``, ``pg.allreduce([t], ReduceOp.MAX)``, ``pg.broadcast(t, root)``,
    ``pg.barrier(timeout)``...), and a Python subclass's method takes every one of those
    calls: torch's DDP join calls ``process_group.allreduce(local_used_map)``, which the
    Gloo fallback for "not one tensor" took, off shared memory and out of the peers' order."""
    if isinstance(opts, kind):
        return opts
    made = kind()
    for name, value in fields.items():
        if value is not None:
            setattr(made, name, value)
    if isinstance(opts, timedelta):
        timeout = opts
    if timeout is not None:
        made.timeout = timeout
    return made


def _tensor_list(tensors: Any) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else tensors


def _write_back(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for t, flat in pairs:
        if flat.data_ptr() != t.data_ptr() or not t.is_contiguous():
            t.copy_(flat.view(t.shape))


class ShmProcessGroup(dist.ProcessGroup):
    """A c10d process group over one host's shared memory (see :mod:`phalanx.shm`).

    Created by c10d through the registered backend ``"phalanx_shm"``; not meant to be built
    directly. Each group maps its own segment and runs its collectives on a thread of its own.

    Args:
        rank, size: this member's rank in the group, and the group's size.
        segment: the mapped segment (:func:`phalanx.shm.segment.open_segment`).
        gloo: the group's Gloo backend, for what shared memory does not serve.
        capacity: bytes of each member's staging slot.
        timeout: the longest any collective waits for the others.
    """

    def __init__(self, rank: int, size: int, segment: Segment, gloo: Any, capacity: int,
                 timeout: timedelta) -> None:
        super().__init__(rank, size)
        self._gloo = gloo
        # Gloo serves what shared memory does not, CUDA tensors among them: registered for
        # "cuda" too, so init_process_group(device_id=cuda:i) (ranks sharing a GPU) finds it.
        for device in ("cpu", "cuda"):
            self._register_backend(torch.device(device), dist.ProcessGroup.BackendType.GLOO, gloo)
        self._channel = Channel(segment, rank, size, capacity, timeout.total_seconds(),
                                ops.describe)
        self._worker = Worker(f"phalanx_shm-r{rank}")
        self._channel.worker_ident = self._worker.ident
        # Bytes a tensor may have to take the one-step path (ops.all_reduce_one...).
        self._one_step = capacity
        # The latest sparse all-reduce handed to Gloo (see _sparse_allreduce), and the lock
        # that makes each launch wait for it.
        self._sparse_lock = threading.Lock()
        self._sparse_work: Any = None

    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return BACKEND_NAME

    def _served(self, tensors: list[torch.Tensor]) -> bool:
        for t in tensors:
            if not t.is_cpu or t.layout is not _STRIDED or t.dtype not in ops.DTYPE_CODES:
                return False
        return True

    def _submit(self, run: Callable[[], None], result: list[Any], opts: Any) -> ShmWork:
        return self._worker.submit(run, result, bool(getattr(opts, "asyncOp", True)))

    def _one(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (served) takes the one-step path: contiguous, fits one slot."""
        return t.is_contiguous() and t.numel() * t.element_size() <= self._one_step

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None, op: Any = None,
                  timeout: Any = None) -> Any:
        tensors = _tensor_list(tensors)
        opts = _options(opts, AllreduceOptions, timeout,
                        reduceOp=op if op is not None else (opts if opts is not None else None))
        op = opts.reduceOp
        code = ops.SUM if op == _SUM else ops.reduce_code(op)
        if len(tensors) != 1 or code is None or not self._served(tensors):
            if any(t.layout is not _STRIDED for t in tensors):
                return self._sparse_allreduce(tensors, opts)
            return self._gloo.allreduce(tensors, opts)
        t = tensors[0]
        channel = self._channel
        if self._one(t):
            return self._worker.submit(lambda: ops.all_reduce_one(channel, t, code), tensors,
                                       opts.asyncOp)
        flat = _flat(t)

        def run() -> None:
            ops.all_reduce(self._channel, flat, code)
            _write_back([(t, flat)])
        return self._submit(run, [t], opts)

    def _sparse_allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        """Gloo's all-reduce of sparse tensors, one at a time: a launch first waits for the
        previous one to be done. torch's DDP launches one per sparse parameter as soon as its
        gradient is ready, so several ran at once on Gloo's worker threads, and with several
        in flight the heap was corrupted now and then (phalanx's own DDP waits for each:
        :mod:`phalanx.ddp.sparse`). Still asynchronous for the caller: only the launch of
        the next one waits. The last one is kept until the next (or the group's end), so the
        Gloo work and its tensors are released here, not on Gloo's thread."""
        with self._sparse_lock:
            previous = self._sparse_work
            if previous is not None and not previous.is_completed():
                try:
                    previous.wait()
                except RuntimeError:
                    pass  # its own caller sees its error; this one fails on its own if it must
            self._sparse_work = self._gloo.allreduce(tensors, opts)
            return self._sparse_work

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None, op: Any = None,
               timeout: Any = None) -> Any:
        tensors = _tensor_list(tensors)
        if not isinstance(opts, ReduceOptions):  # the form (tensor, root, op=SUM)
            opts = _options(None, ReduceOptions, timeout, rootRank=opts, reduceOp=op)
        code = ops.reduce_code(opts.reduceOp)
        if len(tensors) != 1 or code is None or not self._served(tensors):
            return self._gloo.reduce(tensors, opts)
        t, root = tensors[0], opts.rootRank
        channel = self._channel
        if self._one(t):
            return self._worker.submit(lambda: ops.all_reduce_one(channel, t, code, root),
                                       tensors, opts.asyncOp)
        flat = _flat(t)

        def run() -> None:
            ops.all_reduce(self._channel, flat, code, root)
            if self.rank() == root:
                _write_back([(t, flat)])
        return self._submit(run, [t], opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None, timeout: Any = None) -> Any:
        tensors = _tensor_list(tensors)
        if not isinstance(opts, BroadcastOptions):  # the form (tensor, root)
            opts = _options(None, BroadcastOptions, timeout, rootRank=opts, rootTensor=0)
        if len(tensors) != 1 or opts.rootTensor != 0 or not self._served(tensors):
            return self._gloo.broadcast(tensors, opts)
        t, root = tensors[0], opts.rootRank
        channel = self._channel
        if self._one(t):
            return self._worker.submit(lambda: ops.broadcast_one(channel, t, root), tensors,
                                       opts.asyncOp)
        flat = _flat(t)

        def run() -> None:
            ops.broadcast(self._channel, flat, root)
            if self.rank() != root:
                _write_back([(t, flat)])
        return self._submit(run, [t], opts)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts: Any = None) -> Any:
        if isinstance(inputs, torch.Tensor):  # the form (outputs, input, timeout=None)
            outputs, inputs = [outputs], [inputs]
        opts = _options(opts, AllgatherOptions)
        if (len(inputs) != 1 or len(outputs) != 1 or not self._served(inputs + outputs[0])
                or len(outputs[0]) != self.size()
                or any(o.numel() != inputs[0].numel() or o.dtype != inputs[0].dtype
                       for o in outputs[0])):
            return self._gloo.allgather(outputs, inputs, opts)
        return self._gather(outputs[0], inputs[0], outputs, opts)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        opts = opts if opts is not None else AllgatherOptions()
        if not self._gathers(output, input):
            return self._gloo._allgather_base(output, input, opts)
        return self._worker.submit(self._gather_run(output, input), [output], opts.asyncOp)

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> Any:
        """Several :meth:`_allgather_base` in one work (torch's functional all_gather, as
        DTensor's ``full_tensor()`` uses, comes here): on Gloo, the gather would be freed on
        Gloo's thread under its queue lock, and a tensor whose Python object C++ keeps needs
        the GIL to go, which the caller holds while it waits for that lock: a deadlock."""
        opts = opts if opts is not None else AllgatherOptions()
        if len(outputs) != len(inputs) or not all(map(self._gathers, outputs, inputs)):
            return self._on_gloo([self._gloo._allgather_base(o, i, opts)
                                  for o, i in zip(outputs, inputs)], outputs, opts)
        return self._submit(_in_turn(list(map(self._gather_run, outputs, inputs))),
                            list(outputs), opts)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def _on_gloo(self, works: list[Any], outputs: list[torch.Tensor], opts: Any) -> ShmWork:
        """One work for a coalesced call served by Gloo one collective at a time (Gloo's
        backend has no coalesced all_gather_into_tensor or reduce_scatter_tensor of its own
        in Python)."""
        def run() -> None:
            for work in works:
                work.wait()
        return self._submit(run, list(outputs), opts)

    def _gathers(self, output: torch.Tensor, input: torch.Tensor) -> bool:
        """Whether shared memory serves the all-gather of ``input`` into ``output``."""
        return (self._served([output, input]) and output.dtype == input.dtype
                and output.numel() == input.numel() * self.size() and output.is_contiguous())

    def _gather_run(self, output: torch.Tensor, input: torch.Tensor) -> Callable[[], None]:
        """The all-gather of ``input`` into the contiguous ``output`` (:meth:`_gathers`)."""
        channel = self._channel
        if input.numel() and self._one(input):
            return lambda: ops.all_gather_one(channel, output, input)
        outs = (list(output.view(-1).chunk(self.size())) if input.numel()
                else [output.view(-1)] * self.size())
        return self._gather_steps(outs, input)

    def _gather_steps(self, outs: list[torch.Tensor], t: torch.Tensor) -> Callable[[], None]:
        flat = _flat(t)
        flats = [_flat(o) for o in outs]

        def run() -> None:
            ops.all_gather(self._channel, flats, flat)
            _write_back(list(zip(outs, flats)))
        return run

    def _gather(self, outs: list[torch.Tensor], t: torch.Tensor, result: list[Any],
                opts: Any) -> ShmWork:
        return self._submit(self._gather_steps(outs, t), result, opts)

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                       opts: Any = None, op: Any = None, timeout: Any = None) -> Any:
        if isinstance(outputs, torch.Tensor):  # the form (output, inputs, op=SUM)
            outputs, inputs = [outputs], [inputs]
        opts = _options(opts, ReduceScatterOptions, timeout,
                        reduceOp=op if op is not None else (opts if opts is not None else None))
        code = ops.reduce_code(opts.reduceOp)
        if (len(outputs) != 1 or len(inputs) != 1 or code is None or len(inputs[0]) != self.size()
                or not self._served(outputs + inputs[0])
                or any(i.numel() != outputs[0].numel() or i.dtype != outputs[0].dtype
                       for i in inputs[0])):
            return self._gloo.reduce_scatter(outputs, inputs, opts)
        return self._scatter(outputs[0], [_flat(i) for i in inputs[0]], code, outputs, opts)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor,
                             opts: Any = None) -> Any:
        opts = opts if opts is not None else ReduceScatterOptions()
        code = ops.reduce_code(opts.reduceOp)
        if code is None or not self._scatters(output, input):
            return self._gloo._reduce_scatter_base(output, input, opts)
        return self._worker.submit(self._scatter_run(output, input, code), [output], opts.asyncOp)

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> Any:
        """Several :meth:`_reduce_scatter_base` in one work (torch's functional
        reduce_scatter; see :meth:`allgather_into_tensor_coalesced`)."""
        opts = opts if opts is not None else ReduceScatterOptions()
        code = ops.reduce_code(opts.reduceOp)
        if (code is None or len(outputs) != len(inputs)
                or not all(map(self._scatters, outputs, inputs))):
            return self._on_gloo([self._gloo._reduce_scatter_base(o, i, opts)
                                  for o, i in zip(outputs, inputs)], outputs, opts)
        runs = [self._scatter_run(o, i, code) for o, i in zip(outputs, inputs)]
        return self._submit(_in_turn(runs), list(outputs), opts)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def _scatters(self, output: torch.Tensor, input: torch.Tensor) -> bool:
        """Whether shared memory serves the reduce-scatter of ``input`` into ``output``."""
        return (self._served([output, input]) and output.dtype == input.dtype
                and input.numel() == output.numel() * self.size())

    def _scatter_run(self, output: torch.Tensor, input: torch.Tensor,
                     code: int) -> Callable[[], None]:
        """The reduce-scatter of ``input`` into ``output`` (:meth:`_scatters`)."""
        if (output.numel() and input.is_contiguous() and output.is_contiguous()
                and output.numel() <= self._one_step // (input.element_size() * self.size())):
            channel = self._channel
            return lambda: ops.reduce_scatter_one(channel, output, input, code)
        flat = _flat(input)
        ins = list(flat.chunk(self.size())) if flat.numel() else [flat] * self.size()
        return self._scatter_steps(output, ins, code)

    def _scatter_steps(self, out: torch.Tensor, ins: list[torch.Tensor],
                       code: int) -> Callable[[], None]:
        flat = _flat(out)

        def run() -> None:
            ops.reduce_scatter(self._channel, flat, ins, code)
            _write_back([(out, flat)])
        return run

    def _scatter(self, out: torch.Tensor, ins: list[torch.Tensor], code: int,
                 result: list[Any], opts: Any) -> ShmWork:
        return self._submit(self._scatter_steps(out, ins, code), result, opts)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: list[int], input_split_sizes: list[int],
                      opts: Any = None) -> Any:
        opts = _options(opts, AllToAllOptions)
        if not self._served([output, input]) or output.dtype != input.dtype:
            return self._gloo.alltoall_base(output, input, output_split_sizes,
                                            input_split_sizes, opts)
        sends = self._counts(input, input_split_sizes, "input")
        receives = self._counts(output, output_split_sizes, "output")
        flat, out = _flat(input), _flat(output)

        def run() -> None:
            ops.all_to_all(self._channel, out, flat, sends, receives)
            _write_back([(output, out)])
        return self._submit(run, [output], opts)

    def _counts(self, t: torch.Tensor, splits: list[int], what: str) -> list[int]:
        """Elements per member of ``t`` split along dim 0 (evenly without ``splits``)."""
        w = self.size()
        row = t[0].numel() if t.dim() and t.shape[0] else (t.numel() if t.dim() == 0 else 0)
        if not splits:
            if t.dim() == 0 or t.shape[0] % w:
                raise ValueError(f"all_to_all_single: {what} tensor's first dimension "
                                 f"({t.shape[0] if t.dim() else 'none'}) must be divisible by "
                                 f"the group's size {w} when no split sizes are given")
            return [t.numel() // w] * w
        if len(splits) != w or sum(splits) != (t.shape[0] if t.dim() else 1):
            raise ValueError(f"all_to_all_single: {what} split sizes {list(splits)} must be "
                             f"{w} numbers summing to the {what} tensor's first dimension")
        return [s * row for s in splits]

    def barrier(self, opts: Any = None) -> Any:
        opts = _options(opts, BarrierOptions)
        return self._submit(lambda: ops.barrier(self._channel), [], opts)

    def shutdown(self) -> None:
        """Finish what is queued, stop the worker and unmap the segment."""
        self._sparse_work = None
        self._worker.close()
        self._channel.close()
