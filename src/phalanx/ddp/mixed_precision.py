"""Mixed precision for DistributedDataParallel: torch's ``mixed_precision=_MixedPrecision(...)``.

``param_dtype``: the parameters stay full-precision *masters* (what the optimizer steps and
``state_dict`` holds); before each forward a low-precision copy of each floating-point
parameter is refreshed from its master and swapped in (``param.data = copy``, as torch's
DDP does), so the forward and the backward compute in ``param_dtype``; the masters are
swapped back when the backward ends. Inputs' floating-point tensors are cast to
``param_dtype`` too (torch's ``_cast_forward_inputs``).

``.grad`` keeps the masters' dtype throughout: each parameter's ``grad_dtype`` (torch's
``Tensor.grad_dtype``) is pinned to its master's, so the autograd engine casts each
low-precision gradient up (exactly: a wider float holds every narrower value) before
accumulating it. Accumulation across ``no_sync()`` backwards is therefore full precision,
and the reducer's hook, its hot path, sees nothing different.

``reduce_dtype`` (default ``param_dtype``, else the parameters' own): the dtype of the
buckets of floating-point gradients (:func:`~phalanx.ddp.bucketing.plan_buckets`). The
reducer's one batched copy into a bucket casts, and the averages are written back into
``.grad`` in the masters' dtype; where the bucket's dtype differs from ``.grad``'s, a slot
cannot *be* ``.grad`` (``gradient_as_bucket_view`` then copies back instead).

``buffer_dtype``: floating-point buffers are cast once, at construction, as torch does.

When do the masters come back? At the end of any backward that went through a forward's
outputs (a hook on them queues the swap on the autograd engine), at the end of every
synchronising backward (the reducer's end-of-backward callback), and right after a forward
whose outputs need no backward (``torch.no_grad()``, evaluation) when no earlier forward's
graph still waits for one (the hooks are held weakly: a graph thrown away waits for
nothing). Between a forward and its backward the parameters hold the low-precision copies:
the graph saved them, and activation checkpointing recomputes with them.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.parallel.distributed import _MixedPrecision

from .devices import map_tensors
from .graph_walk import iter_tensors

FIELDS = ("param_dtype", "reduce_dtype", "buffer_dtype")


def check_mixed_precision(config: Any) -> None:
    """Raise ``TypeError``/``ValueError`` unless ``config`` is ``None`` or a ``_MixedPrecision``
    of floating-point dtypes; where torch's DDP fails on the same value, with torch's words first."""
    if config is None:
        return
    if not isinstance(config, _MixedPrecision):
        raise TypeError(
            f"'{type(config).__name__}' object has no attribute 'param_dtype' (torch's words): mixed_precision "
            "must be None or a torch.nn.parallel.distributed._MixedPrecision(param_dtype=..., reduce_dtype=..., "
            f"buffer_dtype=...), got {config!r}"
        )
    for field in FIELDS:
        dtype = getattr(config, field)
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"argument 'dtype' must be torch.dtype, not {type(dtype).__name__} (torch's words): "
                            f"mixed_precision.{field} must be a torch.dtype or None, got {dtype!r}")
        if dtype is not None and not dtype.is_floating_point:
            # torch's DDP raises these words for a param_dtype that is not floating point
            raise ValueError(
                "Only Tensors of floating point and complex dtype can require gradients: "
                f"mixed_precision.{field} must be a floating-point dtype (torch.bfloat16, torch.float16, "
                f"torch.float32...), got {dtype}"
            )


def describe(config: _MixedPrecision | None) -> str:
    """What ranks compare: the three dtypes (the object's repr would do, this reads better)."""
    if config is None:
        return "None"
    return "(" + ", ".join(f"{field}={getattr(config, field)}" for field in FIELDS) + ")"


class Precision(Protocol):
    """What DistributedDataParallel asks of its parameters' precision around each forward."""

    reduce_dtype: torch.dtype | None  # the buckets' dtype for floating-point gradients (None: theirs)

    def before_forward(self, inputs: Any, kwargs: Any) -> tuple[Any, Any]: ...

    def after_forward(self, output: Any) -> Any: ...

    def restore(self) -> None: ...


class FullPrecision:
    """No mixed precision: nothing is cast."""

    reduce_dtype = None

    def before_forward(self, inputs: Any, kwargs: Any) -> tuple[Any, Any]:
        return inputs, kwargs

    def after_forward(self, output: Any) -> Any:
        return output

    def restore(self) -> None:
        pass


class MixedPrecision:
    """A module's floating-point parameters computing in ``config.param_dtype`` around full-
    precision masters (see the module notes). Casts ``module``'s floating-point buffers to
    ``config.buffer_dtype`` and pins each cast parameter's ``grad_dtype`` at construction."""

    def __init__(self, module: nn.Module, config: _MixedPrecision) -> None:
        if not hasattr(torch.Tensor, "grad_dtype"):  # a torch feature, not a type of ours
            raise RuntimeError(
                "DistributedDataParallel(mixed_precision=...) needs torch's Tensor.grad_dtype "
                f"(torch 2.10 or later), which torch {torch.__version__} lacks")
        self.param_dtype = config.param_dtype
        self.reduce_dtype = config.reduce_dtype or config.param_dtype
        if config.buffer_dtype is not None:
            for buf in module.buffers():
                if buf.is_floating_point():
                    buf.data = buf.to(config.buffer_dtype)
        dtype = self.param_dtype
        self._params = [] if dtype is None else [
            p for p in dict.fromkeys(module.parameters()) if p.is_floating_point() and p.dtype != dtype]
        for p in self._params:
            if p.requires_grad:
                p.grad_dtype = p.dtype  # .grad keeps the master's dtype (see the module notes)
        self._masters: list[torch.Tensor] | None = None  # while cast: the full-precision data
        self._lows: list[torch.Tensor] = []  # the low-precision copies, kept between steps
        self._waiting: list[weakref.ref] = []  # while cast: the forwards' graphs not yet backpropagated

    @property
    def cast(self) -> bool:
        return self._masters is not None

    @torch.compiler.disable  # bookkeeping around the module: eager, as the wrapper's
    def before_forward(self, inputs: Any, kwargs: Any) -> tuple[Any, Any]:
        """Swap the low-precision copies in, refreshed from the masters, unless they are in
        already (an earlier forward's graph still waits for its backward: the masters have
        not changed since); cast the inputs."""
        if self.param_dtype is None:
            return inputs, kwargs
        if not self.cast and self._params:
            masters = [p.data for p in self._params]  # now: a ZeRO bucket view may have replaced it
            if [m.shape for m in masters] != [low.shape for low in self._lows]:
                self._lows = [torch.empty_like(m, dtype=self.param_dtype) for m in masters]
            torch._foreach_copy_(self._lows, masters)
            for p, low in zip(self._params, self._lows):
                p.data = low
            self._masters = masters
        return _cast_inputs(inputs, self.param_dtype), _cast_inputs(kwargs, self.param_dtype)

    @torch.compiler.disable  # bookkeeping around the module: eager, as the wrapper's
    def after_forward(self, output: Any) -> Any:
        """Arrange for the masters to come back when ``output``'s backward ends; or now, if
        no backward will come, unless an earlier forward's graph still waits for one."""
        if not self.cast:
            return output
        needing = [t for t in iter_tensors(output) if t.requires_grad] if torch.is_grad_enabled() else []
        if needing:
            waiting = _AtBackward(self)
            register_multi_grad_hook(needing, waiting, mode="any")
            self._waiting.append(weakref.ref(waiting))  # alive as long as that graph is
        elif not any(ref() is not None for ref in self._waiting):
            self.restore()
        return output

    @torch.compiler.disable  # bookkeeping around the module: eager, as the wrapper's
    def restore(self) -> None:
        """The masters back into the parameters (the low-precision copies stay, for reuse)."""
        if self._masters is None:
            return
        for p, master in zip(self._params, self._masters):
            p.data = master
        self._masters = None
        self._waiting = []


class _AtBackward:
    """The hook on a forward's outputs: their backward has begun, the masters come back at
    its end. The graph holds it: a weak reference to it says whether that graph still exists."""

    __slots__ = ("precision", "__weakref__")

    def __init__(self, precision: MixedPrecision) -> None:
        self.precision = precision

    def __call__(self, grad: torch.Tensor) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self.precision.restore)


def precision_for(module: nn.Module, config: _MixedPrecision | None) -> Precision:
    return FullPrecision() if config is None else MixedPrecision(module, config)


def _cast_inputs(obj: Any, dtype: torch.dtype) -> Any:
    """``obj`` with its floating-point tensors cast to ``dtype`` (torch's ``_cast_forward_inputs``)."""
    return map_tensors(obj, lambda t: t.to(dtype) if t.is_floating_point() else t)
