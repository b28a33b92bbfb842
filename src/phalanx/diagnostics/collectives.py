"""torch.distributed's group collectives as ``phalanx.X``: each one checked, then recorded.

``import phalanx as dist`` gives a script these in place of torch's. Each takes torch's
arguments and returns what torch's returns; before the payload moves, the ranks meet at a
sync point (:meth:`~phalanx.ledger.Ledger.sync_point`) that compares what
every rank is about to issue (op, dtype, shape, root rank, reduction, group) and everything
since the last point. A mismatch raises :class:`~phalanx.errors.CollectiveMismatchError` on
every rank instead of reaching Gloo, which aborts the process when sizes differ. The cost is
one small extra all-reduce per call; torch.distributed's own functions skip both.

``monitored_barrier`` is its own check (it names the ranks that did not arrive within its
``timeout``): it is recorded but meets at no sync point first, which would wait for those
ranks past that timeout; inside a join it is announced like the others. torch's refuses any
backend not named ``"gloo"``; this one also runs on a group whose CPU collectives Gloo serves
beneath another name (``"phalanx_shm"``), on that Gloo (:func:`monitored_barrier`).

Point-to-point calls (``send``, ``recv``, ``isend``, ``irecv``, ``batch_isend_irecv``) involve
two ranks, not a group, and are passed through unchanged.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

from ..comm import cpu_backend_is_gloo
from ..ledger import syncpoint
from ..ledger.log import call_site, describe_tensors
from .attach import ledger

# Per collective: the arguments holding the tensor whose dtype and shape every rank must
# agree on, and the arguments every rank must pass alike. The *_object collectives move
# objects of any size, and all_to_all takes a list per rank: only their op and root count.
_SPEC: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "all_reduce": (("tensor",), ("op",)),
    "broadcast": (("tensor",), ("src",)),
    "reduce": (("tensor",), ("dst", "op")),
    "all_gather": (("tensor",), ()),
    "all_gather_into_tensor": (("input_tensor",), ()),
    "all_gather_single": (("input_tensor",), ()),
    "reduce_scatter": (("output",), ("op",)),
    "reduce_scatter_tensor": (("output",), ("op",)),
    "all_to_all_single": ((), ()),
    "all_to_all": ((), ()),
    "gather": (("tensor",), ("dst",)),
    "scatter": (("tensor",), ("src",)),
    "all_gather_object": ((), ()),
    "gather_object": ((), ("dst",)),
    "broadcast_object_list": ((), ("src",)),
    "scatter_object_list": ((), ("src",)),
    "monitored_barrier": ((), ()),
}
CHECKED = frozenset(_SPEC)


def _gloo_beneath(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group``'s backend is not named ``"gloo"`` but its CPU backend is Gloo's."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    return dist.get_backend(pg) != "gloo" and cpu_backend_is_gloo(pg)


def monitored_barrier(group: dist.ProcessGroup | None = None, timeout: Any = None,
                      wait_all_ranks: bool = False) -> None:
    """torch's ``monitored_barrier``, which accepts only a backend named ``"gloo"``, also on a
    group whose CPU backend is Gloo under another name (``"phalanx_shm"``, whose name its
    subgroups and device meshes inherit): there, the same call on the group (c10d runs it on
    that CPU backend), after torch's own argument handling.

    Args and errors are torch's: rank 0 raises ``RuntimeError`` naming the first rank (every
    rank with ``wait_all_ranks``) that did not arrive within ``timeout`` (default: the
    backend's default timeout)."""
    c10d = dist.distributed_c10d
    if (group is not None and c10d._rank_not_in_group(group)) or not _gloo_beneath(group):
        return dist.monitored_barrier(group, timeout, wait_all_ranks)
    if timeout is None:
        timeout = c10d._get_default_timeout(dist.get_backend(group))
    elif isinstance(timeout, float):  # as torch converts it, and warns
        warnings.warn("Please specify timeout arg as a timedelta. Converting current value of "
                      f"{timeout} assuming it represents seconds", stacklevel=2)
        timeout = timedelta(seconds=timeout)
    c10d._check_valid_timeout(timeout)
    pg = group if group is not None else c10d._get_default_group()
    return pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)


def _value(value: Any) -> str:
    return getattr(value, "name", None) or str(value)


@functools.cache
def checked(name: str) -> Callable[..., Any]:
    """torch.distributed's ``name``, checked and recorded by this process's diagnostics (when
    it has any: a process group of several ranks, diagnostics on)."""
    fn = monitored_barrier if name == "monitored_barrier" else getattr(dist, name)
    signature = inspect.signature(fn)
    tensor_args = _SPEC[name][0]

    @functools.wraps(fn)
    def collective(*args: Any, **kwargs: Any) -> Any:
        book = ledger()
        bound = signature.bind(*args, **kwargs)
        group = bound.arguments.get("group")
        if not book.enabled or dist.get_world_size(group) == 1 or dist.get_rank(group) < 0:
            return fn(*args, **kwargs)
        tensors = [bound.arguments[a] for a in tensor_args if a in bound.arguments]
        site = call_site(2)
        if name != "monitored_barrier" or book.join is not None:
            book.sync_point(_what(name, signature, bound, tensors, book.group_name(group)), group,
                            site=site, announce=_shadow(name, bound.arguments))
        op = name + (" (async)" if bound.arguments.get("async_op") else "")
        with book.collective(op, tensors, group, site=site, announced=True,
                             diagnosed=name == "monitored_barrier"):
            return fn(*args, **kwargs)

    return collective


def _what(name: str, signature: inspect.Signature, bound: inspect.BoundArguments,
          tensors: list[Any], group_name: str) -> str:
    """What the ranks compare at the sync point: op, dtype, shape, the arguments that must be
    alike, the group."""
    tensor_args, alike = _SPEC[name]
    dtype, shape = describe_tensors(tensors)
    what = name + ("" if dtype == "-" else f" {dtype}{list(shape)}")
    bound.apply_defaults()  # an argument left at its default and one passed alike agree
    what += "".join(f" {a}={_value(bound.arguments[a])}" for a in alike
                    if bound.arguments[a] != signature.parameters[a].default)
    return what + ("" if group_name == "world" else f" on {group_name}")


def _shadow(name: str, arguments: dict[str, Any]) -> tuple[int, ...]:
    """How a rank that has joined (phalanx.join) takes part in this collective."""
    a = arguments
    if name == "all_reduce":
        op = _value(a["op"])
        if op not in syncpoint.REDUCE_OPS:
            return (syncpoint.UNSHADOWABLE,)
        return syncpoint.tensor_shadow(syncpoint.ALL_REDUCE, a["tensor"], syncpoint.REDUCE_OPS.index(op))
    if name == "broadcast":
        return syncpoint.tensor_shadow(syncpoint.BROADCAST, a["tensor"], a["src"])
    if name in ("all_gather_into_tensor", "all_gather_single"):
        return syncpoint.tensor_shadow(syncpoint.ALL_GATHER_INTO_TENSOR, a["input_tensor"])
    if name == "all_gather_object":
        return (syncpoint.ALL_GATHER_OBJECT,)
    if name == "broadcast_object_list":
        return (syncpoint.BROADCAST_OBJECT, a["src"], len(a["object_list"]))
    if name == "gather_object":
        return (syncpoint.GATHER_OBJECT, a["dst"])
    if name == "monitored_barrier":
        return (syncpoint.BARRIER,)
    return (syncpoint.UNSHADOWABLE,)
