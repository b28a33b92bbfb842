"""A unit's parameters: their shards (one flat buffer, each parameter a DTensor viewing its
part), their unsharded form (one flat buffer, allocated only while unsharded), and the swap
between the two on the modules that hold them.

Each parameter of ``rows`` rows is split as ``torch.chunk`` splits it, which is how DTensor's
``Shard(0)`` places it: rank ``r`` holds rows ``[r * k, min((r + 1) * k, rows))`` with
``k = ceil(rows / world)``, stored padded to ``k`` rows (zeros) so that every rank's flat
shard has the same size and one all-gather moves them all. The unsharded parameters are
plain ``nn.Parameter`` s viewing the unsharded buffer; the same objects serve every
iteration (autograd saves them in the forward and finds them refilled in the backward), so
freeing the buffer resizes its storage to nothing rather than dropping it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement

from .collectives import padded_rows


@dataclass
class Slot:
    """Where one parameter lives: its modules, its shape, its part of the flat buffers."""

    locations: list[tuple[nn.Module, str]]  # every (module, attribute name) holding it
    shape: torch.Size
    rows: int  # rows of this rank's shard (torch.chunk's; 0 past the last chunk)
    padded: int  # rows of every rank's padded shard
    offset: int  # start of its padded shard in the flat shard buffer
    sharded: nn.Parameter  # a DTensor, Shard(0)
    unsharded: nn.Parameter

    @property
    def numel(self) -> int:
        """Elements of its padded shard."""
        return self.padded * (self.shape[1:].numel())

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the parameter in a flat buffer laid out like the shards."""
        return flat[self.offset:self.offset + self.numel].view(self.padded, *self.shape[1:])[:self.rows]


def placements(mesh: DeviceMesh) -> tuple[Placement, ...]:
    """A shard's placements on ``mesh``: ``Shard(0)``, replicated across a 2-D mesh's first
    dimension (HSDP), as torch's ``fully_shard`` places them."""
    return (Replicate(), Shard(0)) if mesh.ndim == 2 else (Shard(0),)


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


