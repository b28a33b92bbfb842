"""DistributedDataParallel under compiled autograd: torch's ``optimize_ddp="python_reducer"`` route.

Compiled autograd (``torch._dynamo.config.compiled_autograd = True``, or
``torch._dynamo.compiled_autograd._enable(...)``) captures a backward as one graph and traces
the Python hooks it meets on the way. The reducer (:mod:`phalanx.ddp.reducer`) cannot be
traced: it queues an end-of-backward callback, waits on ``Work`` handles, records each bucket
in the ledger (whose call sites inspect frames). torch's DDP has the same problem with its C++
reducer and solves it with ``torch._dynamo.config.optimize_ddp = "python_reducer"``: a
post-accumulate-grad hook per parameter that divides the gradient by the world size, all-reduces
it with a functional collective and copies the result back into ``.grad``. Compiled autograd
captures those ops into the backward graph, and inductor's DDP passes
(``torch._inductor.config._fuse_ddp_communication``, which torch's DDP switches on at
construction in that mode, and so does phalanx's) fuse them into buckets and move each wait to
where its result is needed, so the all-reduces overlap the rest of the backward.

phalanx's DDP does the same, with the same ops, when a forward finds compiled autograd enabled
(``torch._dynamo.compiled_autograd.compiled_autograd_enabled``, true inside a function compiled
with ``torch._dynamo.config.compiled_autograd = True`` and inside ``_enable``) and
``optimize_ddp == "python_reducer"``; both are read at every forward, so a script can switch.
That forward arms :class:`CompiledAutogradReduction` instead of the reducer. Its averaging runs
from the reducer's own per-parameter hook (one hook per parameter, not two: the eager path's cost
is unchanged), so whichever path the last forward chose acts in the backward. The forward traces
without a graph break: inputs to the device, rank 0's buffers broadcast with a functional
broadcast, the module's forward. Nothing in a compiled graph may wait on a ``Work`` or inspect
frames, so the ledger works at the graph's boundaries instead: the traced forward calls
:func:`step_boundary`, an opaque custom op (``phalanx::ddp_compiled_step``) with an ordered
side effect, which the compiled graph keeps and runs eagerly at every step, at the forward's
start and at its end (after an output: inductor cannot move it up). The start starts the step's
sync point; the end waits for it (so its latency hides behind the forward, as in eager mode;
with buffers the start waits, for the buffer broadcast follows it) and records what the graph
issues this step: the buffer broadcast, and the gradients' all-reduces as one record, each ended
at once (their timing is the graph's). Ranks that parted (one out of batches, one evaluating)
name each other there, as in eager mode, before any gradient reaches Gloo. A forward on this
path that runs eagerly (compiled autograd enabled around an uncompiled forward) keeps the sync
point and the recorded buffer broadcast of the eager path and records the gradients'
all-reduces after them.

Refused, each with :class:`~phalanx.errors.UsageError` naming the option and the alternative
(:func:`refusal`): compiled autograd without ``optimize_ddp="python_reducer"`` (torch's reducer
refuses it at the backward), ``find_unused_parameters``, ``static_graph``, communication hooks,
ZeRO stage 2 (:meth:`~phalanx.DistributedDataParallel.shard_gradients`), sparse gradients and
uneven inputs (``join``). An eager forward followed by a backward under compiled autograd
(``_enable`` around the backward only) reaches the reducer while it is traced: it raises
:data:`EAGER_REDUCER_TRACED`.
"""

from __future__ import annotations

import itertools
import sys
import weakref
from typing import Any, Protocol, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fcol

PYTHON_REDUCER = "python_reducer"
# torch's C++ reducer's words when compiled autograd meets it (reducer.cpp, torch 2.13)
TORCH_WORDS = ("Compiled autograd is not compatible with C++ DDP Reducer, please use "
               'torch._dynamo.config.optimize_ddp="python_reducer".')
