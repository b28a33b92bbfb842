"""DistributedDataParallel's checks after construction: what ``shard_gradients`` needs of an
optimizer (agreed on by every rank), and the refusal of distributed autograd at each forward.

The constructor's arguments are checked by :mod:`phalanx.ddp.options`; both exchanges carry
each rank's verdict (:func:`verdict`), so one rank's problem is raised on every rank and
none waits (:func:`phalanx.agreement.agree`).
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Protocol

import torch
import torch.distributed as dist
from torch import nn

from ..agreement import agree
from ..errors import UsageError


class GradientOwners(Protocol):
    """What ``shard_gradients`` needs of a sharded optimizer (such as
    :class:`~phalanx.ZeroRedundancyOptimizer`): its group, and which rank owns a parameter."""

    process_group: dist.ProcessGroup | None

    def owners_of(self, params: Iterable[torch.Tensor]) -> list[int | None]: ...


# A default repr names an object by its address, which differs between processes even for the
# same argument (mixed_precision=object() did on 2 ranks): left out of what ranks compare.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def verdict(problem: Exception | None) -> tuple[str, str]:
    """The arguments' item in an agreement: every rank learns which ranks refused them."""
    return ("arguments", "accepted" if problem is None else f"refused: {_ADDRESS.sub('', str(problem))}")


def gradient_owners(module: nn.Module, group: dist.ProcessGroup | None, mid_iteration: bool,
                    optimizer: Any) -> list[int | None]:
    """The owner of each of ``module.named_parameters()`` by ``optimizer``, for
    ``shard_gradients``; or a TypeError, ValueError or UsageError saying what is wrong."""
    if not callable(getattr(optimizer, "owners_of", None)) or not hasattr(optimizer, "process_group"):
        raise TypeError(
            "shard_gradients() needs a sharded optimizer such as phalanx.ZeroRedundancyOptimizer "
            f"(its owners_of() says which rank owns each parameter), got {type(optimizer).__name__}"
        )
    ours = dist.get_process_group_ranks(group or dist.group.WORLD)
    theirs = dist.get_process_group_ranks(optimizer.process_group or dist.group.WORLD)
    if ours != theirs:
        raise ValueError(
            "shard_gradients() needs the optimizer sharded over the ranks DDP averages over: "
            f"DDP has global ranks {ours}, the optimizer {theirs}"
        )
    if mid_iteration:
        raise UsageError(
            "shard_gradients() was called between a forward and its backward; call it between "
            "iterations (after backward(), or before the first forward)"
        )
    owners = list(optimizer.owners_of(p for _, p in module.named_parameters()))
    if all(owner is None for owner in owners):
        raise ValueError(
            "shard_gradients() needs the optimizer of this model: it holds none of the "
            f"{len(owners)} parameters of this DistributedDataParallel's module"
        )
    return owners


def agree_on_owners(module: nn.Module, group: dist.ProcessGroup | None, mid_iteration: bool,
                    optimizer: Any) -> list[int | None]:
    """:func:`gradient_owners`, the same on every rank (or every rank raises)."""
    problem, owners = None, None
    try:
        owners = gradient_owners(module, group, mid_iteration, optimizer)
    except (TypeError, ValueError, RuntimeError) as e:
        problem = e
    items = [verdict(problem)]
    if owners is not None:
        items += [(f"owner of {name}", owner) for (name, _), owner in zip(module.named_parameters(), owners)]
    agree("shard_gradients() owners", group, items=items, problem=problem)
    return owners  # type: ignore[return-value]  # not None: agree raised otherwise


if dist.rpc.is_available():  # whether this process has started RPC (distributed autograd needs it)
    from torch.distributed.rpc.api import _is_current_rpc_agent_set as rpc_agent_set
else:
    def rpc_agent_set() -> bool:
        return False


def refuse_distributed_autograd() -> None:
    """Raise if this forward runs in a ``torch.distributed.autograd`` context.

    Gradients of ``torch.distributed.autograd.backward()`` go to the context, not ``.grad``,
    and the autograd hooks phalanx averages with do not run for them: they would stay this
    rank's own, silently. The test costs a fraction of a microsecond without RPC.
    """
    if not rpc_agent_set():
        return
    import torch.distributed.autograd as dist_autograd

    try:
        dist_autograd._current_context()
    except RuntimeError:
        return  # RPC, but no distributed autograd context: plain autograd
    raise UsageError(
        "phalanx's DistributedDataParallel does not average gradients computed by "
        "torch.distributed.autograd.backward(): this forward runs in a distributed autograd "
        "context. Use loss.backward() (phalanx averages .grad), or torch's "
        "DistributedDataParallel for the DDP + RPC recipe"
    )
