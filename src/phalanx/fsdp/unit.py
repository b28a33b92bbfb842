"""One ``fully_shard`` unit: its parameters' all-gather before the forward (and the
backward), the reshard after them, and the reduce-scatter of its gradients.

The life of a unit in one iteration (torch's FSDP2 order):

* **pre-forward** (a forward pre-hook): all-gather the shards into the unsharded buffer and
  put the unsharded parameters on the modules. The first unit to run forward is the root
  (:meth:`Unit.lazy_init`): it finds the units below it and shares an :class:`Iteration`
  with them.
* **post-forward** (a forward hook): reshard (``reshard_after_forward``; the root keeps its
  parameters by default) and hook the outputs: the gradient reaching them starts this
  unit's backward.
* **pre-backward** (that tensor hook): all-gather again if resharded.
* **post-backward**: when the last of its parameters has accumulated its gradient (a
  post-accumulate-grad hook on each unsharded parameter), the unsharded gradients go into
  one flat buffer (torch's layout; zeros for a trainable parameter this rank has no
  gradient for, and a flag per parameter, so that every rank sends the same sizes), are
  freed, and one reduce-scatter (averaging over the ranks) starts; the parameters are
  resharded. HSDP (a 2-D mesh): the reduce-scatter runs within the replica, and once it has
  landed (checked at the next unit's) one all-reduce averages its output across the replicas.
* **end of backward** (an autograd-engine callback, queued by the first pre-backward):
  units whose backward did not finish (parameters without gradients) finish now; every
  reduce-scatter is waited for and its slices become the sharded ``.grad`` DTensors
  (accumulated into existing ones). A unit the backward did not reach is resharded and
  keeps its reduce-scatter for the backward that does (torch's chunked loss: a head run on
  its own on chunks of a detached output, one backward per chunk, then the trunk's); a
  unit with gradients reduces them in each backward (several through a retained graph).

A unit of several modules (``fully_shard([a, b])``) hooks each of them: the first to run
in a pass does the pre-forward, the last the post-forward (the others only cast inputs and
outputs); modules that did not run when the root's forward ends complete then, with the
root's output (torch's grouped hooks: a head called by itself on chunks of the output);
a module run on its own after that has no pre-backward: its gradients queue the end of
the backward, which reduces them.

``set_requires_gradient_sync(False)`` keeps the unsharded gradients (on every rank, the
whole unit's) instead of reducing them; the next synchronised backward reduces their sum.
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from .compile import eager_hook, refuse_compiled_autograd
from .collectives import Pending, all_gather, chunk_cat, reduce_scatter
from .iteration import Iteration, Reduction, Stage, division, synchronize_offload
from .joining import FSDPAction, JoinPart
from .params import Params, Slot
from .values import adopt


# Where a module keeps its unit (in its __dict__: not a parameter, buffer or submodule).
UNIT_ATTRIBUTE = "_phalanx_fsdp_unit"


def unit_of(module: nn.Module) -> Unit | None:
    """The unit ``fully_shard`` made of ``module``, if any."""
    return module.__dict__.get(UNIT_ATTRIBUTE)


class Unit:
    """The state of one ``fully_shard`` call (see the module notes)."""

    def __init__(self, modules: tuple[nn.Module, ...], params: Params,
                 reshard_after_forward: bool | None, mp_policy: MixedPrecisionPolicy,
                 originals: Sequence[nn.Parameter] = ()) -> None:
        self.modules, self.params, self.mp_policy = modules, params, mp_policy
        # the parameters fully_shard replaced, by weak reference (one object per parameter,
        # which CPython hands out to every caller: it identifies a parameter after its death,
        # where an id() may be reused): a parameter in two units is refused (lazy_init)
        self.originals = tuple(weakref.ref(p) for p in originals)
        # torch's clamping (FSDPParam.init_dtype_attrs): no cast where none is needed
        reduce_dtype = mp_policy.reduce_dtype
        self.reduce_dtype = None if reduce_dtype == params.compute_dtype else reduce_dtype
        self._grad_sums: dict[int, torch.Tensor] = {}  # slot: gradient summed in reduce_dtype
        mesh = params.mesh  # (HSDP: shards across the last dimension, replicas across the first)
        self.group = mesh.get_group(mesh.ndim - 1)
        self.replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None
        self.auto_reshard = reshard_after_forward is None
        self.reshard_after_forward = True if reshard_after_forward is None else reshard_after_forward
        self.reshard_after_backward = True
        self.reduce_grads = True
        self.reduce_unused = False  # set_reduce_scatter_unused_params: zeros for missing gradients
        self.stage = Stage.IDLE
        self.is_root: bool | None = None
        # its path under the root (the paths, several modules), from lazy_init on
        self.name = ", ".join(type(m).__name__ for m in modules)
        self.iteration: Iteration | None = None
        self._gathering: tuple[Pending, torch.Tensor] | None = None
        self._remaining = 0
        self._forward_since_reduce = False
        # set_modules_to_forward_prefetch / _backward_prefetch: these units instead of the
        # next ones (iteration.py)
        self.forward_prefetch: list[Unit] | None = None
        self.backward_prefetch: list[Unit] | None = None
        self.join: JoinPart | None = None  # inside phalanx.join (joining.py)
        # fully_shard([a, b]): the modules that have not run forward yet in this pass (torch's
        # _modules_to_run_forward); the unit's post-forward runs after the last of them
        self.to_run: set[nn.Module] = set()
        for module in modules:
            module.register_forward_pre_hook(eager_hook(self._group_pre_forward), prepend=True,
                                             with_kwargs=True)
            module.register_forward_hook(eager_hook(self._group_post_forward), always_call=len(modules) > 1)
        for s in params.slots:
            if s.sharded.requires_grad:
                s.unsharded.register_post_accumulate_grad_hook(eager_hook(self._accumulated))
        for module_with_params in {m for s in params.slots for m, _ in s.locations}:
            module_with_params.register_state_dict_pre_hook(self._reshard_hook)
            module_with_params.register_load_state_dict_pre_hook(self._reshard_hook)
            module_with_params.register_load_state_dict_post_hook(self._adopt_hook)  # (values.py)

    # ---- the root -------------------------------------------------------------------------
    def lazy_init(self) -> None:
        """The first unit to run forward becomes the root of the units below it."""
        if self.is_root is not None:
            return
        if len(self.modules) > 1:
            raise RuntimeError(f"FSDP requires a single root module but got {self.modules}: a unit "
                               "of several modules (fully_shard([a, b])) runs inside a root; "
                               "fully_shard the model that calls them too")
        names: dict[Unit, list[str]] = {}
        paths: dict[nn.Module, str] = {}
        for name, module in self.modules[0].named_modules():
            paths[module] = name
            unit = unit_of(module)
            if unit is None:
                continue
            if unit not in names and unit is not self and unit.is_root is not None:
                raise RuntimeError(f"FSDP state has already been lazily initialized for {name}\n"
                                   "FSDP requires running forward through the root module first")
            names.setdefault(unit, []).append(name or "(root)")
        units = list(names)
        _refuse_shared(names, paths)
        for unit, paths_of_unit in names.items():
            unit.is_root = unit is self
            unit.name = ", ".join(paths_of_unit)
        if self.auto_reshard:  # the root's parameters are needed again at once by the backward
            self.reshard_after_forward = False
        iteration = Iteration(units)
        for unit in units:
            unit.iteration = iteration

    # ---- all-gather and reshard -----------------------------------------------------------
    def unshard(self) -> None:
        """Start the all-gather (no-op if unsharded or under way)."""
        p = self.params
        if p.unsharded or self._gathering is not None:
            return
        if not p.slots:
            p.register(sharded=False)  # nothing to gather
            return
        adopt(p, self.name)  # values set on the modules in the shards' place (values.py)
        output = torch.empty(p.flat.numel() * p.world, dtype=p.compute_dtype, device=p.device)
        pending = all_gather(output, p.gather_input(), self.group, self.name,
                             shadow=self._shadow(FSDPAction.ALL_GATHER))
        self._gathering = (pending, output)

    def _shadow(self, action: FSDPAction) -> tuple[int, ...] | None:
        """How a rank that has joined takes part in this unit's ``action`` (joining.py)."""
        return None if self.join is None else self.join.announce(self, action)

    # ---- a rank that has joined (phalanx.join): the others' collectives, shadowed ---------
    def shadow_all_gather(self) -> None:
        """Send this rank's shard into the others' all-gather; drop what comes back."""
        p = self.params
        output = torch.empty(p.flat.numel() * p.world, dtype=p.compute_dtype, device=p.device)
        all_gather(output, p.gather_input(), self.group, self.name, announced=True).wait()

    def shadow_reduce_scatter(self) -> None:
        """Send zeros into the others' reduce-scatter; this rank's averaged rows go into its
        sharded ``.grad``, as on the others."""
        trainable = [(i, s) for i, s in enumerate(self.params.slots) if s.sharded.requires_grad]
        self._reduce(trainable, announced=True).finish()
        if self.params.pinned:
            synchronize_offload({self.params.device})

    def clear_sharded_grads(self) -> None:
        for s in self.params.slots:
            s.sharded.grad = None

    def wait_for_unshard(self) -> None:
        if self._gathering is None:
            return
        (pending, output), self._gathering = self._gathering, None
        pending.wait()
        if self.iteration is not None:
            self.iteration.last.hold(pending)
        self.params.fill_unsharded(output)
        self.params.register(sharded=False)

    def reshard(self) -> None:
        self.wait_for_unshard()  # an unshard under way lands first (its buffer is in use)
        if self.params.unsharded:
            self.params.register(sharded=True)

    def _reshard_hook(self, *args: Any) -> None:
        self.reshard()

    def _adopt_hook(self, *args: Any) -> None:
        adopt(self.params, self.name)

    # ---- hooks ----------------------------------------------------------------------------
    def _group_pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        if not self.to_run:  # a new pass through the unit's modules
            self.to_run.update(self.modules)
        return self.pre_forward(module, args, kwargs)

    def _group_post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        """The unit's post-forward after the last of its modules to run (one module: each
        time); after the others, only the output cast (torch's grouped hooks)."""
        if module in self.to_run:
            self.to_run.discard(module)
            if not self.to_run:
                return self.post_forward(module, args, output)
        return self._cast_output(output)

    def pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        self.lazy_init()
        assert self.iteration is not None
        if self.stage is Stage.PRE_BACKWARD:  # a recomputation (activation checkpointing)
            self.unshard()
            self.wait_for_unshard()
            return self._cast_inputs(args, kwargs)
        first = self.stage is not Stage.FORWARD  # (a unit of several modules: the first of them)
        self.stage = Stage.FORWARD
        if first and self.is_root:
            self.iteration.begin()
        self.unshard()
        self.wait_for_unshard()
        if first:
            following = self.iteration.forward_next(self)
            for unit in following if self.forward_prefetch is None else self.forward_prefetch:
                unit.unshard()  # travels while this unit computes
        return self._cast_inputs(args, kwargs)

    def _cast_inputs(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        if self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype is not None:
            return _cast(args, self.mp_policy.param_dtype), _cast(kwargs, self.mp_policy.param_dtype)
        return args, kwargs

    def _cast_output(self, output: Any) -> Any:
        if self.mp_policy.output_dtype is not None:
            return _cast(output, self.mp_policy.output_dtype)
        return output

    def post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.stage is Stage.PRE_BACKWARD:
            return self._cast_output(output)
        assert self.iteration is not None
        output = self._complete_forward(output)
        if self.is_root:  # units of several modules not all run (torch's force-complete)
            for unit in reversed(self.iteration.units):
                if unit.to_run and unit is not self:
                    unit.to_run.clear()
                    output = unit._cast_output(unit._complete_forward(output))
        return self._cast_output(output)

    def _complete_forward(self, output: Any) -> Any:
        """The forward of the unit is over: reshard, and hook ``output`` to start its backward."""
        assert self.iteration is not None
        self.iteration.finished.append(self)
        if self.reshard_after_forward:
            self.reshard()
        self._remaining = sum(s.sharded.requires_grad for s in self.params.slots)
        if torch.is_grad_enabled():
            # the next synchronised backward reduces this unit on every rank (its forward ran
            # on every rank: its all-gather did), whichever gradients each rank has
            self._forward_since_reduce = True
            for t in _grad_tensors(output):
                t.register_hook(eager_hook(self._pre_backward))
        self.stage = Stage.IDLE
        return output

    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        refuse_compiled_autograd()
        assert self.iteration is not None  # set by the root's first forward
        self.iteration.queue_end_of_backward()
        if self.stage is not Stage.PRE_BACKWARD:
            self.stage = Stage.PRE_BACKWARD
            self.unshard()
            self.wait_for_unshard()
            following = self.iteration.backward_next(self)
            for unit in following if self.backward_prefetch is None else self.backward_prefetch:
                unit.unshard()  # travels while this unit computes its gradients
        return grad

    def backward_began(self) -> bool:
        """Whether this backward reached the unit: its outputs' gradient did (or it is a
        unit of several modules not all run: torch's grouped post-backward), or some of its
        parameters have gradients."""
        return (self.stage is not Stage.IDLE
                or any(s.unsharded.grad is not None for s in self.params.slots))

    def _accumulated(self, param: torch.Tensor) -> None:
        self._remaining -= 1
        if self.stage is Stage.FORWARD and self.iteration is not None:
            # a unit of several modules, one run on its own (a head on chunks of a detached
            # output): no pre-backward hook; the end of this backward reduces what it has
            # (torch's grouped post-backward)
            self.iteration.queue_end_of_backward()
        if self._remaining == 0 and self.stage is Stage.PRE_BACKWARD:
            self.post_backward()

    # ---- gradients ------------------------------------------------------------------------
    def post_backward(self) -> None:
        """Reduce-scatter the unit's unsharded gradients (or keep them, without sync)."""
        self.stage = Stage.POST_BACKWARD
        # another backward of this forward (a retained graph, or the trunk's after the
        # chunks') brings every gradient again
        self._remaining = sum(s.sharded.requires_grad for s in self.params.slots)
        if not self.reduce_grads:
            if self.reshard_after_backward:
                self.reshard()
            if self.reduce_dtype is not None:  # accumulate in reduce_dtype, as torch's
                for i, s in enumerate(self.params.slots):
                    self._accumulate(i, s)
            return
        for i, s in enumerate(self.params.slots):
            self._accumulate(i, s)
        if self.reshard_after_backward:
            self.reshard()
        trainable = [(i, s) for i, s in enumerate(self.params.slots) if s.sharded.requires_grad]
        # a unit with gradients reduces them (a second backward through a retained graph:
        # torch's chunked loss); without any, only the first backward after its forward does
        if trainable and (self._forward_since_reduce or self._grad_sums):
            self._forward_since_reduce = False
            assert self.iteration is not None
            self.iteration.add(self._reduce(trainable))

    def _accumulate(self, i: int, s: Slot) -> None:
        """Move slot ``i``'s unsharded gradient into the running sum (in ``reduce_dtype``)."""
        grad, s.unsharded.grad = s.unsharded.grad, None
        if grad is None:
            return
        if i in self._grad_sums:
            self._grad_sums[i] += grad
        else:
            self._grad_sums[i] = grad.to(self.reduce_dtype) if self.reduce_dtype else grad

    def _reduce(self, trainable: list[tuple[int, Slot]], announced: bool = False) -> Reduction:
        """One reduce-scatter of every trainable parameter's gradient, zeros where this rank
        has none, and after each rank's chunk one flag per parameter (1: this rank has its
        gradient): every rank sends the same sizes whichever parameters it used, and learns
        which ones some rank used (a parameter no rank used keeps ``.grad`` as it is)."""
        p = self.params
        dtype = self.reduce_dtype or p.compute_dtype
        grads, used = [], []
        for i, s in trainable:
            grad = self._grad_sums.pop(i, None)
            used.append(grad is not None or self.reduce_unused)
            grads.append(torch.zeros(s.shape, dtype=dtype, device=p.device) if grad is None else grad)
        flags = torch.tensor(used, dtype=dtype, device=p.device).expand(p.world, -1)
        slots = _relaid([s for _, s in trainable])
        numel = sum(s.numel for s in slots) + len(slots)
        flat = torch.empty(numel * p.world, dtype=dtype, device=p.device)
        chunk_cat([*grads, flags], p.world, flat)
        grads.clear()  # the unsharded gradients are freed here
        replicas = dist.get_world_size(self.replicate_group) if self.replicate_group is not None else 1
        op, pre_divide, post_divide = division(dtype, p.world * replicas)
        if self.join is not None and not self.join.divide_initial:  # by the ranks still active
            op, pre_divide, post_divide = dist.ReduceOp.SUM, pre_divide, self.join.divisor(pre_divide)
        if pre_divide not in (None, 1):
            flat.div_(pre_divide)
        output = torch.empty(numel, dtype=dtype, device=p.device)
        pending = reduce_scatter(output, flat, op, self.group, self.name, announced=announced,
                                 shadow=self._shadow(FSDPAction.REDUCE_SCATTER))
        replicate = None if self.replicate_group is None else (self.replicate_group, op, self.name)
        return Reduction(pending, output, slots, post_divide, p, replicate)


def _refuse_shared(names: dict[Unit, list[str]], paths: dict[nn.Module, str]) -> None:
    """Refuse a parameter that two units hold (tied weights sharded apart: each unit would
    train its own copy), as torch's ``_validate_no_duplicate_params``, naming it by its path
    under the root as torch's does (``names``: each unit's modules' paths, ``paths``: every
    module's)."""
    def fqn(slot: Slot) -> str:
        module, name = slot.locations[0]
        return f"{paths[module]}.{name}" if paths.get(module) else name

    seen: dict[int, tuple[Unit, Slot]] = {}
    for unit in names:
        for ref, slot in zip(unit.originals, unit.params.slots):
            first = seen.setdefault(id(ref), (unit, slot))
            if first[0] is not unit:
                raise ValueError(
                    f"Parameter '{fqn(slot)}' is shared with a parameter already managed by another "
                    "FSDP group. For shared/tied parameters, use fully_shard([module_a, module_b]) to "
                    f"place them in the same FSDP group. (phalanx: it is '{fqn(first[1])}' of the "
                    f"unit of {', '.join(names[first[0]])}; sharded apart, each unit would train a "
                    "copy of its own: shard the modules that share it as one unit, or leave it to a "
                    "unit above both)")


def _relaid(slots: list[Slot]) -> list[Slot]:
    """``slots`` with offsets into a buffer holding only their shards, in order."""
    out, offset = [], 0
    for s in slots:
        out.append(Slot(s.locations, s.shape, s.rows, s.padded, offset, s.sharded, s.unsharded))
        offset += s.numel
    return out


def _cast(obj: Any, dtype: torch.dtype) -> Any:
    """``obj`` with its floating-point tensors cast to ``dtype`` (torch's _cast_fp_tensor)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(_cast(item, dtype) for item in obj)
    if isinstance(obj, dict):
        return {k: _cast(v, dtype) for k, v in obj.items()}
    return obj


def _grad_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors requiring grad in a forward's output (tensors, tuples, lists, dicts)."""
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.requires_grad else []
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in _grad_tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _grad_tensors(item)]
    return []
