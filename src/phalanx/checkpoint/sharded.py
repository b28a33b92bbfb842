"""Checkpoints of a model sharded by ``fully_shard`` (phalanx's or torch's): its parameters and
its optimizer's state are DTensors, ``Shard(0)`` on a 1-D mesh, or ``(Replicate(), Shard(0))``
on a 2-D one (HSDP: the rows sharded across the second dimension, every replica alike).

**Saving** writes one consolidated file, as for any model, without ever holding the whole
state on one rank: the file's first frame is the state with every sharded tensor left out
(``None``, its place listed under ``"sharded"``), and each sharded tensor follows as a frame of
its own, whole. The writer receives the tensors' rows from every rank of its replica (the
whole mesh, 1-D) one tensor at a time (point to point, in the order of the list) and writes
each before receiving the next; the other replicas send nothing: no
rank holds more than its shards plus one tensor, one parameter or one optimizer state of
one parameter, which is at most one unit (tested, with the process's peak memory).

**Loading** at any world size: every rank decodes one frame at a time and keeps its
``torch.chunk`` rows of it (the rows ``Shard(0)`` gives it at this world size, or at the
shard dimension's size under HSDP, torch's padding rule), made a DTensor on the model's mesh
with the model's placements; into a model that is not sharded (one
process, DDP), the whole tensors.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..errors import CheckpointError

# Where a sharded tensor sits in the saved state: keys from its root, e.g.
# ("model", "blocks.0.fc1.weight") or ("optimizer", "state", 3, "exp_avg").
At = tuple


def mesh_of(module: nn.Module) -> DeviceMesh | None:
    """The mesh of ``module``'s first DTensor parameter, or ``None`` if it has none."""
    return next((p.device_mesh for p in module.parameters() if isinstance(p, DTensor)), None)


def optimizer_state(optimizer: Any) -> dict | None:
    """The optimizer's state dict when it may hold DTensors: not a sharded optimizer's, which
    is consolidated on the writer instead (``consolidate_state_dict``)."""
    if optimizer is None or hasattr(optimizer, "consolidate_state_dict"):
        return None
    return optimizer.state_dict()


class ShardedState:
    """The DTensors of a model's and its optimizer's state dicts, in the order they are saved.

    Args:
        model_state: ``model.state_dict()``.
        optim_state: ``optimizer.state_dict()``, or ``None``.
        group: the ranks that save together (``None``: the world); the mesh must span them.

    Raises:
        TypeError: a DTensor placed otherwise than ``Shard(0)`` on a 1-D mesh or
            ``(Replicate(), Shard(0))`` on a 2-D one, or on another mesh than the first one's.
        ValueError: the mesh does not span the ranks of ``group``.
    """

    def __init__(self, model_state: dict, optim_state: dict | None, group: Any) -> None:
        self.model_state, self.optim_state = model_state, optim_state
        self.entries: list[tuple[At, DTensor]] = [
            (("model", k), v) for k, v in model_state.items() if isinstance(v, DTensor)]
        for index, per_param in (optim_state or {}).get("state", {}).items():
            self.entries += [(("optimizer", "state", index, name), v)
                             for name, v in per_param.items() if isinstance(v, DTensor)]
        self.mesh = self.entries[0][1].device_mesh if self.entries else None
        for at, tensor in self.entries:
            if tensor.device_mesh != self.mesh or tuple(tensor.placements) != _placements(self.mesh):
                raise TypeError(
                    f"Checkpointer saves DTensors sharded as fully_shard shards them (Shard(0) on "
                    f"one 1-D mesh, (Replicate(), Shard(0)) on one 2-D mesh), but {_name(at)} has "
                    f"placements {tuple(tensor.placements)} on mesh {tensor.device_mesh} (the first "
                    f"sharded tensor's mesh: {self.mesh})")
        if self.mesh is not None:
            ranks = self.mesh.mesh.flatten().tolist()
            expected = dist.get_process_group_ranks(group or dist.group.WORLD)
            if ranks != expected:
                raise ValueError(f"Checkpointer's group has ranks {expected}, the model is sharded "
                                 f"over ranks {ranks}: pass the group the model is sharded on")

    def __bool__(self) -> bool:
        return bool(self.entries)

    def skeleton(self) -> tuple[dict, dict | None, list[tuple[At, torch.Size]]]:
        """The model and optimizer states with ``None`` for each DTensor (new dicts: the
        optimizer's per-parameter dicts are its own), and each one's place and global shape."""
        model = {k: None if isinstance(v, DTensor) else v for k, v in self.model_state.items()}
        optim = None
        if self.optim_state is not None:
            optim = {**self.optim_state, "state": {
                i: {n: None if isinstance(v, DTensor) else v for n, v in s.items()}
                for i, s in self.optim_state.get("state", {}).items()}}
        return model, optim, [(at, t.shape) for at, t in self.entries]

    def _replica(self, writer: int) -> list[int]:
        """The global ranks holding the writer's replica, in shard order (a 1-D mesh: all)."""
        return next(row for row in self.mesh.mesh.view(-1, self.mesh.mesh.shape[-1]).tolist()
                    if writer in row)

    def receive(self, writer: int) -> Iterator[torch.Tensor]:
        """On the writer (global rank ``writer``): each DTensor whole, one at a time; the
        previous one is released before the next is received."""
        ranks = self._replica(writer)
        # One storage, emptied before each tensor is received: the previous tensor's memory
        # goes then, even if a finished receive's work still holds a view of it (Gloo's thread
        # drops its reference when it gets to it: with a new tensor each time, two were alive
        # during 1 to 5 saves of 11, measured; a rarer transient of a unit remains, not this)
        storage: torch.UntypedStorage | None = None
        for _, tensor in self.entries:
            device = tensor.to_local().device
            if storage is None or storage.device != device:
                storage = torch.UntypedStorage(0, device=device)
            storage.resize_(0)
            storage.resize_(tensor.numel() * tensor.element_size())
            out = torch.empty(0, dtype=tensor.dtype, device=device).set_(storage, 0, tensor.shape)
            for rank, (start, rows) in zip(ranks, _spans(tensor.shape[0], len(ranks))):
                if rows == 0:
                    continue
                if rank == writer:
                    out[start:start + rows].copy_(tensor.to_local())
                else:
                    dist.recv(out[start:start + rows], src=rank)
            yield out
            del out

    def send(self, writer: int) -> None:
        """On every other rank of the writer's replica: send the writer this rank's rows of
        each DTensor, in order (the other replicas send nothing)."""
        if dist.get_rank() not in self._replica(writer):
            return
        for _, tensor in self.entries:
            local = tensor.to_local()
            if local.numel():
                dist.send(local.contiguous(), dst=writer)


