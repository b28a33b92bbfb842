"""Uneven inputs: ranks that run out of batches *join*, and shadow what the others still do.

``with phalanx.join(model, optimizer, ...):`` (or torch's spelling, ``with model.join():``) around
a training loop lets ranks have different numbers of batches. A rank whose loop ends leaves the
block and *joins*: until every rank has joined it takes part in every collective the others
still issue, with a neutral contribution, so nobody waits for it and nothing aborts.

How a joined rank knows what to shadow: while a join is running, every collective phalanx
issues on a rank that still has inputs (DDP's buckets and buffer broadcast, SyncBatchNorm's
statistics, ZeRO's step, a checkpoint, a preemption check, the script's own
``phalanx.all_reduce``...) is preceded by a sync point that *announces* it (see
:mod:`phalanx.diagnostics.syncpoint`). A joined rank takes part in each of these points with
zeros, learns from the sums which ranks are still active and what they announced, and acts:

* a generic collective: the op's neutral element (zeros for a sum), or it receives;
* a DDP bucket: zeros for its gradients (the others divide by the initial world size, or with
  ``divide_by_initial_world_size=False`` by the ranks still active); its own ``.grad`` is left
  alone, as in torch, unless a ZeroRedundancyOptimizer in the join steps with the average;
* DDP's buffer broadcast: it receives the buffers of the highest active rank (torch's rule:
  rank 0 may have joined with stale buffers);
* SyncBatchNorm: zeros and a count of 0, so the statistics of the active ranks stay exact;
* ZeRO's step: it steps the shard it owns with the averaged gradients and broadcasts it;
* a ``fully_shard`` model's all-gathers and reduce-scatters: its real shards, and zeros; it
  steps the join's optimizer on its shards when the others step (:mod:`phalanx.fsdp.joining`);
* a checkpoint: it takes part in the save (the highest active rank writes: its model is current);
* a preemption check: its own signals count; the others' ``exit()`` ends it with their status.

When every rank has joined, each DDP takes the parameters and buffers of the last rank to join
(the highest of them), as torch's join does. ``throw_on_early_termination=True`` instead makes
every rank raise at the first point where some rank has joined, naming it. Ranks must keep their
collectives to phalanx's while a join runs: a bare ``torch.distributed`` call is not announced.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Iterable

import torch
import torch.distributed as dist

from .comm import all_gather_tensor
from .diagnostics import ledger
from .errors import EarlyTerminationError, UsageError, ranks_text
from .ledger import Ledger, syncpoint
from .ledger.syncpoint import Verdict

# torch.distributed.ReduceOp names -> the neutral element a joined rank contributes.
_NEUTRAL = {"SUM": 0, "AVG": 0, "PREMUL_SUM": 0, "BOR": 0, "BXOR": 0, "PRODUCT": 1, "BAND": -1}


class Joinable(ABC):
    """What takes part in :class:`Join`: an object whose collectives a rank that has joined
    shadows (modelled on ``torch.distributed.algorithms.Joinable``).

    Each joinable announces its collectives through the ledger with
    ``ledger.shadow(self, action, *args)`` (an action of its own ``IntEnum``); a rank that has
    joined receives each announcement in :meth:`join_shadow`.
    """

    # An optimizer that steps on a rank that has joined, with the averaged gradients of the
    # active ranks (ZeRO: the shard it owns): a DDP in the join writes them into its .grad.
    join_steps_with_gradients = False

    @abstractmethod
    def join_shadow(self, action: int, verdict: Verdict) -> None:
        """On a rank that has joined: take part in ``action`` (announced by an active rank,
        its arguments in ``verdict.announce[3:]``)."""

    def join_begin(self, join: Join) -> None:
        """The join starts (every rank, before its loop)."""

    def join_end(self, join: Join, last: int) -> None:
        """Every rank has joined; ``last``: the rank whose state counts."""

    def join_leave(self) -> None:
        """The join is over (also after an error)."""

    def join_flags(self) -> tuple[int, int] | None:
        """A joined rank's own signals for the others' preemption checks; ``None``: none."""
        return None


class JoinState:
    """The running join, as the ledger sees it (its :class:`~phalanx.ledger.JoinView`)."""

    def __init__(self, joinables: list[Joinable], throw: bool, world: int) -> None:
        self.joinables = joinables
        self.throw = throw
        self.world = world
        self.active: tuple[int, ...] = tuple(range(world))  # at the last sync point
        self.joined = False  # this rank ran out of inputs

    def seen(self, verdict: Any) -> None:
        """A sync point's verdict: the ranks still active (while some are)."""
        if verdict.count:
            self.active = verdict.ranks
            if self.throw and verdict.count < self.world:
                raise early_termination(verdict.ranks, self.world, self.joined)

    def index(self, obj: Any) -> int | None:
        return next((i for i, j in enumerate(self.joinables) if j is obj), None)

    def authoritative(self) -> int:
        """The rank whose state counts while ranks have joined: the highest still active."""
        return max(self.active)


