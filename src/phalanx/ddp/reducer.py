"""Gradient averaging during the backward pass: flat buckets, grad-ready hooks, async all-reduce.

How one synchronising backward runs:

1. ``prepare()`` (called after every forward) arms the reducer after a synchronising forward
   and, with ``find_unused_parameters=True``, walks the autograd graph from the outputs to
   learn which parameters can receive a gradient at all. Once armed, the reducer stays armed
   until that backward ends: later forwards (inside ``no_sync()``, under ``no_grad``) feed
   the same backward and add their graphs to the walk, but do not disarm it (torch's
   reducer behaves the same: only ``finalize_backward`` clears ``expect_autograd_hooks_``).
2. Each parameter's ``register_post_accumulate_grad_hook`` fires once its gradient is
   accumulated. The hook only marks the parameter ready and counts down its bucket: no tensor
   op, nothing that grows with the number of buckets (the hot path: one per gradient).
   The first hook of the backward queues ``_finalize`` on the autograd engine and marks the
   parameters known to be unused (found by the walk, or, with ``static_graph=True``, learned
   in the first backward) ready at once; their contribution is the current ``.grad``, or 0.
3. A bucket whose parameters are all ready is filled and launched, asynchronously, but strictly
   in bucket order: bucket k waits for buckets 0..k-1, so every rank issues the same collectives
   in the same order. Filling (:mod:`phalanx.ddp.slots`) is one batched copy of the gradients
   that are not in their slot already (``torch._foreach_copy_``) and one division of the whole
   buffer by the world size: per bucket, not per gradient, as torch's newest reducer does (``batched_grad_copy_``). With
   ``gradient_as_bucket_view`` (phalanx's default) ``.grad`` then *is* the slot, so a gradient
   accumulated into an existing ``.grad`` (``zero_grad(set_to_none=False)``, ``no_sync()``
   accumulation) lands in its slot directly and is not copied at all. Copy-then-divide gives
   the same bits as torch's divide-into-slot. The copy casts where a bucket's dtype differs
   from its gradients' (mixed precision's ``reduce_dtype``: :mod:`phalanx.ddp.mixed_precision`);
   a slot becomes ``.grad`` only where their dtypes agree, else the average is copied back.
   The last bucket is launched by ``_finalize`` only, when the engine is done (see below).
4. ``_finalize`` runs when the engine is done: it fills and launches what is left (parameters
   that got no gradient, and the last bucket), waits for every bucket, writes the averages back
   to ``.grad`` and raises :class:`~phalanx.errors.UnusedParametersError` -- on every rank --
   if a parameter got no gradient while that is not allowed, or got one late.

The last bucket carries a small control tail, summed by the same collective: element 0 counts
problems (unexpected missing or late gradients) so every rank learns of one rank's trouble
without an extra collective; with unused parameters allowed, one element per parameter says
whether any rank has a gradient for it (parameters with none anywhere keep ``.grad`` untouched,
as torch does, so e.g. Adam skips them). A gradient can come late (after its slot was settled:
``static_graph`` learned the parameter unused, or a second gradient in one backward), possibly
after every other gradient of the backward; holding the last bucket back to the end of the
backward is what lets its tail count every late one. The cost: the last bucket's all-reduce no
longer overlaps the backward work left after the last parameter's gradient (input gradients;
nothing in most models).

With ``static_graph=True`` the first backward also counts the gradients each parameter gets
(a module run twice in a forward, e.g. checkpointed twice with reentrant checkpointing, gets
two, each accumulated into ``.grad``) and settles every slot at its end, as torch's reducer
delays its first iteration's all-reduces; from the second backward on a parameter is ready at
its last gradient.

Sparse gradients (``nn.Embedding(sparse=True)``...) are in no bucket: their all-reduces
(sparse, one per parameter) start in ``_finalize``, after every bucket but the last, whose
tail also says which ranks had them (:mod:`phalanx.ddp.sparse`). A gradient that has a graph
(``backward(create_graph=True)``), or that comes sparse for a parameter bucketed as dense, is
copied on its own (:mod:`phalanx.ddp.unusual`).

A backward that fails midway (an exception in the engine) never reaches ``_finalize``; the
next ``prepare()`` waits for the collectives it launched before their buffers are reused.

ZeRO stage 2 (:class:`~phalanx.ddp.bucket_comm.ReduceToOwner`): buckets are planned so each
holds the parameters of one owner, the rank whose sharded optimizer updates them, and each is
*reduced* to that owner instead of all-reduced. Other ranks drop their copy: a gradient is
released (``.grad = None``) as soon as it is copied into such a bucket, whose buffer exists
only from its filling to the end of the backward. Only the owner writes the average
back to ``.grad``. The last bucket stays an all-reduce, as it carries the control tail every
rank must read.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Sequence

import torch
import torch.distributed as dist

from .. import comm
from ..diagnostics import ledger
from ..errors import UnusedParametersError, UsageError
from ..ledger import Collective, Ledger, syncpoint
from . import riding
from ..ledger.log import call_site
from .bucket_comm import BucketComm
from .bucketing import Bucket, BucketSpec
from .checkin import DDPAction
from .compiled_autograd import EAGER_REDUCER_TRACED, CompiledAutogradReduction, compiled_autograd_tracing
from .graph_walk import reachable_params
from .problems import problem_message
from .slots import fill, grad_dtype, write_back
from .sparse import SparseGradients
from .unusual import averaged_with_graph


class Reducer:
    """Averages the gradients of ``named_params`` across ``bucket_comm``'s group during backward.

    Args:
        named_params: ``(name, parameter)`` pairs the ``plan`` indexes into.
        plan: buckets in launch order, from :func:`phalanx.ddp.bucketing.plan_buckets`; not empty.
        bucket_comm (BucketComm): how each bucket is reduced:
            :class:`~phalanx.ddp.bucket_comm.AllReduceMean`,
            :class:`~phalanx.ddp.bucket_comm.ReduceToOwner` or, with a communication hook,
            :class:`~phalanx.ddp.hook_comm.HookComm` (divisor 1: the hook averages).
        gradient_as_bucket_view: make each ``.grad`` a view into its bucket (saves memory
            and the copy back). Default ``False``.
        find_unused_parameters: walk the graph after each forward to find parameters that
            cannot get a gradient, and let parameters go without one. Default ``False``.
        static_graph: let parameters go without a gradient, and learn which ones from the
            first backward instead of walking the graph each iteration. Default ``False``.
        sparse_params: ``(name, parameter)`` pairs of the parameters whose gradients come
            sparse, in no bucket of ``plan`` (:mod:`phalanx.ddp.sparse`). Default: none.
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, torch.Tensor]],
        plan: Sequence[BucketSpec],
        bucket_comm: BucketComm,
        gradient_as_bucket_view: bool = False,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        sparse_params: Sequence[tuple[str, torch.Tensor]] = (),
    ) -> None:
        self.bucket_comm = bucket_comm
        self.walk_graph = find_unused_parameters and not static_graph
        self.allow_unused = find_unused_parameters or static_graph
        self.static_graph = static_graph
        slots = [slot for spec in plan for slot in spec.slots]
        # Parameter k (launch order) is params[k], in bucket _bucket_of[k] (slot k - its first).
        self.names = [slot.name for slot in slots]
        self.params = [named_params[slot.index][1] for slot in slots]
        # what an average divides by (bucket_comm.divisor is 1 when a comm hook averages)
        self.world_size = dist.get_world_size(bucket_comm.group)
        self._sparse = SparseGradients(sparse_params, bucket_comm.group, self.world_size)
        tail = 1 + (len(slots) + len(sparse_params) if self.allow_unused else 0)
        self._ledger: Ledger = ledger()
        # A model with one small bucket carries its forward's sync point in that bucket's
        # all-reduce (phalanx.ddp.riding); ride: what that check names ("": none rides)
        envelope = riding.envelope(plan, tail, bucket_comm, bool(sparse_params), self._ledger)
        self._riding = None if envelope is None else riding.BucketRide(bucket_comm.group)
        self.ride = "" if envelope is None else riding.signature(plan, tail)
        self._buckets: list[Bucket] = []
        self._bucket_of: list[int] = []
        for b, spec in enumerate(plan):
            last = b == len(plan) - 1
            self._buckets.append(Bucket(spec, len(self._bucket_of), tail if last else 0, bucket_comm.keeps(b),
                                        envelope))
            self._bucket_of += [b] * len(spec.slots)
        self._index = {id(p): k for k, p in enumerate(self.params)}
        self._no_problem = torch.zeros(1, dtype=plan[-1].dtype, device=plan[-1].device)  # a tail's 0
        # each bucket's name and (dtype, shape) in the collective log: the same every backward
        self._ops = [f"DDP bucket {b}{bucket_comm.label}" for b in range(len(plan))]
        self._described = [(str(spec.dtype).removeprefix("torch."), (spec.numel + (tail if b == len(plan) - 1 else 0),))
                           for b, spec in enumerate(plan)]
        # Whether parameter k's slot can be its .grad: a view (gradient_as_bucket_view) into a
        # bucket this rank keeps, of the dtype .grad must have (mixed precision: the bucket's
        # reduce_dtype may differ from it; phalanx.ddp.mixed_precision).
        self._seats = [gradient_as_bucket_view and self._buckets[b].keep and plan[b].dtype == grad_dtype(p)
                       for p, b in zip(self.params, self._bucket_of)]
        # The hooks hold the reducer weakly: a discarded DDP leaves nothing acting on the model.
        me = weakref.ref(self)
        self._hooks = [
            p.register_post_accumulate_grad_hook(functools.partial(_hook, me, k)) for k, p in enumerate(self.params)
        ] + [
            p.register_post_accumulate_grad_hook(functools.partial(_sparse_hook, me, j))
            for j, p in enumerate(self._sparse.params)
        ]
        self._remove_hooks = weakref.finalize(self, _remove_all, list(self._hooks))
        # Hooks act: a synchronising forward ran and its backward has not ended.
        self.awaiting_backward = False
        self._reached: set[int] | None = None  # find_unused: reachable from the outputs
        self._known_unused: set[int] | None = None  # static_graph: learned in the first backward
        # static_graph: how many gradients each parameter gets per backward (a module run twice,
        # e.g. checkpointed twice with reentrant checkpointing, gets two), learned in the first
        self._fires_expected: list[int] | None = None
        self._works: list[dist.Work] = []
        self._sparse_works: list[dist.Work] = []
        self._records: list[Collective] = []  # the buckets' in the collective log
        self._settled = True  # every collective of the last backward waited for and ended
        self._site = ""
        # Called at the end of each synchronising backward that succeeded (DDP's step clock).
        self.on_backward_done: Any = None
        self.on_problem: Any = None  # called with the error a backward raises (the DDP's logging data)
        self.join_index: int | None = None  # this DDP's place in a running phalanx.join
        self._last = comm.LastWorks()  # the last backward's, until the next one's
        # the averaging under compiled autograd, armed by the DDP's forward instead of this reducer
        self.traced = CompiledAutogradReduction(self.params, bucket_comm.group)
        self._reset()

    def close(self) -> None:
        """Remove the hooks now (they also go when the reducer is garbage collected)."""
        self._remove_hooks()

    def _reset(self) -> None:
        """Ready for the next backward, once the last one's collectives are done."""
        if not self._settled:
            for work in self._works + self._sparse_works:
                # After a failed backward some may still be writing into bucket buffers the next
                # backward reuses. That backward raised already: an error of its collectives
                # (e.g. a peer that never joined) changes nothing.
                try:
                    work.wait()
                except Exception:
                    pass
            for record in self._records:
                record.end()  # a failed backward's buckets: no longer under way
        self._settled = True  # nothing in flight (a backward that ends well says so itself)
        self._last.hold(*self._works, *self._sparse_works)
        self._started = False
        if self._riding is not None:
            self._riding.ride = None
        self._ready = [False] * len(self.params)
        self._assumed_unused: list[int] = []
        self._late: list[int] = []
        self._had_grad = [True] * len(self.params)  # a contribution that was a gradient
        if self.static_graph:
            self._fires = [0] * len(self.params)  # gradients accumulated this backward
        self._graphs: dict[int, torch.Tensor] = {}  # create_graph: gradients with a graph
        if self._sparse.params:
            self._sparse.reset()
        self._next = 0
        self._works = []
        self._records: list[Collective] = []  # the buckets' in the collective log
        self._sparse_works = []
        for bucket in self._buckets:
            bucket.pending = len(bucket.spec.slots)
            if not bucket.keep:
                bucket.release()

    def prepare(self, sync: bool, outputs: Any = None) -> None:
        """Called after each forward. A synchronising one (``sync``) arms the hooks; they stay
        armed until the backward ends, whatever forwards run before it (see the module notes)."""
        if self._started:  # a backward that failed midway never reached _finalize
            self._reset()
            self.awaiting_backward = False
        if not (sync or self.awaiting_backward):
            return
        if self.walk_graph:
            reached = reachable_params(outputs, self._index)
            # Forwards since the last backward add up: their graphs all feed that backward.
            if self.awaiting_backward and self._reached is not None:
                reached |= self._reached
            self._reached = reached
        self.awaiting_backward = True

    # ---- during backward ---------------------------------------------------------------
    def _on_grad(self, k: int) -> None:
        """Parameter ``k``'s gradient is accumulated: the hot path (see the module notes)."""
        if not self.awaiting_backward:  # no_sync(), a backward without a synchronising forward,
            if self.traced.armed:  # or one under compiled autograd, which averages it here
                self.traced.on_grad(k)
            return
        if not self._started:
            self._start_backward()
        if self.static_graph:
            self._fires[k] += 1
            if self._fires_expected is None:
                return  # the first backward: learn; _finalize settles every slot at its end
            if self._fires[k] < self._fires_expected[k]:
                return  # more of its gradient to come (a module run twice in the forward)
        if self._ready[k]:
            # Its slot was settled already (assumed unused, or a second gradient). Raising
            # here would leave the other ranks waiting: the last bucket's tail reports it.
            self._late.append(k)
            return
        self._ready[k] = True
        b = self._bucket_of[k]
        bucket = self._buckets[b]
        bucket.pending -= 1
        if bucket.pending == 0 and b == self._next:
            self._launch_ready()

    def _on_sparse_grad(self, j: int) -> None:
        if self.awaiting_backward:
            if not self._started:
                self._start_backward()
            self._sparse.on_grad(j)

    def _start_backward(self) -> None:
        if compiled_autograd_tracing():  # an eager forward armed this reducer
            raise UsageError(EAGER_REDUCER_TRACED)
        self._started = True
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
        self._ledger = ledger()  # records each bucket (phalanx.ledger)
        self._site = call_site(1, "DDP backward") if self._ledger.enabled else ""
        if self.walk_graph and self._reached is not None:
            unused = [k for k in range(len(self.params)) if k not in self._reached]
        elif self.static_graph and self._known_unused:
            unused = sorted(self._known_unused)
        else:
            return
        for k in unused:
            self._assume_unused(k)
        self._launch_ready()

    def _assume_unused(self, k: int) -> None:
        """No gradient will come this backward: contribute the current ``.grad`` (or zeros)."""
        self._assumed_unused.append(k)
        self._ready[k] = True
        self._buckets[self._bucket_of[k]].pending -= 1

    def _launch_ready(self, final: bool = False) -> None:
        """Launch every complete bucket at the head of the queue, in bucket order.

        The last bucket goes only when ``final`` (from ``_finalize``): its control tail must
        count every late gradient of the backward.
        """
        last = len(self._buckets) - 1
        while self._next <= last and self._buckets[self._next].pending == 0:
            bucket = self._buckets[self._next]
            if self._next == last and not final:
                return
            if bucket.buffer is None:  # a bucket this rank does not keep: from now to the end
                bucket.allocate()
            flat, extra = bucket.buffer, []
            if self._riding is not None and self.join_index is None:  # the forward's sync point
                flat = self._riding.take(self._ledger, bucket, extra)  # goes with the gradients
            if self._next == last and not self.allow_unused:  # the problem count alone
                self._write_tail(bucket.tail, extra)
            fill(bucket, self.params, self._seats, self.bucket_comm.divisor, self._had_grad, self._graphs, extra)
            if self._next == last and self.allow_unused:  # after fill: which parameters had a gradient
                self._write_tail(bucket.tail, extra)
            record = self._record(self._ops[self._next], None, DDPAction.BUCKET, self._next,
                                  described=self._described[self._next])
            self._records.append(record)
            self._settled = False
            self._works.append(self._launch(self._next, flat, record))
            self._next += 1

    def _launch(self, b: int, flat: torch.Tensor, record: Collective) -> Any:
        """Launch bucket ``b``. A communication hook's launch may wait for earlier buckets'
        collectives (:mod:`phalanx.ddp.hook_comm`): a failure there is reported as this
        bucket's (the hang report, :mod:`phalanx.diagnostics`)."""
        try:  # record.guard(), inline: every step launches here
            work = self.bucket_comm.launch(b, flat)
            if self.bucket_comm.runs_to_end_in_join and self.join_index is not None:
                # phalanx.join: a rank that has joined runs each bucket's hook to its end before
                # the next announcement (ddp/joining.py); so does this rank, or their hooks'
                # collectives would come in different orders
                work.wait()
        except RuntimeError as e:
            better = record.failure(e)
            if better is e:
                raise
            raise better from e
        return work

    def _record(self, op: str, tensor: torch.Tensor | None, *shadow: int,
                described: tuple[str, tuple[int, ...]] | None = None) -> Collective:
        """Record a collective (:mod:`phalanx.ledger`); ``shadow``: the action and
        arguments a joined rank shadows it with (:mod:`phalanx.uneven`); ``described``: what
        it moves, as the log describes it (instead of ``tensor``)."""
        announce = None if self.join_index is None else (syncpoint.JOINABLE, self.join_index, *shadow)
        return self._ledger.collective(op, () if tensor is None else (tensor,), self.bucket_comm.group,
                                       site=self._site, shadow=announce, described=described)

    def set_divisor(self, divisor: int) -> None:
        """Average over ``divisor`` ranks from the next gradient on (a join: the active ones).
        A communication hook divides as it does (torch's and phalanx's: by the group's size),
        as with torch's join."""
        self._sparse.divisor = divisor
        if not self.bucket_comm.divides_itself:
            self.bucket_comm.divisor = divisor

    @staticmethod
    def _wait(work: dist.Work, record: Collective) -> None:
        record.wait(work)
        record.end()

    def _write_tail(self, tail: torch.Tensor, extra: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The control tail (see the module notes). Without unused parameters allowed it is the
        problem count, written before :func:`~phalanx.ddp.slots.fill` (no problem: a zero copied
        with the gradients, ``extra``); with them, after it (whether each parameter had one)."""
        sparse = self._sparse
        problems = len(self._late) + len(sparse.late)
        if not self.allow_unused:
            problems += len(self._assumed_unused) + (len(sparse.missing()) if sparse.params else 0)
            if problems == 0:
                extra.append((tail, self._no_problem))
            else:
                tail.fill_(problems)  # the tail is this one number (one call, not an indexing)
            return
        tail[0] = float(problems)
        tail[1:].copy_(torch.tensor(self._had_grad + sparse.had_grad, dtype=tail.dtype))

    def _finalize(self) -> None:
        """End of backward: settle what is left, wait, write back, report problems everywhere."""
        try:
            if self.static_graph and self._fires_expected is None:
                self._fires_expected = list(self._fires)
                for k in (k for k, fires in enumerate(self._fires) if fires):
                    self._ready[k] = True  # all of its gradients are in
                    self._buckets[self._bucket_of[k]].pending -= 1
            left = [k for k, ready in enumerate(self._ready) if not ready]
            for k in left:
                self._assume_unused(k)
            last = len(self._buckets) - 1
            sparse = None
            if self._sparse.params:
                self._launch_ready()  # every bucket but the last, before the sparse all-reduces
                sparse = self._record("DDP sparse gradients", None, DDPAction.SPARSE)
                self._sparse_works = self._sparse.launch()
            self._launch_ready(final=True)
            for b, (work, record) in enumerate(zip(self._works, self._records)):
                self._wait(work, record)
                if self._riding is not None and self._riding.ride is not None:
                    self._riding.arrived(self._ledger, self._buckets[0])
                if b < last and not self.allow_unused:
                    self._write_back(b, None)
            if sparse is not None:
                for work in self._sparse_works:
                    sparse.wait(work)
                sparse.end()
            self._settled = True
            tail = self._buckets[last].tail
            # without unused parameters allowed the tail is the problem count alone
            if (tail[0] if self.allow_unused else tail).item() > 0:
                self._raise_problems()  # every rank sees the sum: all raise, none hangs
            used = (tail[1:] > 0).tolist() if self.allow_unused else None
            for b in range(len(self._buckets)) if self.allow_unused else [last]:
                self._write_back(b, used)
            if self._sparse.params:
                self._sparse.write_back(None if used is None else used[len(self.params):])
            if self._graphs:
                self._attach_graphs(used)
            if self.static_graph and self._known_unused is None:
                self._known_unused = set(left)
            if self.on_backward_done is not None:
                self.on_backward_done()
        finally:
            self.awaiting_backward = False
            self._reset()

    def _write_back(self, b: int, used: list[bool] | None) -> None:
        write_back(self._buckets[b], self.params, self._seats, used)

    def _attach_graphs(self, used: list[bool] | None) -> None:
        """create_graph: give each averaged ``.grad`` a graph back to this rank's gradient."""
        for k, local in self._graphs.items():
            bucket = self._buckets[self._bucket_of[k]]
            if bucket.keep and (used is None or used[k]):
                view = bucket.views[k - bucket.first]
                divisor = self.world_size if self.bucket_comm.divides_itself else self.bucket_comm.divisor
                self.params[k].grad = averaged_with_graph(local, view, divisor)

    # ---- on a rank that has joined (phalanx.join): the others' collectives, shadowed --------
    def shadow_bucket(self, b: int, write_back: bool) -> None:
        """Zeros into bucket ``b``'s collective (its tail too: no problem, no use reported).
        With ``write_back`` (an optimizer in the join steps with them), after the last bucket
        the averages go into ``.grad`` as a backward would write them; else ``.grad`` is left
        alone, as torch's join does (the zeros go in a buffer of their own: with
        ``gradient_as_bucket_view`` the bucket *is* ``.grad``)."""
        bucket = self._buckets[b]
        if bucket.buffer is None:
            bucket.allocate()
        flat = bucket.buffer if write_back else torch.empty_like(bucket.buffer)
        flat.zero_()
        self.bucket_comm.launch(b, flat).wait()
        if b < len(self._buckets) - 1:
            return
        tail = flat[bucket.spec.numel:]
        if tail[0].item() > 0:
            self._raise_problems()  # the active ranks raise: so does this one, with them
        used = (tail[1:] > 0).tolist() if self.allow_unused else None
        for k in range(len(self._buckets)) if write_back else ():
            self._write_back(k, used)
        for each in self._buckets:
            if not each.keep:
                each.release()

    def shadow_sparse(self) -> None:
        """Empty sparse gradients into the others' sparse all-reduces."""
        for work in self._sparse.launch(nothing=True):
            work.wait()

    def buffers(self) -> list[torch.Tensor]:
        """The bucket buffers allocated now (outside a backward: the kept ones)."""
        return [bucket.buffer for bucket in self._buckets if bucket.buffer is not None]

    def _describe(self) -> dict[str, list[str]]:
        sparse = self._sparse
        missing = [] if self.allow_unused else [self.names[k] for k in self._assumed_unused] + sparse.missing()
        late = [self.names[k] for k in self._late] + [sparse.names[j] for j in sparse.late]
        return {"missing": missing, "late": late}

    def _raise_problems(self) -> None:
        everyone = comm.all_gather_object(self._describe(), self.bucket_comm.group)
        error = UnusedParametersError(problem_message(dict(enumerate(everyone)), self.static_graph))
        if self.on_problem is not None:
            self.on_problem(error)
        raise error

    def unused_params(self) -> list[torch.Tensor]:
        """The bucketed parameters treated as unused now: with ``static_graph`` those learned
        in the first backward, with ``find_unused_parameters`` those the latest synchronising
        forward's graph did not reach; none otherwise (each must get a gradient)."""
        if self.walk_graph and self._reached is not None:
            unused = set(range(len(self.params))) - self._reached
        else:
            unused = (self._known_unused or set()) if self.static_graph else set()
        return [self.params[k] for k in sorted(unused)]


def _hook(reducer: weakref.ref, k: int, param: torch.Tensor) -> None:
    alive = reducer()
    if alive is not None:
        alive._on_grad(k)


def _sparse_hook(reducer: weakref.ref, j: int, param: torch.Tensor) -> None:
    alive = reducer()
    if alive is not None:
        alive._on_sparse_grad(j)


def _remove_all(handles: list) -> None:
    for handle in handles:
        handle.remove()


def tensor_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of memory ``tensors`` hold, each storage counted once (sparse: indices and values)."""
    storages = {}
    for t in tensors:
        if t.layout == torch.strided:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        else:
            storages[id(t)] = t._indices().nbytes + t._values().nbytes
    return sum(storages.values())
