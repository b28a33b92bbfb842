"""The reducer's side of ``register_comm_hook``: :class:`HookComm`, the
:class:`~phalanx.ddp.bucket_comm.BucketComm` that calls a communication hook on each bucket.

The hook writer's contract (``hook(state, bucket) -> Future``, :class:`~phalanx.hooks.GradBucket`,
phased hooks) is :mod:`phalanx.hooks`. :class:`HookComm` builds each bucket's
:class:`~phalanx.hooks.GradBucket` (this rank's gradients, undivided: the hook averages) and
calls the hook; the reducer waits for every future at the end of the backward and
:meth:`HookComm.write` puts the values back into the buckets, whence ``.grad``.

**The control tail.** The last bucket also carries the reducer's unused-parameter counts,
which must be summed exactly: with a hook they go in a small all-reduce of their own, issued
just before the last bucket's hook, and the hook sees the gradients only.

**Order of collectives.** Every rank must issue the same collectives in the same order. A
hook that issues all of its collectives while it is called (torch's ``allreduce_hook``,
``fp16_compress_hook``, ``bf16_compress_hook``) runs freely, overlapping the backward. A hook
that issues more from its future's callbacks (torch's PowerSGD) breaks that order on Gloo:
there a callback runs on a Gloo thread as soon as the previous collective completes, so
bucket k's second all-reduce races bucket k+1's first one issued by the main thread (on
NCCL the callbacks run at once, in the caller: the order holds). That is why torch's
PowerSGD hook fails on Gloo with several buckets ("Received data size doesn't match expected
size"). phalanx runs such hooks one bucket at a time: bucket k's hook is called once bucket
k-1's future is done. Any hook not known to issue everything at call time is treated so.

**Phased hooks** (:class:`~phalanx.hooks.PhasedHook`, phalanx's own: :mod:`phalanx.comm_hooks`)
keep the overlap and the order: a hook written as a generator that yields each collective's work
handle is resumed by the reducer's thread at fixed points only: an *eager* one (PowerSGD:
several collectives, each needing the last one's result) before each later bucket is
launched, when every unfinished eager hook advances by one phase (waiting for its pending
collective); any phased hook at the end of the backward, which finishes them in bucket
order. Where a phase ends therefore depends on the bucket sequence alone, the same on every
rank. A hook with one collective (the 16-bit ones) is not eager: nothing waits for its
all-reduce before the end of the backward, so the next buckets' all-reduces go out behind it
while the backward goes on. Each bucket index has a dict the hook may keep things in from
one backward to the next (:func:`~phalanx.hooks.bucket_memory`).

**Diagnostics** (:mod:`phalanx.diagnostics`): each bucket is one record of the collective log,
``DDP bucket k via <hook>``, from its launch to the end of its hook's work; the hook's own
collectives are not recorded one by one. A hook's collective that hangs or loses a peer
raises the hang report for its bucket, as the plain all-reduce does.

**Uneven inputs** (:mod:`phalanx.uneven`): a rank that has joined runs the hook on a bucket of
zeros for every bucket the others announce, as torch's join does; the hook divides as it
always does (torch's and phalanx's hooks: by the group's size, whatever
``divide_by_initial_world_size`` says, as in torch). Inside a join every rank runs each
bucket's hook to its end before the next bucket is announced, so that the hooks' collectives
come in the same order on the joined ranks and the active ones (the hooks then no longer
overlap the backward).

**Sparse gradients** (``nn.Embedding(sparse=True)``...) are in no bucket: the hook reduces
the dense buckets, and the sparse gradients are averaged as without a hook
(:mod:`phalanx.ddp.sparse`); torch hands them to the hook as buckets of their own, which
most hooks cannot reduce. A model whose gradients are all sparse never calls the hook.

**A hook that returns no future** raises :class:`~phalanx.errors.UsageError` (a
``ValueError`` and, as torch's, a ``RuntimeError``) from the backward, in torch's words.
What registration refuses is :mod:`phalanx.ddp.hook_registration`. With one process no
reducer exists and the hook never runs. A pickled DDP comes back without its hook.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..errors import UsageError
from ..hooks import GradBucket, PhasedHook, Running
from .bucketing import BucketSpec

# torch's words (its C++ reducer's, after pybind's) for a hook that returns no future.
NOT_A_FUTURE = "DDP communication hook's callback must return a torch.futures.Future object, but got"
# How much of a value a message quotes.
_QUOTED_CHARS = 60

# torch's hooks that issue their only collective while called (their callbacks only cast).
_CALL_TIME_HOOKS = {("torch.distributed.algorithms.ddp_comm_hooks.default_hooks", name)
                    for name in ("allreduce_hook", "fp16_compress_hook", "bf16_compress_hook")}


class HookWork:
    """The reducer's handle on one hooked bucket: :meth:`wait` leaves the average in its buffer
    (waiting again does nothing)."""

    __slots__ = ("_comm", "_b", "_grads", "_tail", "_done", "future", "running")

    def __init__(self, comm: HookComm, b: int, grads: torch.Tensor, tail: dist.Work | None) -> None:
        self._comm, self._b, self._grads, self._tail = comm, b, grads, tail
        self._done = False
        self.future: torch.futures.Future | None = None
        self.running: Running | None = None

    def wait(self) -> bool:
        if self._done:
            return True
        if self._tail is not None:
            self._tail.wait()
        if self.running is not None:
            self._comm.finish(self.running)
            result = self.running.result
        else:
            result = self.future.wait()
        self._comm.write(self._b, self._grads, result)
        self._done = True
        return True


class HookComm:
    """Bucket communication through a communication hook (see the module notes).

    Args:
        plan: the buckets, in launch order.
        named_params: the ``(name, parameter)`` pairs ``plan`` indexes into.
        state: passed to the hook as its first argument.
        hook: ``hook(state, bucket) -> Future``, or a :class:`~phalanx.hooks.PhasedHook`.
        group: process group of the DDP; ``None`` is the default group.
    """

    divides_itself = True  # the hook averages, by the group's size, also in a join (as torch's)
    runs_to_end_in_join = True  # the module notes: uneven inputs

    def __init__(self, plan: Sequence[BucketSpec], named_params: Sequence[tuple[str, torch.Tensor]],
                 state: Any, hook: Callable, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.divisor = 1  # the buffer holds this rank's gradients as they are: the hook averages
        self._state, self._hook = state, hook
        # how the collective log names each bucket's collectives (the same on every rank)
        self.label = f" via {hook_label(hook)}"
        self._phases = hook.phases if isinstance(hook, PhasedHook) else None
        self._eager = hook.eager if isinstance(hook, PhasedHook) else True
        self._serial = self._phases is None and not is_call_time_hook(hook)
        self._numels = [spec.numel for spec in plan]
        self._slots = [[(s.offset, s.shape) for s in spec.slots] for spec in plan]
        self._params = [[named_params[s.index][1] for s in spec.slots] for spec in plan]
        self._running: deque[Running] = deque()  # phased hooks not finished, in bucket order
        self._memories: list[dict] = [{} for _ in plan]  # bucket_memory()
        self._previous: torch.futures.Future | None = None  # serial hooks: the last future

    def keeps(self, b: int) -> bool:
        return True

    def launch(self, b: int, flat: torch.Tensor) -> HookWork:
        n = self._numels[b]
        last = b == len(self._numels) - 1
        if self._eager:
            for running in list(self._running):  # every earlier eager hook: one phase further
                self._advance(running)
        if self._serial and self._previous is not None:
            self._previous.wait()  # its callbacks have issued all of its collectives
        tail = dist.all_reduce(flat[n:], group=self.group, async_op=True) if last else None
        grads = flat[:n]
        work = HookWork(self, b, grads, tail)
        if n == 0:  # only sparse gradients (averaged apart): the bucket holds the control tail alone
            work.future = torch.futures.Future()
            work.future.set_result(grads)
            return work
        views = [grads[offset : offset + shape.numel()].view(shape) for offset, shape in self._slots[b]]
        bucket = GradBucket(b, grads, views, list(self._params[b]), last, self._memories[b])
        if self._phases is not None:
            work.running = Running(self._phases(self._state, bucket))
            if not work.running.done:
                self._running.append(work.running)
            return work
        work.future = self._previous = self._hook(self._state, bucket)
        if not isinstance(work.future, torch._C.Future):  # torch.futures.Future and then()'s
            got = type(work.future)
            raise UsageError(f"{NOT_A_FUTURE} {got.__module__}.{got.__qualname__}: the communication hook "
                             f"{hook_name(self._hook)} returned {_short(work.future)} for bucket {b}")
        return work

    def _advance(self, running: Running) -> None:
        running.advance()
        if running.done:
            self._running.remove(running)

    def finish(self, running: Running) -> None:
        """Run ``running`` and every phased hook launched before it to their ends, in order."""
        while not running.done:
            self._advance(self._running[0])

    def write(self, b: int, grads: torch.Tensor, result: Any) -> None:
        """Put the hook's ``result`` (the averaged bucket) into the bucket's buffer."""
        if isinstance(result, (list, tuple)) and len(result) == 1:
            result = result[0]  # torch accepts a future of a one-tensor list too
        if not isinstance(result, torch.Tensor) or result.numel() != grads.numel():
            got = (f"a tensor of {result.numel()} elements" if isinstance(result, torch.Tensor)
                   else type(result).__name__)
            raise ValueError(f"the communication hook {hook_name(self._hook)} must return a future of "
                             f"one tensor with the bucket's {grads.numel()} elements (bucket {b}), got {got}")
        if result.data_ptr() != grads.data_ptr() or result.dtype != grads.dtype:
            grads.copy_(result.reshape(-1))


def is_call_time_hook(hook: Any) -> bool:
    """Whether ``hook`` is known to issue all of its collectives while it is called."""
    return (getattr(hook, "__module__", None), getattr(hook, "__name__", None)) in _CALL_TIME_HOOKS


def hook_label(hook: Any) -> str:
    """The hook's name, the same in every process (no address, unlike some reprs)."""
    return getattr(hook, "__qualname__", None) or getattr(hook, "__name__", None) or type(hook).__name__


def hook_name(hook: Any) -> str:
    """The hook's name for a message: its qualified name, or its repr."""
    return getattr(hook, "__qualname__", None) or repr(hook)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _QUOTED_CHARS else text[:_QUOTED_CHARS] + "..."