class Join:
    r"""Context manager for training with uneven inputs: see the module notes.

    A drop-in for ``torch.distributed.algorithms.Join`` over phalanx's joinables:
    :class:`~phalanx.DistributedDataParallel`, a ``fully_shard`` root module,
    :class:`~phalanx.ZeroRedundancyOptimizer`,
    :class:`~phalanx.Checkpointer` and :class:`~phalanx.PreemptionHandler` (each a
    :class:`Joinable`). SyncBatchNorm
    layers and ``phalanx.all_reduce`` & co. need no registration.

    Args:
        joinables (list): the objects that shadow their own collectives, the same kinds in the
            same order on every rank. Plain ``torch.optim`` optimizers may be listed: a rank
            that has joined does not step them (as with torch's join), unless they step a
            ``fully_shard`` model in the join.
        enable (bool): ``False`` makes the context do nothing (inputs must then be even).
            Default ``True``.
        throw_on_early_termination (bool): raise :class:`EarlyTerminationError` on every rank
            as soon as one rank runs out of inputs, instead of shadowing. Default ``False``.
        **kwargs: ``divide_by_initial_world_size`` (bool, default ``True``) for the DDPs in
            ``joinables``, as in torch.

    .. warning::
        Needs phalanx's ledger (on by default, on any process group, whoever made it; off with
        ``init_process_group(diagnostics=False)``): the announcements are its sync points.
        Every collective issued while ranks have joined must go through phalanx.

    Example::

        >>> with phalanx.Join([model, optimizer]):
        ...     for x, y in loader:            # uneven numbers of batches per rank
        ...         optimizer.zero_grad()
        ...         loss_fn(model(x), y).backward()
        ...         optimizer.step()
    """

    def __init__(self, joinables: Iterable[Any], enable: bool = True,
                 throw_on_early_termination: bool = False, **kwargs: Any) -> None:
        # A plain torch optimizer is no joinable: a rank that has joined does not step it (as
        # with torch's join), unless it steps a fully_shard model in the join (whose joinable
        # steps it: the rank holds shards nobody else updates); accepted so that
        # join(model, optimizer) reads naturally.
        joinables = list(joinables)
        self.joinables = [j for j in joinables
                          if isinstance(j, Joinable) or not isinstance(j, torch.optim.Optimizer)]
        self.optimizers = [j for j in joinables
                           if isinstance(j, torch.optim.Optimizer) and not isinstance(j, Joinable)]
        if not self.joinables:
            raise ValueError("Join needs at least one joinable (a DistributedDataParallel, ...), got none")
        unknown = [type(j).__name__ for j in self.joinables if not isinstance(j, Joinable)]
        if unknown:
            raise TypeError(f"Join takes phalanx's DistributedDataParallel, fully_shard modules, "
                            "ZeroRedundancyOptimizer, Checkpointer and PreemptionHandler, got "
                            f"{', '.join(unknown)}")
        self.enable = enable
        self.throw = throw_on_early_termination
        self.divide_by_initial_world_size = kwargs.pop("divide_by_initial_world_size", True)
        if kwargs:
            raise TypeError(f"Join got unexpected keyword arguments {sorted(kwargs)}")
        self._ledger: Ledger | None = None

    def __enter__(self) -> Join:
        if not self.enable or not dist.is_initialized() or dist.get_world_size() == 1:
            return self
        book = ledger()
        if not book.enabled:
            raise UsageError("Join needs phalanx's ledger of collectives, which "
                             "init_process_group(diagnostics=False) turned off: its sync points "
                             "announce what joined ranks shadow. Leave diagnostics on (the default)")
        kinds = ", ".join(type(j).__name__ for j in self.joinables)
        book.sync_point(f"Join([{kinds}])")  # every rank enters with the same joinables
        try:
            for joinable in self.joinables:
                joinable.join_begin(self)
        except BaseException:  # a refusal: nothing stays in the join
            for joinable in self.joinables:
                joinable.join_leave()
            raise
        self._ledger = book
        book.join = JoinState(self.joinables, self.throw, dist.get_world_size())
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        book = self._ledger
        if book is None:
            return
        try:
            if exc_type is None:  # out of inputs: shadow the others until everyone is
                last = _shadow_until_all_joined(book)
                for joinable in self.joinables:
                    joinable.join_end(self, last)
        finally:
            book.join = None
            self._ledger = None
            for joinable in self.joinables:
                joinable.join_leave()
            book.log(None).checked()  # joined and active ranks issued different histories


