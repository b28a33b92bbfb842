"""``FSDPModule``: the class a module takes on under ``fully_shard`` (``FSDP<Class>``), with
torch's methods to gather, free and stop synchronising its parameters by hand."""

from __future__ import annotations

import functools
from typing import Any, Iterator

from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

from ..ledger.syncpoint import Verdict
from ..uneven import Joinable
from . import joining
from .compile import eager_hook
from .unit import UNIT_ATTRIBUTE, Unit, unit_of
from .values import adopt

# torch's FSDPModule methods phalanx does not offer yet: calling one raises, naming it.
NOT_YET = ("set_custom_all_gather", "set_custom_reduce_scatter", "set_all_reduce_hook",
           "set_gradient_divide_factor", "set_reduce_scatter_divide_factor",
           "set_requires_all_reduce", "set_post_optim_event", "set_unshard_in_backward",
           "set_force_sum_reduction_for_comms",
           "reset_iter_state", "set_is_last_backward", "set_reduce_scatter_max_input_buffers",
           "set_separate_reduce_scatter_group", "set_allocate_memory_from_process_group_for_comm",
           "set_symm_mem_for_comm")


def _not_yet(name: str) -> Any:
    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(f"phalanx's FSDPModule does not support {name}() yet: "
                         "torch's fully_shard offers it")
    refuse.__name__ = name
    refuse.__doc__ = f"Not supported yet: raises ``ValueError`` (torch's ``FSDPModule.{name}``)."
    return refuse


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.method_name`` gather the unit's parameters before it runs and reshard
    after, as ``forward`` does (a ``generate()`` that does not go through ``forward``).
    A module that is not an :class:`FSDPModule` is left as it is (torch's)."""
    if not isinstance(module, FSDPModule):
        return
    method = getattr(module, method_name, None)
    if method is None:
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    unit = module._unit()
    pre_forward, post_forward = eager_hook(unit.pre_forward), eager_hook(unit.post_forward)

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = pre_forward(module, args, kwargs)
        return post_forward(module, args, method(*args, **kwargs))

    setattr(module, method_name, wrapped)


def _units_of(modules: list[Any]) -> list[Unit]:
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"Expects FSDPModule but got {type(module)}: {module}")
    return [module._unit() for module in modules]


class TorchStateView:
    """A unit seen as torch's ``FSDPState``, for torch's helpers that take an ``FSDPModule``:
    ``_pre_forward`` and ``_post_forward`` (torch's ``register_fsdp_forward_method``) run the
    unit's; any other attribute of torch's state raises ``ValueError`` naming it, rather than
    a helper acting on half a state."""

    def __init__(self, unit: Unit) -> None:
        self._pre, self._post = eager_hook(unit.pre_forward), eager_hook(unit.post_forward)
        self._name = unit.name

    def _pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        return self._pre(module, args, kwargs)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        return self._post(module, args, output)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # (copy, pickle, hasattr probes: the usual answer)
            raise AttributeError(name)
        raise ValueError(
            f"torch's FSDP state has no {name!r} on a phalanx.fully_shard unit ({self._name}): "
            "the torch.distributed.fsdp helper that asks for it works on torch's fully_shard "
            "only; phalanx.fsdp offers register_fsdp_forward_method and clip_grad_norm_")


class UnshardHandle:
    """A pending :meth:`FSDPModule.unshard` (``async_op=True``): :meth:`wait` lands it."""

    def __init__(self, unit: Unit) -> None:
        self._unit: Unit | None = unit

    def wait(self) -> None:
        """Wait for the all-gather and put the unsharded parameters on the module."""
        if self._unit is not None:
            self._unit.wait_for_unshard()
            self._unit = None