class Params:
    """The parameters of one unit (see the module notes).

    Args:
        params: the parameters, in order (each once).
        locations: for each, every ``(module, name)`` that holds it (tied weights: several).
        mesh: the mesh the shards are placed on: 1-D (``Shard(0)``), or 2-D (HSDP:
            ``(Replicate(), Shard(0))``, sharded across its second dimension, each shard
            replicated across its first).
        param_dtype: the dtype of the unsharded parameters (mixed precision: the shards
            are cast before the all-gather); default ``None``: the parameters' own.
        offload: ``CPUOffloadPolicy``: the shards (so their gradients and the optimizer
            state) in host memory, pinned if asked and the mesh is on an accelerator;
            default: on the mesh's device.
    """

    def __init__(self, params: Sequence[nn.Parameter],
                 locations: Sequence[list[tuple[nn.Module, str]]], mesh: DeviceMesh,
                 param_dtype: torch.dtype | None = None,
                 offload: OffloadPolicy = OffloadPolicy()) -> None:
        # (the shard dimension: the mesh's last; HSDP's replicas along the first)
        self.mesh, self.world, self.rank = mesh, mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1)
        self.placements = placements(mesh)
        self.dtype = params[0].dtype if params else torch.get_default_dtype()
        self.compute_dtype = param_dtype or self.dtype
        self.offload = isinstance(offload, CPUOffloadPolicy)
        # (parameters on the meta device get shards on the mesh's: initialize() fills them;
        # offloaded ones may come from the host)
        on_meta = not params or params[0].is_meta
        self.device = torch.device(mesh.device_type) if on_meta or self.offload else params[0].device
        # pinned host memory: asynchronous copies to and from an accelerator (none to make on
        # a CPU mesh, where torch's pin_memory() raises for want of an accelerator)
        self.pinned = (isinstance(offload, CPUOffloadPolicy) and offload.pin_memory
                       and self.device.type != "cpu")
        total = sum(padded_rows(p.shape[0], self.world) * p.shape[1:].numel() for p in params)
        self.flat = torch.zeros(total, dtype=self.dtype, device="cpu" if self.offload else self.device,
                                pin_memory=self.pinned)
        self.unsharded_flat = torch.empty(total * self.world, dtype=self.compute_dtype, device=self.device)
        self.slots: list[Slot] = []
        offset = 0
        for p, where in zip(params, locations):
            self.slots.append(self._slot(p, where, offset))
            offset += self.slots[-1].numel
        self._free_unsharded()  # (its views are made: the parameters' storage comes and goes)
        self.unsharded = False
        self.register(sharded=True)

    def _slot(self, p: nn.Parameter, where: list[tuple[nn.Module, str]], offset: int) -> Slot:
        k = padded_rows(p.shape[0], self.world)
        start = min(self.rank * k, p.shape[0])
        rows = min(start + k, p.shape[0]) - start
        local = _alias(self.flat, offset, torch.Size((rows, *p.shape[1:])))
        if not p.is_meta:
            with torch.no_grad():
                local.copy_(p.detach()[start:start + rows])
        # built over `local` where it is, as torch's _from_local_no_grad: DTensor.from_local
        # would copy an offloaded (host) shard onto the mesh's device
        spec = DTensorSpec(self.mesh, tuple(self.placements),
                           tensor_meta=TensorMeta(p.shape, _contiguous_stride(p.shape), local.dtype))
        dtensor = DTensor(local, spec, requires_grad=False)
        sharded = nn.Parameter(dtensor, requires_grad=p.requires_grad)
        base = offset * self.world  # the unsharded buffer keeps the parameters in order
        view = self.unsharded_flat[base:base + p.numel()].view(p.shape)
        unsharded = nn.Parameter(view, requires_grad=p.requires_grad)
        return Slot(where, p.shape, rows, k, offset, sharded, unsharded)

    # ---- the unsharded buffer ---------------------------------------------------------------
    def gather_input(self) -> torch.Tensor:
        """What this rank sends in the all-gather: its flat shard on the compute device (an
        offloaded shard copied there, asynchronously from pinned memory, as torch's), in the
        compute dtype."""
        return self.flat.to(self.device, non_blocking=self.pinned).to(self.compute_dtype)

    def grad_shard(self, grad: torch.Tensor, accumulate: bool) -> torch.Tensor:
        """A reduced gradient shard where the shards live: an offloaded one copied to the
        host, asynchronously into pinned memory unless it is added to an existing gradient at
        once (the caller then synchronises, :meth:`Iteration.end_of_backward`), as torch's
        ``foreach_reduce``."""
        if not self.offload:
            return grad
        return grad.to("cpu", non_blocking=self.pinned and not accumulate)

    def _free_unsharded(self) -> None:
        self.unsharded_flat.untyped_storage().resize_(0)

    def fill_unsharded(self, gathered: torch.Tensor) -> None:
        """Allocate the unsharded buffer and copy an all-gather's output (rank-major) into it.

        The copy goes through ``.data`` views: the unsharded parameters keep their version
        counters, so autograd accepts the tensors it saved in the forward (torch's FSDP does
        the same under ``_unsafe_preserve_version_counter``).
        """
        self.unsharded_flat.untyped_storage().resize_(
            self.unsharded_flat.numel() * self.unsharded_flat.element_size())
        data = self.unsharded_flat.data
        outs = [data[s.offset * self.world:(s.offset + s.numel) * self.world].view(self.world, s.numel)
                for s in self.slots]
        with torch.no_grad():
            torch.split_with_sizes_copy(gathered.view(self.world, -1), [s.numel for s in self.slots],
                                        dim=1, out=outs)
        for s in self.slots:
            s.unsharded.requires_grad_(s.sharded.requires_grad)

    def keep_own_rows(self) -> None:
        """Copy this rank's rows of the unsharded parameters into the shards (after an
        initialisation changed them alike on every rank)."""
        with torch.no_grad():
            for s in self.slots:
                start = min(self.rank * s.padded, s.shape[0])
                s.shard_of(self.flat).copy_(s.unsharded.detach()[start:start + s.rows])

    # ---- which form the modules hold --------------------------------------------------------
    def register(self, sharded: bool) -> None:
        """Put the sharded (DTensor) or the unsharded parameters on their modules; leaving
        the unsharded form frees its buffer."""
        for s in self.slots:
            param = s.sharded if sharded else s.unsharded
            for module, name in s.locations:
                setattr(module, name, param)
        if sharded and self.unsharded:
            self._free_unsharded()
        self.unsharded = not sharded


def _alias(flat: torch.Tensor, offset: int, shape: torch.Size) -> torch.Tensor:
    """``flat``'s elements from ``offset`` on, shaped ``shape`` (contiguous): the same memory
    as the view ``flat[offset:].view(shape)``, but on a storage of its own that starts there
    (a slice of ``flat``'s storage, which it holds), at storage offset 0.

    Why not the view: torch's DTensor wrapper takes its local tensor's storage offset as its
    own, which makes its ``data_ptr()`` nonzero on a storage that has no memory; torch's
    ``Tensor.__deepcopy__`` and DCP's stagers (``dcp.async_save``'s default) then copy that
    storage and fail ("invalid python storage", torch 2.13). torch's fully_shard gives every
    parameter its own storage, so its shards start at offset 0 too."""
    size = flat.element_size()
    start = (flat.storage_offset() + offset) * size
    storage = flat.untyped_storage()[start:start + shape.numel() * size]
    return torch.empty(0, dtype=flat.dtype, device=flat.device).set_(storage, 0, shape)