def join(*joinables: Any, **kwargs: Any) -> Join:
    """``phalanx.join(model, optimizer, ...)``: :class:`Join` over ``joinables``."""
    return Join(joinables, **kwargs)


def _shadow_until_all_joined(book: Ledger) -> int:
    """This rank has joined: take part in every announced collective until no rank is active;
    return the rank whose state counts at the end (the highest of the last to join)."""
    state = book.join
    state.joined = True
    last = state.authoritative()
    while True:
        verdict = book.probe(None, flags=_flags(state))  # raises for throw_on_early_termination
        if verdict.count == 0:
            return last
        last = max(verdict.ranks)
        kind, *args = verdict.announce
        if kind == syncpoint.JOINABLE:
            state.joinables[args[0]].join_shadow(args[1], verdict)
        else:
            _shadow(kind, args, verdict)


def early_termination(active: Iterable[int], world: int, joined_here: bool) -> EarlyTerminationError:
    """torch's words first (its join says the first on a rank that ran out, the second on the
    others), then which ranks ran out and which had inputs left."""
    active = set(active)
    joined = [r for r in range(world) if r not in active]
    torch_words = (f"Rank {dist.get_rank()} exhausted all inputs. " if joined_here else
                   "Detected at least one rank that exhausted inputs. Throwing across all ranks. ")
    return EarlyTerminationError(
        f"{torch_words}{ranks_text(joined).capitalize()} ran out of inputs before the others "
        f"(throw_on_early_termination=True); {ranks_text(sorted(active))} still "
        "had some. Give every rank as many batches, or let the ranks join (the default)")


def _flags(state: JoinState) -> tuple[int, int]:
    """A joined rank's own signals, for the preemption checks of the others."""
    for joinable in state.joinables:
        flags = joinable.join_flags()
        if flags is not None:
            return flags
    return (0, 0)


def _shadow(kind: int, args: list[int], verdict: Any) -> None:
    """A joined rank's part in a collective announced in generic terms."""
    if kind == syncpoint.ALL_REDUCE:
        dtype, numel, op = syncpoint.DTYPES[args[0]], args[1], syncpoint.REDUCE_OPS[args[2]]
        dist.all_reduce(_neutral(dtype, numel, op), op=getattr(dist.ReduceOp, op))
    elif kind == syncpoint.BROADCAST:
        dist.broadcast(torch.empty(args[1], dtype=syncpoint.DTYPES[args[0]]), src=args[2])
    elif kind == syncpoint.ALL_GATHER_INTO_TENSOR:
        mine = torch.zeros(args[1], dtype=syncpoint.DTYPES[args[0]])
        all_gather_tensor(mine.new_empty(args[1] * dist.get_world_size()), mine)
    elif kind == syncpoint.ALL_GATHER_OBJECT:
        dist.all_gather_object([None] * dist.get_world_size(), None)
    elif kind == syncpoint.BROADCAST_OBJECT:
        dist.broadcast_object_list([None] * args[1], src=args[0])
    elif kind == syncpoint.GATHER_OBJECT:
        dist.gather_object(None, dst=args[0])
    elif kind == syncpoint.BARRIER:
        dist.barrier()
    elif kind != syncpoint.SYNC_ONLY:
        raise UsageError(
            f"ranks {', '.join(map(str, verdict.ranks))} issued a collective that a rank which has "
            "joined cannot take part in (see their collective log): inside a join, use phalanx's "
            "collectives, and give Join every DistributedDataParallel, fully_shard root module, "
            "ZeroRedundancyOptimizer, Checkpointer and PreemptionHandler in use")


def _neutral(dtype: torch.dtype, numel: int, op: str) -> torch.Tensor:
    """What a joined rank contributes to a reduction ``op`` so that the result is the others'."""
    if op in ("MIN", "MAX"):
        info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
        return torch.full((numel,), info.max if op == "MIN" else info.min, dtype=dtype)
    return torch.full((numel,), _NEUTRAL[op], dtype=dtype)