class FSDPModule(TorchFSDPModule):
    """What ``phalanx.fully_shard`` makes of a module: ``FSDP<Class>`` derives from this
    class and from the module's own class, as torch's ``fully_shard`` does.

    It derives from torch's ``torch.distributed.fsdp.FSDPModule``, so that
    ``isinstance(module, torch.distributed.fsdp.FSDPModule)`` holds (torch's FSDP2 example
    asserts it), and overrides every method of it: those phalanx does not offer raise
    ``ValueError`` naming them. torch's helpers that reach for torch's internal state
    (``_get_fsdp_state``) get a :class:`TorchStateView`: torch's
    ``register_fsdp_forward_method`` works; what else they ask of it raises, naming it.

    The root module takes part in ``phalanx.join(model, optimizer)`` (uneven inputs): a rank
    that has joined sends its shards into the others' all-gathers, zeros into their
    reduce-scatters, and steps the optimizer on its shards with the averages
    (:mod:`phalanx.fsdp.joining`).

    The module's parameters are sharded DTensors except while its unit is unsharded (during
    its forward and backward, or after :meth:`unshard`). The methods act on this module's
    unit only, or on every unit below it with ``recurse``.

    Example::

        >>> model.set_requires_gradient_sync(False)   # accumulate: no reduce-scatter
        >>> loss_of(model, micro_batch_1).backward()
        >>> model.set_requires_gradient_sync(True)    # this backward reduces the sum
        >>> loss_of(model, micro_batch_2).backward()
    """

    # Index in the method resolution order of the module's own class:
    # [FSDP<Class>, FSDPModule, torch's FSDPModule, Class, ...] (torch's name for it too)
    _ORIG_CLASS_INDEX = 3
    _orig_cls_mro_index = _ORIG_CLASS_INDEX

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """A new module of the original class (indexing a sharded ``nn.Sequential`` builds
        one through its class), as torch's."""
        orig = cls.__mro__[cls._ORIG_CLASS_INDEX]
        self = orig.__new__(orig)
        self.__init__(*args, **kwargs)
        return self

    def _unit(self) -> Unit:
        return self.__dict__[UNIT_ATTRIBUTE]

    def _units(self, recurse: bool) -> list[Unit]:
        modules = self.modules() if recurse else [self]  # type: ignore[attr-defined]
        return [u for u in dict.fromkeys(map(unit_of, modules)) if u is not None]

    def reshard(self) -> None:
        """Free the unsharded parameters and put the sharded ones back on the module (not
        recursive)."""
        self._unit().reshard()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather the parameters and put them, unsharded, on the module (not recursive).

        Args:
            async_op (bool): return a handle whose ``wait()`` lands the all-gather (the next
                forward waits for it anyway). Default ``False``: wait here.
        """
        unit = self._unit()
        unit.unshard()
        handle = UnshardHandle(unit)
        if async_op:
            return handle
        handle.wait()
        return None

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Whether the next backwards reduce-scatter gradients. ``False``: each unit keeps its
        whole unsharded gradient (as a replica would) and sends nothing; the next backward
        with ``True`` reduces their sum.

        Args:
            requires_gradient_sync (bool): reduce (``True``) or accumulate locally.
            recurse (bool): for every unit below this module too. Default ``True``.
        """
        for unit in self._units(recurse):
            unit.reduce_grads = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether the units free their unsharded parameters after the forward (the root's
        default, ``False``, included)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}")
        for unit in self._units(recurse):
            unit.auto_reshard = False
            unit.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Whether the units free their unsharded parameters after the backward (``False``
        saves the next forward's all-gather during accumulation, at their memory)."""
        for unit in self._units(recurse):
            unit.reshard_after_backward = reshard_after_backward

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *,
                                         recurse: bool = True) -> None:
        """Whether a trainable parameter without a gradient in a backward takes part in the
        reduce-scatter with zeros, so that ranks using different parameters (a branch taken
        on some ranks only) still send the same sizes. Default ``False`` (torch's): such a
        parameter is left out, and its ``.grad`` stays ``None`` when no rank used it."""
        for unit in self._units(recurse):
            unit.reduce_unused = reduce_scatter_unused_params

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """The units whose all-gather this unit starts once it has its parameters in the
        forward, instead of the default (the unit that ran next in the previous iteration)."""
        self._unit().forward_prefetch = _units_of(modules)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """The units whose all-gather this unit starts once it has its parameters in the
        backward, instead of the default (the unit whose forward ended before its own)."""
        self._unit().backward_prefetch = _units_of(modules)

    # ---- phalanx.join (uneven inputs): joining.py ------------------------------------------
    def join_begin(self, join: Any) -> None:
        """The join starts: this module's units announce their collectives."""
        self.__dict__["_phalanx_fsdp_join"] = joining.begin(self, self._units(recurse=True), join)

    def join_shadow(self, action: int, verdict: Verdict) -> None:
        """On a rank that has joined: take part in the others' ``action``."""
        self.__dict__["_phalanx_fsdp_join"].shadow(action, verdict.announce[3:])

    def join_end(self, join: Any, last: int) -> None:
        """Every rank has joined: the shards are current on every rank already."""

    def join_leave(self) -> None:
        """The join is over: collectives are no longer announced."""
        part = self.__dict__.pop("_phalanx_fsdp_join", None)
        if part is not None:
            part.leave()

    def join_flags(self) -> tuple[int, int] | None:
        """No signals of its own for preemption checks."""
        return None

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """``nn.Module._apply`` (``.to()``, ``.float()``, ``.to_empty()``...): the shards stay
        where they are (they view one flat buffer per unit) when ``fn`` keeps their dtype and
        device; a conversion is refused before anything changes. Buffers and parameters
        outside the units are ``fn``'s."""
        units = self._units(recurse=True)
        for unit in units:
            flat = unit.params.flat
            probe = fn(flat[:0])
            if probe.dtype != flat.dtype or probe.device != flat.device:
                raise ValueError(
                    f"phalanx.fully_shard does not support converting a sharded module yet "
                    f"({flat.dtype} on {flat.device} to {probe.dtype} on {probe.device}): "
                    "move or convert the module before fully_shard")
        kept = {id(p) for u in units for s in u.params.slots for p in (s.sharded, s.unsharded)}
        # (nn.Module's, past torch's FSDPModule._apply, which needs torch's state)
        out = super(TorchFSDPModule, self)._apply(  # type: ignore[misc]
            lambda t: t if id(t) in kept else fn(t), recurse)
        for unit in units:  # new Parameter objects (overwrite_module_params_on_conversion)
            adopt(unit.params, unit.name)
        return out

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
                         ) -> Iterator[tuple[str, nn.Parameter]]:
        """``nn.Module.named_parameters``, the units' own sharded Parameters first put back
        where a module holds another shard in their place (a ``setattr``): an optimizer built
        now steps the Parameters the units train (:mod:`phalanx.fsdp.values`)."""
        for unit in self._units(recurse=True):
            adopt(unit.params, unit.name)
        return super(TorchFSDPModule, self).named_parameters(  # type: ignore[misc]
            prefix, recurse, remove_duplicate)

    def _get_fsdp_state(self) -> TorchStateView:
        """What torch's helpers reach for on an ``FSDPModule`` (torch's ``FSDPState``): the
        unit's pre- and post-forward, so that torch's ``register_fsdp_forward_method`` works
        as phalanx's; any other attribute raises, naming it."""
        return TorchStateView(self._unit())

    for _name in NOT_YET + ("_set_unshard_async_op",):
        locals()[_name] = _not_yet(_name)
    del _name


# A Joinable without Joinable in its method resolution order (an ABC there would change the
# instance layout of FSDP<Class>, and __class__ could no longer be swapped): the methods above.
Joinable.register(FSDPModule)
