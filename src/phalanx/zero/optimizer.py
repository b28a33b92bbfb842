"""ZeroRedundancyOptimizer: optimizer state sharded across ranks (ZeRO stage 1, and 2 with DDP).

Every rank keeps the whole model and computes (or receives, through DDP) the whole averaged
gradient, but only the owner of a parameter holds its optimizer state and updates it; the
owners then broadcast the updated parameters so all replicas agree again. With Adam that
cuts the optimizer's memory per rank from two model copies to about ``2/N`` of one. With
``DistributedDataParallel.shard_gradients(optimizer)`` (stage 2) each rank also receives
only the averaged gradients of the parameters it owns.

The state dict is the one part that differs from torch's: it is keyed by parameter
identity (global index, as ``torch.optim.Optimizer.state_dict`` keys it), not by rank, so a
checkpoint written at one world size loads at any other (pytorch/pytorch#65650). See
:mod:`phalanx.zero.state` for its format.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from .. import comm
from ..agreement import agree
from ..diagnostics import ledger
from ..errors import NotInitializedError
from ..uneven import Joinable
from . import clip as _clip
from . import state as _state
from .compat import (
    NO_JOIN,
    check_flags,
    run_load_post_hooks,
    run_load_pre_hooks,
    with_state_dict_hooks,
)
from .partition import partition_by_size



class ZeroAction(IntEnum):
    """What a ZeroRedundancyOptimizer shadows on a rank that has joined (phalanx.join)."""

    STEP = 1


class ZeroRedundancyOptimizer(Optimizer, Joinable):
    r"""Wraps any ``torch.optim`` optimizer so each rank keeps the state of its own share only.

    Parameters are partitioned across the ranks of ``process_group``; each rank builds a
    local ``optimizer_class`` over the parameters it owns, ``step()`` updates only those, and
    the owners then broadcast the updated values, so all replicas are identical after
    ``step()``. Parameters of 1 MiB or more are broadcast in place; smaller ones travel
    packed into byte buffers (per owner and device, any dtypes); all broadcasts are in flight
    together.

    The partition is sorted-greedy by size in bytes: parameters, largest first, each go to
    the rank holding the fewest bytes so far (ties: lower parameter index, lower rank). It is
    computed identically on every rank and each parameter belongs to exactly one rank. Hence
    per-rank optimizer state stays within ``total / N`` plus the state of the largest single
    parameter. Parameters given later to :meth:`add_param_group` are placed the same way on
    top of the current loads; earlier parameters never move.

    It behaves as a ``torch.optim.Optimizer``: ``param_groups`` lists every parameter with the
    shared hyper-parameters (change them there, e.g. through an lr scheduler; the local
    optimizer picks them up at each ``step()``), and ``zero_grad``, ``add_param_group``,
    ``step(closure)``, ``state_dict`` and ``load_state_dict`` work as users expect.

    .. note::
        Gradients must already be averaged across ranks when ``step()`` runs (DDP does
        that). Only the owners' gradients are read, so with phalanx DDP,
        ``ddp.shard_gradients(optimizer)`` (ZeRO stage 2) lets each rank receive and keep
        just those: gradient memory falls to about ``1/N`` too. :meth:`clip_grad_norm_`
        then clips by the norm of the whole gradient, which no single rank holds.

    .. note::
        :meth:`state_dict` needs :meth:`consolidate_state_dict` first, on every rank, after
        the last ``step()``, exactly as in torch. The result is keyed by global parameter
        index in param-group order (the format of ``torch.optim.Optimizer.state_dict``, plus
        parameter shapes), never by rank: it loads into a ZeRO optimizer at **any** world
        size, and into the plain, unsharded ``optimizer_class`` too. Names given with
        ``named_parameters()`` are kept in each group's ``param_names`` and checked on load.

    Args:
        params (iterable): tensors, ``(name, tensor)`` pairs, or dicts defining param groups,
            as for any ``torch.optim`` optimizer. Must be the same shapes, dtypes and order
            on every rank.
        optimizer_class (type): the ``torch.optim.Optimizer`` subclass to run on each shard,
            e.g. ``torch.optim.AdamW``.
        process_group (ProcessGroup, optional): the ranks to shard across. Default ``None``:
            the default (world) group.
        parameters_as_bucket_view (bool, optional): as in torch, the parameters of each
            owner (per device) become views into one flat buffer (``param.data`` points into
            it), so an owner's broadcast after ``step()`` is one collective of that buffer,
            whatever the parameters' dtypes. Default ``False``: parameters keep their own
            storage; large ones are broadcast one by one, small ones packed.
        overlap_with_ddp (bool, optional): must be ``False`` (torch's default); ``True`` is
            refused: phalanx's DDP runs no ``step()`` inside its communication hooks. See
            :meth:`~phalanx.DistributedDataParallel.shard_gradients`. Default ``False``.
        **defaults: hyper-parameters passed to ``optimizer_class`` (``lr=...``, ...).

    .. warning::
        Construction, ``step()``, ``add_param_group()`` and ``consolidate_state_dict()``
        are collectives: every rank of ``process_group`` must call them in the same order.
        A closure given to ``step()`` runs once per rank per local ``step()``; optimizers
        that call it a data-dependent number of times (LBFGS) would leave ranks out of step.

    .. warning::
        ``state`` holds only this rank's shard (``self.optim.state``); other ranks'
        parameters have no entry there.

    Example::

        >>> model = phalanx.DistributedDataParallel(net)
        >>> opt = phalanx.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
        >>> model.shard_gradients(opt)           # optional: ZeRO stage 2
        >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
        >>> for x, y in loader:
        ...     opt.zero_grad()
        ...     loss_fn(model(x), y).backward()
        ...     opt.clip_grad_norm_(1.0)         # optional
        ...     opt.step()
        ...     sched.step()
        >>> opt.consolidate_state_dict(to=0)     # on every rank
        >>> if phalanx.get_rank() == 0:
        ...     torch.save(opt.state_dict(), "optim.pt")   # loads at any world size
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[Optimizer],
        process_group: dist.ProcessGroup | None = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        **defaults: Any,
    ) -> None:
        check_flags(parameters_as_bucket_view, overlap_with_ddp)
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise TypeError(
                "optimizer_class must be a torch.optim.Optimizer subclass such as "
                f"torch.optim.AdamW, got {optimizer_class!r}"
            )
        if not dist.is_initialized():
            raise NotInitializedError(
                "ZeroRedundancyOptimizer needs init_process_group() to have been called"
            )
        self.process_group = process_group
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self._rank = dist.get_rank(process_group)
        self._global_ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
        # torch's public attributes: ranks within the group and in the world
        self.world_size, self.rank = len(self._global_ranks), self._rank
        self.global_rank = self._global_ranks[self._rank]
        self._buckets: list[tuple[torch.Tensor, int]] = []  # (flat buffer, owner's global rank)
        self._params: list[torch.Tensor] = []  # every parameter, by global index
        self._owners: list[int] = []  # owner (rank in process_group) by global index
        self._loads = [0] * len(self._global_ranks)  # bytes of parameters owned per rank
        self._by_owner: list[list[torch.Tensor]] = [[] for _ in self._global_ranks]
        self._local_index: list[list[int]] = []  # per group: global indices this rank owns
        self._consolidated: dict[int, dict[str, Any]] | None = None  # see consolidate_state_dict
        self._last = comm.LastWorks()  # the last step's broadcasts
        # torch.optim.Optimizer.__init__ validates the groups through add_param_group, which
        # only records them while self.optim does not exist yet.
        super().__init__(params, defaults)
        _check_same_params(self.param_groups, 0, process_group)
        self.optim = optimizer_class(self._assign(self.param_groups), **defaults)
        self.defaults = self.optim.defaults
        for group, local in zip(self.param_groups, self.optim.param_groups):
            for key, value in _hyperparameters(local).items():
                group.setdefault(key, value)
        self._build_buckets()
        self.initialized = True  # as torch's, once constructed

    @property
    def state(self) -> Any:
        """This rank's shard of the optimizer state, keyed by parameter (``self.optim.state``)."""
        return self.optim.state

    @state.setter
    def state(self, value: Any) -> None:
        # torch.optim.Optimizer.__init__ assigns an empty state before self.optim exists.
        if "optim" in self.__dict__:
            raise AttributeError(
                "ZeroRedundancyOptimizer.state is this rank's shard, owned by .optim; "
                "change it through load_state_dict()"
            )

    @property
    def param_owners(self) -> tuple[int, ...]:
        """The owner of each parameter (its rank in ``process_group``), by global index."""
        return tuple(self._owners)

    def owners_of(self, params: Iterable[torch.Tensor]) -> list[int | None]:
        """The owner of each of ``params`` (rank in ``process_group``); ``None`` for a tensor
        this optimizer does not hold."""
        owner = {id(p): o for p, o in zip(self._params, self._owners)}
        return [owner.get(id(p)) for p in params]

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip gradients by the norm of all of them, as ``torch.nn.utils.clip_grad_norm_``
        would on the whole averaged gradient (a collective: call it on every rank).

        Each rank takes the norm of the gradients of the parameters it owns; one all-reduce
        combines them (a sum of ``norm ** norm_type``, or a max for ``inf``), so it works
        whether every rank holds every averaged gradient or, with ZeRO stage 2, only the
        owners do. Every gradient of this optimizer present on this rank is then multiplied
        by ``min(1, max_norm / (total_norm + 1e-6))``.

        Args:
            max_norm (float): largest allowed norm.
            norm_type (float): the p of the p-norm; ``inf`` for the largest magnitude.
                Default ``2.0``.
            error_if_nonfinite (bool): raise if the total norm is nan or inf (on every
                rank: all see the same norm). Default ``False``.

        Returns:
            The total norm before clipping (a float32 tensor), the same on every rank.
        """
        owned = [p.grad for g in self.optim.param_groups for p in g["params"] if p.grad is not None]
        present = [p.grad for p in self._params if p.grad is not None]
        device = self._params[0].device if self._params else torch.device("cpu")
        return _clip.clip_grad_norm(owned, present, max_norm, norm_type, error_if_nonfinite,
                                         self.process_group, device)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (a collective: call it on every rank, with the same shapes).

        Its parameters get owners by the same sorted-greedy rule, on top of current loads.
        """
        super().add_param_group(param_group)
        if "optim" not in self.__dict__:  # still inside __init__
            return
        first = len(self.param_groups) - 1
        try:
            _check_same_params(self.param_groups, first, self.process_group)
        except Exception:
            self.param_groups.pop()
            raise
        [local] = self._assign(self.param_groups[first:])
        self.optim.add_param_group(local)
        self._consolidated = None
        self._build_buckets()

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:
        """Update this rank's parameters, then broadcast every owner's to all ranks.

        Args:
            closure (callable, optional): re-evaluates the model and returns the loss.
            **kwargs: passed to the local optimizer's ``step()`` as they are (as in torch).

        Returns:
            The closure's loss, if a closure was given.
        """
        self._consolidated = None
        for group, local in zip(self.param_groups, self.optim.param_groups):
            local.update(_hyperparameters(group))
        if closure is None:
            loss = self.optim.step(**kwargs)
        else:
            loss = self.optim.step(closure, **kwargs)
        book = ledger()
        with book.collective("ZeroRedundancyOptimizer.step", group=self.process_group, check=True,
                             shadow=book.shadow(self, ZeroAction.STEP)):
            self._broadcast_owned()
        return loss

    def _broadcast_owned(self) -> None:
        """Every owner's parameters to every rank: all broadcasts in flight at once."""
        if self._buckets:
            broadcasts = [dist.broadcast(flat, src, self.process_group, async_op=True)
                          for flat, src in self._buckets]
        else:
            broadcasts = [comm.broadcast_async(owned, src, self.process_group)
                          for owned, src in zip(self._by_owner, self._global_ranks)]
        for broadcast in broadcasts:
            broadcast.wait()
        self._last.hold(*broadcasts)

    # phalanx.join: a rank that has joined steps the shard it owns, with the average of the
    # active ranks' gradients (DDP's shadow writes it into .grad), and broadcasts it.
    # (join_end: nothing to sync, every step's broadcasts kept the replicas equal.)
    join_steps_with_gradients = True  # the DDP in the join writes the averages into .grad
    def join_shadow(self, action: int, verdict: Any) -> None:
        self.optim.step()  # ZeroAction.STEP, the only one
        self._broadcast_owned()

    def join_hook(self, **kwargs: Any) -> Any:
        """Refused: torch's ``Join`` (uneven inputs across ranks) is not supported."""
        raise NotImplementedError(NO_JOIN)

    @property
    def join_device(self) -> torch.device:
        """Refused with :meth:`join_hook`: only torch's ``Join`` uses it."""
        raise NotImplementedError(NO_JOIN)

    @property
    def join_process_group(self) -> Any:
        """Refused with :meth:`join_hook`: only torch's ``Join`` uses it."""
        raise NotImplementedError(NO_JOIN)

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's shard of the state on rank ``to`` (a collective).

        Afterwards, and until the next ``step()`` or load, :meth:`state_dict` works on rank
        ``to``. Tensors arrive on the CPU, as copies.

        Args:
            to (int): the receiving rank, within ``process_group``. Default ``0``.
        """
        world_size = len(self._global_ranks)
        if not isinstance(to, int) or not 0 <= to < world_size:
            raise ValueError(
                f"Invalid rank {to!r} for consolidate_state_dict(to=...), rank should be in "
                f"the interval [0, {world_size - 1}]"
            )
        index = {id(p): i for i, p in enumerate(self._params)}
        shard = {index[id(p)]: _to_cpu_copy(s) for p, s in self.optim.state.items()}
        gathered: list[Any] | None = [None] * world_size if self._rank == to else None
        dist.gather_object(shard, gathered, dst=self._global_ranks[to], group=self.process_group)
        self._consolidated = None
        if gathered is not None:
            self._consolidated = {i: s for part in gathered for i, s in part.items()}

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer state, keyed by global parameter index (see the class notes).

        Raises:
            RuntimeError: :meth:`consolidate_state_dict` was not called on every rank since
                the last ``step()``/load, or it gathered the state on another rank.
        """
        if self._consolidated is None:
            raise RuntimeError(
                f"state_dict() on rank {self._rank}: no consolidated state here. Call "
                f"consolidate_state_dict(to={self._rank}) on every rank after the last step() "
                "(state is consolidated to one rank only, and a step() makes it stale)"
            )
        return with_state_dict_hooks(self, lambda: _state.pack(
            self.param_groups, self._consolidated, self._params, len(self._global_ranks)
        ))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by :meth:`state_dict` at any world size, or by the plain
        ``optimizer_class``; each rank keeps the entries of the parameters it owns.

        Every rank must load the same dict.

        Raises:
            TypeError: ``state_dict`` is not a dict.
            ValueError: it does not fit these parameters: group count, group sizes,
                parameter names or shapes differ (the message names the first difference).
        """
        state_dict = run_load_pre_hooks(self, state_dict)
        local = _state.localize(state_dict, self.param_groups, self._params, self._local_index)
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update(_hyperparameters(saved))
        self.optim.load_state_dict(local)
        self._consolidated = None
        run_load_post_hooks(self)

    def _build_buckets(self) -> None:
        """With ``parameters_as_bucket_view``: each owner's parameters, per device, become
        views into one flat buffer (rebuilt whole when a param group is added)."""
        if not self.parameters_as_bucket_view:
            return
        self._buckets = []
        for owned, src in zip(self._by_owner, self._global_ranks):
            devices: dict[torch.device, list[torch.Tensor]] = {}
            for p in owned:
                if p.numel():
                    devices.setdefault(p.device, []).append(p)
            self._buckets += [(comm.pack_as_views(params), src) for params in devices.values()]

    def _assign(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Give ``groups``' parameters owners; return the local optimizer's groups for them."""
        params = [p for group in groups for p in group["params"]]
        sizes = [p.numel() * p.element_size() for p in params]
        owners, self._loads = partition_by_size(sizes, len(self._global_ranks), self._loads)
        for p, owner in zip(params, owners):
            self._by_owner[owner].append(p)
        start = len(self._params)
        self._params.extend(params)
        self._owners.extend(owners)
        local_groups = []
        for group in groups:
            end = start + len(group["params"])
            mine = [i for i in range(start, end) if self._owners[i] == self._rank]
            self._local_index.append(mine)
            local = _hyperparameters(group)
            local["params"] = [self._params[i] for i in mine]
            if "param_names" in group:
                local["param_names"] = [group["param_names"][i - start] for i in mine]
            local_groups.append(local)
            start = end
        return local_groups


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's settings, without the keys that name its parameters."""
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def _check_same_params(groups: list[dict[str, Any]], first: int, group: Any) -> None:
    """Raise RankMismatchError on every rank unless all ranks hold the same parameter layout."""
    items = [
        (f"param group {g} parameter {j}", (tuple(p.shape), str(p.dtype)))
        for g in range(first, len(groups))
        for j, p in enumerate(groups[g]["params"])
    ]
    agree("ZeroRedundancyOptimizer parameters", group, items=items)


def _to_cpu_copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu_copy(v) for v in value)
    return value
