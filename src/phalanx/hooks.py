"""The communication-hook writer's contract: :class:`GradBucket`, phased hooks and their runner.

A communication hook is called as ``hook(state, bucket)`` once per bucket and backward and
returns a ``torch.futures.Future`` whose value is the bucket's averaged flat buffer (torch's
``register_comm_hook`` contract). ``bucket`` is a :class:`GradBucket`, with the methods of
``torch.distributed.GradBucket``; its buffer holds this rank's gradients *undivided*: the
hook does the averaging.

**Phased hooks** (:class:`PhasedHook`, phalanx's own) are written as generators that yield
the work handle of each collective they issue and return the averaged buffer. Whoever runs
them decides when each phase runs: phalanx's DDP resumes them at fixed points of the
backward, so that several collectives per bucket keep the same order on every rank and
still overlap the backward (:mod:`phalanx.ddp.hook_comm`); :func:`run_phases` runs one to
its end; :class:`Running` is one under way. :func:`bucket_memory` is the dict a bucket
keeps from one backward to the next, for a hook's own use.

**Why this module stands alone.** Three parts build on it and none on the others for it:
``ddp/`` (the reducer's adapter, :mod:`phalanx.ddp.hook_comm`, which calls the hooks),
``comm_hooks/`` (the compression hooks, written as phases) and ``model_averaging/`` (local
SGD and DiLoCo, whose meetings run the same phases outside any DDP). It holds no DDP and
imports nothing of phalanx, so the hooks and the model averagers depend on the contract
only, not on the reducer, as torch keeps ``GradBucket`` in ``torch.distributed`` and its
hooks in ``ddp_comm_hooks/``, apart from ``DistributedDataParallel``. In ``comm_hooks/``
it would make ``ddp/`` import the package of hooks built on top of it.
"""

from __future__ import annotations

from typing import Any, Callable, Generator

import torch

Phases = Generator[Any, None, torch.Tensor]


class GradBucket:
    """One bucket as a communication hook sees it: ``torch.distributed.GradBucket``'s methods.

    Args:
        index: the bucket's position in launch order (0 first).
        buffer: its flat gradients (this rank's, undivided), without the control tail.
        gradients: one view of ``buffer`` per parameter, shaped like the parameter.
        parameters: the parameters, in the order of ``gradients``.
        last: whether it is the last bucket of the backward.
        memory: the dict :func:`bucket_memory` returns for it. Default ``None``.
    """

    __slots__ = ("_index", "_buffer", "_gradients", "_parameters", "_last", "_memory")

    def __init__(self, index: int, buffer: torch.Tensor, gradients: list[torch.Tensor],
                 parameters: list[torch.Tensor], last: bool, memory: dict | None = None) -> None:
        self._index, self._buffer, self._gradients = index, buffer, gradients
        self._parameters, self._last, self._memory = parameters, last, memory

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._gradients

    def parameters(self) -> list[torch.Tensor]:
        return self._parameters

    def is_last(self) -> bool:
        return self._last

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace what :meth:`buffer` returns (torch's compress wrappers cast it)."""
        self._buffer = buffer

    def __repr__(self) -> str:
        return f"GradBucket(index={self._index}, numel={self._buffer.numel()}, last={self._last})"


def bucket_memory(bucket: Any) -> dict | None:
    """The dict phalanx's DDP keeps for ``bucket``'s index from one backward to the next, for
    a hook's own use (the same on every rank as long as the hook keeps it so); ``None`` for a
    bucket of torch's DDP."""
    return bucket._memory if isinstance(bucket, GradBucket) else None


class PhasedHook:
    """A communication hook written as phases, which phalanx's reducer runs in a fixed order.

    ``phases(state, bucket)`` is a generator: it issues a collective asynchronously, yields
    its work handle (``dist.Work`` or anything with ``wait()``), is resumed once that is
    done, and finally returns the bucket's averaged buffer. On phalanx's DDP the phases
    advance at fixed points of the backward (:mod:`phalanx.ddp.hook_comm`), so several
    collectives per bucket keep the same order on every rank and still overlap the
    backward. Called as a plain hook (e.g. registered on torch's DDP), it runs all phases at
    once and returns a completed future.

    Args:
        phases: the generator function ``phases(state, bucket)``.
        name: the hook's name, for messages. Default: the function's name.
        eager: resume it before each later bucket's launch (default ``True``: a hook whose
            collectives follow one another); ``False``: only at the end of the backward (a
            hook whose last collective is issued at the call, unless something went wrong).

    Example::

        >>> @PhasedHook
        ... def mean_hook(group, bucket):
        ...     flat = bucket.buffer().div_(dist.get_world_size(group))
        ...     yield dist.all_reduce(flat, group=group, async_op=True)
        ...     return flat
        >>> ddp.register_comm_hook(None, mean_hook)
    """

    def __init__(self, phases: Callable[[Any, Any], Phases], name: str | None = None, eager: bool = True) -> None:
        self.phases, self.eager = phases, eager
        self.__name__ = self.__qualname__ = name or getattr(phases, "__name__", "phased_hook")
        self.__doc__ = getattr(phases, "__doc__", None)

    def __call__(self, state, bucket):  # unannotated: torch's DDP checks the annotations it finds
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(run_phases(self.phases(state, bucket)))
        return future

    def __repr__(self) -> str:
        return f"PhasedHook({self.__name__})"


class Running:
    """A phased hook under way: its generator and the work it waits for."""

    __slots__ = ("_phases", "_work", "done", "result")

    def __init__(self, phases: Phases) -> None:
        self._phases = phases
        self.done = False
        self.result: Any = None
        self._work: Any = None
        self._resume()

    def _resume(self) -> None:
        try:
            self._work = next(self._phases)
        except StopIteration as end:
            self.done, self.result, self._work = True, end.value, None

    def advance(self) -> None:
        """Wait for the pending collective and run the next phase."""
        self._work.wait()
        self._resume()


def run_phases(phases: Phases) -> Any:
    """Run a phased hook's (or any such generator's) phases one after the other, waiting for
    each collective; return its result."""
    running = Running(phases)
    while not running.done:
        running.advance()
    return running.result
