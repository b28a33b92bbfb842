"""Local SGD and DiLoCo: each rank trains alone, the model is averaged every ``every`` steps.

Gradients are never all-reduced: a rank's steps use its own gradients, and every ``every``
optimizer steps the ranks meet once. :class:`LocalSGD` (Stich, 2019; Lin et al., 2020)
replaces the parameters by their average. :class:`DiLoCo` (Douillard et al., 2023) keeps
the parameters of the last meeting (the "global" ones) and treats ``global - average``, the
averaged pseudo-gradient, as the gradient of an outer optimizer (Nesterov momentum SGD);
the outer step's result is every rank's new starting point. Communication falls by a
factor ``every``: on a slow link, the step costs about its compute.

**Overlap.** With ``overlap=k`` (``1 <= k <= every``) a meeting does not stop the training:
its all-reduces are issued at the meeting's step and the ranks go on with ``k`` more local
steps while they travel; the ``k``-th applies the meeting, keeping what each rank learnt
meanwhile: LocalSGD's parameters become ``average + (now - then)`` (``then``: this rank's
parameters when the meeting began), DiLoCo's become ``outer step result + (now - then)``
(the "overlapping communication" of Streaming DiLoCo, Douillard et al., 2025, with the
local progress carried over instead of mixed). The communication then costs no step time
while ``k`` steps of compute outlast it; the price is two more copies of the model while a
meeting is under way, and an average that is ``k`` steps old when it lands. ``overlap=0``
(the default) is the algorithm as published: the ranks wait at every meeting. A meeting
still under way when the training ends lands with :meth:`~LocalSGD.finish_meeting` (or
:meth:`~LocalSGD.synchronize`, which then meets once more).

Both compose with phalanx's or torch's DDP (whose gradient averaging they switch off:
``require_backward_grad_sync = False``, so every backward is local, as in ``no_sync()``)
or with a plain module (whose parameters and buffers they broadcast from rank 0 first).
Floating-point buffers (BatchNorm statistics) are averaged at each meeting too.

Each meeting (and a plain module's first broadcast) starts with a sync point of
:mod:`phalanx.diagnostics` and is one record of the collective log: ranks that reach it at
different steps raise :class:`~phalanx.errors.CollectiveMismatchError` instead of averaging
mismatched tensors. Inside ``phalanx.join`` a rank that has joined cannot take part in a
meeting (its stale parameters would pull the average): it raises a ``UsageError`` there.

Their :meth:`state_dict` is this rank's: the step count, the optimizer's state (momentum
differs between ranks), the parameters between meetings, a meeting under way (waited for,
with its averages), and DiLoCo's outer state; give
the object to :class:`~phalanx.Checkpointer` as ``comm_state=`` and a resumed run
continues exactly, wherever it stopped in the period.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..comm_hooks.lowprec import DTYPES, average_16bit
from ..diagnostics import ledger
from ..hooks import Phases, Running
from ..ledger import Collective


def _module_and_group(model: nn.Module, group: dist.ProcessGroup | None) -> tuple[nn.Module, Any, bool]:
    """The module to average, the group to average over, and whether ``model`` is a DDP."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (or a DDP of one), got {type(model).__name__}")
    # phalanx's DDP is a (virtual) subclass of torch's: both are wrappers
    wrapped = isinstance(model, nn.parallel.DistributedDataParallel)
    if wrapped and group is None:
        group = model.process_group
    return (model.module if wrapped else model), group, wrapped