def _spans(rows: int, world: int) -> list[tuple[int, int]]:
    """(first row, rows) of each rank's Shard(0) chunk: torch.chunk's sizes, 0 past the last."""
    k = -(-rows // world)
    return [(min(r * k, rows), max(0, min((r + 1) * k, rows) - r * k)) for r in range(world)]


def rows_for(mesh: DeviceMesh | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What a loading rank keeps of each whole tensor: its ``Shard(0)`` rows on ``mesh``
    (a copy, so that the whole tensor can go), or all of it when the model is not sharded."""
    if mesh is None:
        return None
    world, rank = mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1)  # (HSDP: shard dim)

    def select(tensor: torch.Tensor) -> torch.Tensor:
        start, rows = _spans(tensor.shape[0], world)[rank]
        return tensor[start:start + rows].clone()

    return select


def restore(state: dict, mesh: DeviceMesh | None, path: Any) -> None:
    """Put the frames a loading rank kept back in their places of ``state``: as DTensors on
    ``mesh``, or as they are when the model is not sharded."""
    frames, places = state.pop("frames"), state.pop("sharded")
    if len(frames) != len(places):
        raise CheckpointError(f"Checkpoint {path} lists {len(places)} sharded tensors and holds "
                              f"{len(frames)}")
    for (at, shape), local in zip(places, frames):
        value = local
        if mesh is not None:
            stride = torch.empty(shape, device="meta").stride()
            value = DTensor.from_local(local, mesh, _placements(mesh), run_check=False, shape=shape,
                                       stride=stride)
        target = state
        for key in at[:-1]:
            target = target[key]
        target[at[-1]] = value


def _placements(mesh: DeviceMesh) -> tuple:
    """How ``fully_shard`` (torch's, phalanx's) places a shard on ``mesh``: ``Shard(0)``,
    replicated across a 2-D mesh's first dimension (HSDP). (Not phalanx.fsdp's: a checkpoint
    stands on torch's DTensors alone.)"""
    return (Replicate(), Shard(0)) if mesh.ndim == 2 else (Shard(0),)


def _name(at: At) -> str:
    return at[1] if at[0] == "model" else f"the optimizer's {at[-1]!r} of parameter {at[2]}"