# torch's default bucket size (torch.nn.parallel.distributed._DEFAULT_BUCKET_CAP_MB), which
# its DDP hands to inductor's DDP fusion when bucket_cap_mb is not given
DEFAULT_FUSION_MB = 25
# the collective log's name for the per-parameter all-reduces of a compiled autograd backward
TRACED_REDUCTION = "DDP gradient all-reduces (compiled autograd)"
ELSEWHERE = "or train without compiled autograd (eager, or torch.compile of the model alone)"
EAGER_REDUCER_TRACED = (
    "compiled autograd is tracing phalanx's eager gradient reducer: the forward of this backward ran "
    "without compiled autograd enabled, so it armed the reducer, whose end-of-backward callback and "
    "Work handles cannot be traced. Run the forward with compiled autograd enabled too (compile the "
    "whole training step with torch._dynamo.config.compiled_autograd = True, or put the forward inside "
    "the same torch._dynamo.compiled_autograd._enable(...) block as the backward) and set "
    f'torch._dynamo.config.optimize_ddp = "{PYTHON_REDUCER}".')


def compiled_autograd_enabled() -> bool:
    """Whether compiled autograd is enabled now (traceable; never imports torch._dynamo)."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return ca is not None and ca.compiled_autograd_enabled


def compiled_autograd_tracing() -> bool:
    """Whether a compiled autograd graph is being traced or run now (then hooks are traced)."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return ca is not None and ca.in_compiled_autograd_region


def optimize_ddp_mode() -> str:
    """``torch._dynamo.config.optimize_ddp`` as torch reads it (booleans as its modes; never
    imports torch._dynamo: not imported, it holds its default)."""
    dynamo = sys.modules.get("torch._dynamo")
    mode = True if dynamo is None else dynamo.config.optimize_ddp  # True: torch's default
    if mode is True:
        return "ddp_optimizer"
    return "no_optimization" if mode is False else mode


def refusal(mode: str, settings: dict[str, Any], sparse: Sequence[str], in_join: bool) -> str | None:
    """Why a forward with compiled autograd enabled cannot take the traced path, or ``None``.

    ``settings``: the DDP's ``find_unused_parameters``, ``static_graph``, ``mixed_precision``,
    ``comm_hook`` and ``shard_gradients`` (bools); ``sparse``: names of parameters with sparse gradients;
    ``in_join``: a join is running."""
    if mode != PYTHON_REDUCER:
        return (f"{TORCH_WORDS} phalanx's DistributedDataParallel ran a forward with compiled autograd "
                f"enabled and torch._dynamo.config.optimize_ddp = {mode!r}: set "
                f'torch._dynamo.config.optimize_ddp = "{PYTHON_REDUCER}" (before constructing the model, '
                "so that inductor buckets the all-reduces, as torch's DDP requires too); each gradient is "
                "then averaged by a functional all-reduce that compiled autograd captures, as torch's DDP "
                "does in that mode.")
    if settings["find_unused_parameters"]:
        return ("find_unused_parameters=True is not supported under compiled autograd: each gradient is "
                "all-reduced from its own hook, in the compiled backward, and no hook fires for a parameter "
                "that gets no gradient (torch's python_reducer skips such parameters too: when the ranks "
                "differ, their collectives no longer match). Use find_unused_parameters=False with every "
                f"parameter getting a gradient on every rank, {ELSEWHERE}.")
    if settings["static_graph"]:
        return ("static_graph=True is not supported under compiled autograd: it learns from the first "
                "backward and counts each parameter's gradients, which needs an end-of-backward callback "
                "compiled autograd cannot trace (torch's python_reducer ignores static_graph). Use "
                f"static_graph=False, {ELSEWHERE}.")
    if settings["mixed_precision"]:
        return ("mixed_precision= is not supported under compiled autograd: its low-precision copies are "
                "swapped in before the forward and the fp32 masters back at the end of the backward, from "
                "Python, around the graph compiled autograd captures. Use torch.autocast for bf16 compute "
                f"instead, {ELSEWHERE}.")
    if settings["comm_hook"]:
        return ("register_comm_hook() is not supported under compiled autograd: a communication hook "
                "reduces whole buckets and returns a Future, which compiled autograd cannot trace (torch's "
                "python_reducer calls hooks per parameter with (grad, param), a contract of its own). "
                f"Construct the model without the hook, {ELSEWHERE}.")
    if settings["shard_gradients"]:
        return ("shard_gradients() (ZeRO stage 2) is not supported under compiled autograd: it reduces "
                "each bucket to its owner and drops the other ranks' gradients, which the traced "
                "per-parameter all-reduce does not do (torch's python_reducer has no ZeRO stage 2 either). "
                f"Use a ZeroRedundancyOptimizer without shard_gradients() (ZeRO stage 1), {ELSEWHERE}.")
    if sparse:
        return (f"sparse gradients ({', '.join(sparse)}) are not supported under compiled autograd: they "
                "are all-reduced as sparse tensors, outside any bucket, which functional collectives do not "
                "do (torch's python_reducer fails there, with a RuntimeError from the functional "
                f"all-reduce). Use dense gradients (e.g. nn.Embedding(sparse=False)), {ELSEWHERE}.")
    if in_join:
        return ("uneven inputs (DistributedDataParallel.join(), phalanx.join()) are not supported under "
                "compiled autograd: a rank that has joined shadows the others' collectives one by one, "
                "announced from Python, and here they are inside a compiled graph (torch's python_reducer "
                "skips the join's notification: a joined rank waits forever). Give every rank the same "
                f"number of batches (DistributedSampler(drop_last=True)), {ELSEWHERE}.")
    return None