def _flats(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by (device, dtype), each group reduced together."""
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        groups[(t.device, t.dtype)].append(t)
    return list(groups.values())


def _average(flat: torch.Tensor, group: dist.ProcessGroup | None, compress: str | None = None,
             memory: dict | None = None) -> Phases:
    """The phases that replace ``flat`` by its average over ``group`` (16-bit on the wire with
    ``compress``, :func:`~phalanx.comm_hooks.average_16bit`); returns ``flat``."""
    if compress is not None:
        return (yield from average_16bit(flat, DTYPES[compress], group, memory))
    yield dist.all_reduce(flat, group=group, async_op=True)
    return flat.div_(dist.get_world_size(group))


def _cat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


class _Meeting:
    """A meeting under way: the averagings issued (one per flat), what each was taken from
    (with ``overlap``), the step that applies it, its record in the collective log."""

    def __init__(self, record: Collective | None, runs: list[Running], taken: list[torch.Tensor | None],
                 apply_at: int) -> None:
        self.record, self.runs, self.taken, self.apply_at = record, runs, taken, apply_at
        self._averages: list[torch.Tensor] | None = None

    @classmethod
    def landed(cls, averages: list[torch.Tensor], taken: list[torch.Tensor | None], apply_at: int) -> _Meeting:
        """A meeting whose averages are known (restored from a checkpoint)."""
        meeting = cls(None, [], taken, apply_at)
        meeting._averages = averages
        return meeting

    def averages(self) -> list[torch.Tensor]:
        """Wait for the averagings, in the order they were issued; their results."""
        if self._averages is None:
            with self.record.guard():
                for run in self.runs:
                    while not run.done:
                        run.advance()
            self._averages = [run.result for run in self.runs]
            self.record.end()
        return self._averages


class _Periodic:
    """What LocalSGD and DiLoCo share: arguments, step counting, meetings, buffers, state; a
    meeting averages the parameters (LocalSGD's), unless :meth:`_message` and :meth:`_apply`
    say otherwise (DiLoCo's)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, every: int,
                 group: dist.ProcessGroup | None, overlap: int = 0) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive number of steps, got {every!r}")
        if isinstance(overlap, bool) or not isinstance(overlap, int) or not 0 <= overlap <= every:
            raise ValueError(f"overlap must be a number of steps from 0 to every ({every}), got {overlap!r}")
        if not hasattr(optimizer, "step") or not hasattr(optimizer, "state_dict"):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.module, self.group, wrapped = _module_and_group(model, group)
        self.model, self.optimizer, self.every, self.overlap = model, optimizer, every, overlap
        self.params = [p for p in dict.fromkeys(self.module.parameters()) if p.requires_grad]
        self._groups = _flats(self.params)
        self.steps = 0
        self._meeting: _Meeting | None = None
        if wrapped:
            model.require_backward_grad_sync = False  # every backward is local
        else:  # the replicas start equal, as under DDP
            with torch.no_grad():
                tensors = list(self.module.parameters()) + list(self.module.buffers())
                with ledger().collective(f"{type(self).__name__} initial broadcast", tensors, self.group,
                                         check=True):
                    comm.broadcast_tensors(tensors, src=_rank_zero(self.group), group=self.group)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """``optimizer.step(closure)``; every ``every``-th call, then the ranks meet (with
        ``overlap``: the meeting ``overlap`` calls earlier lands first)."""
        loss = self.optimizer.step() if closure is None else self.optimizer.step(closure)
        self.steps += 1
        if self._meeting is not None and self.steps >= self._meeting.apply_at:
            self._land()
        if self.steps % self.every == 0:
            self._launch(self.overlap)
            if not self.overlap:
                self._land()
        return loss

    def synchronize(self) -> None:
        """Meet now (a collective), also outside the schedule; a meeting under way lands first."""
        self.finish_meeting()
        self._launch(0)
        self._land()

    def finish_meeting(self) -> bool:
        """Apply a meeting under way now, waiting for its communication (with ``overlap``: at
        the end of training, or before evaluating); whether there was one. Every rank must
        call it at the same step, as a meeting is the same on every rank."""
        if self._meeting is None:
            return False
        self._land()
        return True

    def _buffers(self) -> list[torch.Tensor]:
        return [b for b in self.module.buffers() if b.is_floating_point()]

    @torch.no_grad()
    def _launch(self, overlap: int) -> None:
        """Issue the meeting's averagings: the parameters' (:meth:`_message`), then the
        floating-point buffers' (BatchNorm statistics)."""
        buffers = _flats(self._buffers())
        record = ledger().collective(f"{type(self).__name__} meeting",
                                     self.params + [b for bs in buffers for b in bs], self.group, check=True)
        runs, taken = [], []
        with record.guard():
            for i, tensors in enumerate(self._groups + buffers):
                flat = _cat(tensors)
                taken.append(flat.clone() if overlap else None)
                runs.append(Running(self._message(i, flat) if i < len(self._groups) else _average(flat, self.group)))
        self._meeting = _Meeting(record, runs, taken, self.steps + overlap)

    @torch.no_grad()
    def _land(self) -> None:
        """Apply the meeting under way: the parameters' (:meth:`_apply`), and the buffers, each
        replaced by its average plus this rank's change since the meeting began."""
        meeting, self._meeting = self._meeting, None
        averages, taken = meeting.averages(), meeting.taken
        k = len(self._groups)
        self._apply(averages[:k], taken[:k])
        _replace(_flats(self._buffers()), averages[k:], taken[k:])

    def _message(self, i: int, flat: torch.Tensor) -> Phases:
        """What parameter flat ``i`` (this rank's values in ``flat``) sends: LocalSGD its values."""
        return _average(flat, self.group)

    def _apply(self, averages: list[torch.Tensor], taken: list[torch.Tensor | None]) -> None:
        """Apply the parameters' averaged messages: LocalSGD takes the averages."""
        _replace(self._groups, averages, taken)

    def state_dict(self) -> dict[str, Any]:
        """This rank's state (see the module notes): a collective only in that nothing is
        exchanged; a meeting under way is waited for and saved with its averages."""
        state = {"steps": self.steps, "optimizer": self.optimizer.state_dict()}
        if self.steps % self.every or self._meeting is not None:  # the ranks' parameters differ
            state["params"] = [p.detach().clone() for p in self.params]
        if self._meeting is not None:
            state["meeting"] = {"apply_at": self._meeting.apply_at,
                                "averages": [t.clone() for t in self._meeting.averages()],
                                "taken": [None if t is None else t.clone() for t in self._meeting.taken]}
        return state

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned on this rank."""
        self.steps = int(state["steps"])
        self.optimizer.load_state_dict(state["optimizer"])
        if "params" in state:
            if len(state["params"]) != len(self.params):
                raise ValueError(f"the state holds {len(state['params'])} parameters, the model {len(self.params)}")
            for p, saved in zip(self.params, state["params"]):
                p.copy_(saved)
        meeting = state.get("meeting")
        self._meeting = None if meeting is None else _Meeting.landed(
            [t.clone() for t in meeting["averages"]],
            [None if t is None else t.clone() for t in meeting["taken"]], int(meeting["apply_at"]))


def _replace(groups: Sequence[Sequence[torch.Tensor]], averages: Sequence[torch.Tensor],
             taken: Sequence[torch.Tensor | None]) -> None:
    """Each group of tensors becomes its average plus its progress since the meeting began."""
    for tensors, average, then in zip(groups, averages, taken):
        _unflatten(_plus_progress(average, tensors, then), tensors)


def _plus_progress(average: torch.Tensor, tensors: Sequence[torch.Tensor], then: torch.Tensor | None) -> torch.Tensor:
    """``average`` plus what ``tensors`` moved since ``then`` (their value when the meeting
    began; ``None``: a meeting that did not overlap, so nothing moved)."""
    if then is None:
        return average
    return average.add_(torch.sub(_cat(tensors), then, out=then))


class LocalSGD(_Periodic):
    """Local SGD: every rank steps alone; every ``every`` steps the parameters are averaged.

    .. note::
        Use :meth:`step` instead of ``optimizer.step()``. With a DDP model, the DDP no longer
        averages gradients (``require_backward_grad_sync`` is set to ``False``); a plain
        module gets rank 0's parameters and buffers at construction (a collective). The
        optimizer's state (momentum) stays each rank's own, as in torch's
        ``PostLocalSGDOptimizer``.

    Args:
        model (nn.Module): phalanx's or torch's DDP, or a plain module, the same on every rank.
        optimizer (Optimizer): the optimizer over its parameters.
        every (int): optimizer steps between two averagings.
        group (ProcessGroup, optional): default: the DDP's group, or the default group.
        overlap (int): local steps a meeting's communication runs behind before it is applied
            (module notes); ``0`` (default): wait for it at the meeting.

    Example::

        >>> ddp = phalanx.DistributedDataParallel(net)
        >>> opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        >>> local = phalanx.LocalSGD(ddp, opt, every=8)
        >>> for x, y in loader:
        ...     opt.zero_grad()
        ...     loss_fn(ddp(x), y).backward()   # this rank's gradients only
        ...     local.step()                    # opt.step(); every 8th: average the parameters
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, every: int,
                 group: dist.ProcessGroup | None = None, overlap: int = 0) -> None:
        super().__init__(model, optimizer, every, group, overlap)


class DiLoCo(_Periodic):
    """DiLoCo: local steps of the inner optimizer, then an outer Nesterov step every ``every``.

    At each meeting the averaged pseudo-gradient ``global - mean(local parameters)`` (where
    ``global`` are the parameters of the last meeting) is the gradient of an outer
    ``torch.optim.SGD(lr=outer_lr, momentum=outer_momentum, nesterov=True)`` over the global
    parameters, whose result every rank continues from.

    .. note::
        As :class:`LocalSGD`: call :meth:`step` instead of ``inner_optimizer.step()``. DiLoCo
        keeps the global parameters and the outer momentum: two more copies of the model
        per rank.

    Args:
        model (nn.Module): phalanx's or torch's DDP, or a plain module.
        inner_optimizer (Optimizer): each rank's optimizer (the paper: AdamW).
        every (int): inner steps per outer step (the paper: 500; on a slow link, as many as
            it takes to hide the meeting).
        outer_lr (float): default ``0.7`` (the paper's).
        outer_momentum (float): default ``0.9`` (the paper's, for runs of thousands of steps;
            in a run of about a hundred steps 0.5 kept the accuracy that 0.9 lost:
            docs/benchmarks.md).
        group (ProcessGroup, optional): default: the DDP's group, or the default group.
        compress (str, optional): ``"bf16"`` or ``"fp16"`` to send the pseudo-gradients as
            16-bit values (:func:`~phalanx.comm_hooks.average_16bit`); default ``None``: fp32.
        overlap (int): inner steps a meeting's communication runs behind before the outer
            step is applied (module notes); ``0`` (default): wait for it at the meeting.

    Example::

        >>> opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        >>> diloco = phalanx.DiLoCo(ddp, opt, every=16, outer_lr=0.7, outer_momentum=0.9)
        >>> for x, y in loader:
        ...     opt.zero_grad()
        ...     loss_fn(ddp(x), y).backward()
        ...     diloco.step()
    """

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer, every: int,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 group: dist.ProcessGroup | None = None, compress: str | None = None, overlap: int = 0) -> None:
        if compress is not None and compress not in DTYPES:
            raise ValueError(f"compress must be None or one of {sorted(DTYPES)}, got {compress!r}")
        super().__init__(model, inner_optimizer, every, group, overlap)
        self.compress = compress
        self.global_params = [_cat(ts) for ts in self._groups]
        self.outer_optimizer = torch.optim.SGD(self.global_params, lr=outer_lr, momentum=outer_momentum,
                                               nesterov=outer_momentum > 0)
        self._scales: list[dict] = [{} for _ in self._groups]  # fp16's agreed scales (average_16bit)

    def _message(self, i: int, flat: torch.Tensor) -> Phases:
        pseudo_gradient = torch.sub(self.global_params[i], flat, out=flat)
        return _average(pseudo_gradient, self.group, self.compress, self._scales[i])

    def _apply(self, averages: list[torch.Tensor], taken: list[torch.Tensor | None]) -> None:
        for outer, average in zip(self.global_params, averages):
            outer.grad = average
        self.outer_optimizer.step()
        for tensors, outer, then in zip(self._groups, self.global_params, taken):
            outer.grad = None
            _unflatten(outer if then is None else _plus_progress(outer.clone(), tensors, then), tensors)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "global": [t.clone() for t in self.global_params],
                "outer_optimizer": self.outer_optimizer.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        for mine, saved in zip(self.global_params, state["global"]):
            mine.copy_(saved)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        if "params" not in state:  # saved at a meeting that landed: the parameters are the global ones
            for tensors, outer in zip(self._groups, self.global_params):
                _unflatten(outer, tensors)


def _unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def _rank_zero(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_global_rank(group, 0)