def enable_inductor_bucketing(bucket_cap_mb: float | None) -> None:
    """What torch's DDP does at construction with ``optimize_ddp="python_reducer"``: let
    inductor fuse the per-parameter all-reduces into buckets of ``bucket_cap_mb`` MiB."""
    import torch._inductor.config as inductor_config

    inductor_config._fuse_ddp_communication = True
    inductor_config._fuse_ddp_bucket_size = DEFAULT_FUSION_MB if bucket_cap_mb is None else bucket_cap_mb


class _Boundary(Protocol):
    def compiled_boundary(self, at_end: bool, what: str, sync: bool, broadcasts: bool) -> None: ...


_BOUNDARIES: weakref.WeakValueDictionary[int, _Boundary] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def boundary_key(owner: _Boundary) -> int:
    """A key for :func:`step_boundary` to find ``owner`` by (held weakly)."""
    key = next(_KEYS)
    _BOUNDARIES[key] = owner
    return key


@torch.library.custom_op("phalanx::ddp_compiled_step", mutates_args=())
def step_boundary(anchor: torch.Tensor, key: int, at_end: bool, what: str, sync: bool, broadcasts: bool) -> None:
    """Called by a traced forward at its start and at its end (``at_end``), run by its compiled
    graph at every step: the owner of ``key`` checks and records the step (see the module
    notes). ``anchor``: a tensor the call must come after (a parameter; at the end, an output)."""
    owner = _BOUNDARIES.get(key)
    if owner is not None:
        owner.compiled_boundary(at_end, what, sync, broadcasts)


@step_boundary.register_fake
def _step_boundary_fake(anchor: torch.Tensor, key: int, at_end: bool, what: str, sync: bool,
                        broadcasts: bool) -> None:
    return None


def _keep_in_order() -> None:
    """Mark :func:`step_boundary` as having an ordered side effect: the graph keeps it (it has no
    output) and runs it where the forward called it, as torch's own ``print`` op."""
    from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

    _register_effectful_op(torch.ops.phalanx.ddp_compiled_step.default, _EffectType.ORDERED)


_keep_in_order()


class CompiledAutogradReduction:
    """Averages gradients across ``group`` with one functional all-reduce per parameter, in ops
    that compiled autograd captures (see the module notes).

    The reducer's gradient hook calls :meth:`on_grad` while the reducer is not armed; it acts
    after a forward that armed it (:attr:`armed`: the last forward before the backward was a
    synchronising one on this path).

    Args:
        params: the parameters, indexed as the reducer's hooks index them.
        group: the process group (``None``: the world).
    """

    def __init__(self, params: Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> None:
        self.params = list(params)
        self.group = group if group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(group)
        self.armed = False

    def on_grad(self, k: int) -> None:
        """Parameter ``k``'s gradient is accumulated: average it (torch's python reducer's ops,
        div, all_reduce, copy_, the pattern inductor's DDP fusion looks for); called while
        :attr:`armed`."""
        grad = self.params[k].grad
        grad.copy_(fcol.all_reduce(grad / self.world_size, "sum", self.group))

    def broadcast_buffers(self, buffers: Sequence[torch.Tensor]) -> None:
        """Group rank 0's buffers into every rank's, with functional broadcasts (traceable)."""
        for buffer in buffers:
            buffer.copy_(fcol.broadcast(buffer, 0, self.group))
