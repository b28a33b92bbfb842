"""DCP's save planning, made once for a layout of the state and reused while it lasts.

torch's ``dcp.save`` plans every save anew, in two exchanges of its own: every rank makes its
local plan (a ``WriteItem`` per tensor or shard, from every entry of its state), rank 0
gathers them all, dedups the replicated entries, builds the metadata and scatters each rank
its final plan; after the writes, every rank sends rank 0 its ``WriteResult``s, rank 0
writes ``.metadata``, and broadcasts the whole metadata back to every rank. At world 4 on
the benchmark's 420 MB GPT (about 450 tensors per rank) that was a third of a rank's CPU
time for a save (pickling and unpickling the plans and the metadata), all of it giving the
same answer every time: a training job's state keeps its keys, shapes, dtypes and
placements from one checkpoint to the next.

So :class:`Plans` (one per :class:`~phalanx.checkpoint.Checkpointer`, on every rank):

* each rank keeps its local plan (DCP's ``create_local_plan``) with the *layout* it was made
  from: each entry's key, shape, dtype and, for a DTensor, placements and mesh: cheap to make
  and to compare. It sends rank 0 the plan only when rank 0 does not hold it yet, else only
  the plan's name (:meth:`Plans.offer`);
* rank 0 keeps every rank's latest local plan and the global plan made from them (DCP's
  ``create_global_plan``, by :class:`~phalanx.checkpoint.dcp_engine.BalancedSavePlanner`, and
  its storage prefixes ``__<rank>_``, as ``FileSystemWriter`` gives them); it remakes it only
  when a rank's plan changed, and sends a rank its final plan only when that rank does not
  hold it (:meth:`Plans.decide`, :meth:`Plans.accept`);
* these ride on the two exchanges the save makes anyway (the gather of every rank's RNG
  state to rank 0, and rank 0's answer naming the temporary directory), so planning costs
  no collective of its own; after the writes each rank sends rank 0 only where each item
  went (offset and length, with the manifest's CRC-32s, packed: :class:`~.dcp_layout.Written`),
  from which rank 0 writes
  ``.metadata`` (:meth:`Plans.metadata_file`: DCP's metadata pickled as DCP's writer does,
  its bytes reused, patched in place, while every item sits where it sat); nothing is
  broadcast back but the outcome.

A save that fails forgets all of it on every rank (:meth:`Plans.forget`): the next one plans
anew. A rank's plan that rank 0 does not hold (a forgotten one) fails the save on every rank
with a :class:`~phalanx.errors.CheckpointError`, after which the next save plans anew.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    DEFAULT_SUFFIX,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.tensor import DTensor

from ..errors import CheckpointError
from .dcp_layout import Written

Offer = tuple  # (plan name, the plan or None): a rank's local plan, or a rank's final plan


def layout(planner: Any) -> tuple:
    """What a DCP local plan of ``planner``'s (flattened) state depends on: for each entry its
    key, where it sits in the nested state, and shape, dtype and ``requires_grad``; for a
    DTensor also its placements, mesh and its local tensor's ``requires_grad``."""
    mappings = planner.mappings
    out = []
    for fqn, obj in planner.state_dict.items():
        if isinstance(obj, DTensor):
            out.append((fqn, mappings.get(fqn), "D", obj.shape, obj.dtype, obj.placements,
                        obj.device_mesh, obj._local_tensor.requires_grad))
        elif isinstance(obj, torch.Tensor):
            out.append((fqn, mappings.get(fqn), "T", type(obj), obj.shape, obj.dtype, obj.requires_grad))
        else:
            out.append((fqn, mappings.get(fqn), type(obj)))
    return tuple(out)


class Plans:
    """The save plans of one Checkpointer: see the module notes."""

    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        # every rank: its local plan, the name rank 0 holds, its final plan
        self._layout: tuple | None = None
        self._local: tuple[str, SavePlan] | None = None
        self._sent: str | None = None
        self._final: tuple[str, SavePlan] | None = None
        # rank 0: every rank's local plan, the global plan made from them, what each holds
        self._locals: dict[int, tuple[str, SavePlan]] = {}
        self._global: tuple[tuple, list[SavePlan], list[str], Metadata] | None = None
        self._given: dict[int, str] = {}
        self._pickled: tuple | None = None  # (metadata, placements, .metadata's bytes, their strings)

    def offer(self, planner: Any) -> Offer:
        """This rank's local plan for ``planner``'s state (made if its layout changed): its
        name, and the plan itself if rank 0 does not hold it yet."""
        found = layout(planner)
        if self._local is None or found != self._layout:
            self._layout, self._local = found, (uuid.uuid4().hex, planner.create_local_plan())
        name, plan = self._local
        if self._sent == name:
            return name, None
        self._sent = name
        return name, plan

    def decide(self, planner: Any, offers: list[Offer]) -> list[Offer]:
        """Rank 0, with every rank's :meth:`offer`: every rank's final plan, as ``(name, the
        plan or None if that rank holds it)``."""
        for rank, (name, plan) in enumerate(offers):
            if plan is not None:
                self._locals[rank] = (name, plan)
            elif self._locals.get(rank, ("",))[0] != name:
                raise CheckpointError(f"rank {rank}'s save plan {name} is unknown to rank 0 (a failed "
                                      "save forgot it?); the next save plans anew")
        key = tuple(name for name, _ in offers)
        if self._global is None or self._global[0] != key:
            plans, metadata = planner.create_global_plan([self._locals[r][1] for r in range(len(offers))])
            # each rank's file prefix, as FileSystemWriter.prepare_global_plan gives it
            plans = [dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{i}_"))
                     for i, plan in enumerate(plans)]
            self._global = (key, plans, [uuid.uuid4().hex for _ in plans], metadata)
        _, plans, names, _ = self._global
        out = []
        for rank, (plan, name) in enumerate(zip(plans, names)):
            out.append((name, None if self._given.get(rank) == name else plan))
            self._given[rank] = name
        return out

    def accept(self, offer: Offer) -> SavePlan:
        """This rank's final plan, from its part of rank 0's :meth:`decide`."""
        name, plan = offer
        if plan is not None:
            self._final = (name, plan)
        elif self._final is None or self._final[0] != name:
            raise CheckpointError(f"rank 0 chose the save plan {name}, which this rank does not hold")
        return self._final[1]

    def metadata_file(self, written: list[Written], storage_meta: StorageMeta) -> bytearray:
        """Rank 0: the bytes of ``.metadata``, as DCP's ``FileSystemWriter.finish`` pickles it:
        the metadata of the last :meth:`decide`'s global plan, with where every rank put its
        items (``written[rank]``) and ``storage_meta`` (the directory written and the save's
        id). The caller must be done with the bytes before the next call, which reuses them.

        When every item sits where it sat in the previous save (items are written from
        templates of fixed size: a training job's saves all do), the previous bytes are
        reused: they differ only in the directory's name and the save id, strings of the same
        lengths, replaced in place (each found exactly once, else it is pickled anew): no
        memory is allocated."""
        assert self._global is not None, "Plans.metadata_file() before Plans.decide()"
        _, plans, _, metadata = self._global
        strings = _meta_strings(storage_meta)
        placed = [w.placement() for w in written]
        if self._pickled is not None and self._pickled[0] is metadata and self._pickled[1] == placed:
            data = self._pickled[2]
            if _replace(data, self._pickled[3], strings):
                self._pickled = (metadata, placed, data, strings)
                return data
        self._pickled = None  # (its bytes freed before the new ones are made)
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = self._storage_data(plans, written)
        metadata.storage_meta = storage_meta
        sink = bytearray()
        pickle.dump(metadata, _Appender(sink))  # (as finish does: pickle.dump to the file)
        # where every item went is in the bytes now; not kept as objects too (an entry per
        # stored item: ~270 bytes each on rank 0, 0.48 MB at world 4 here, ~110 MB at 1024)
        metadata.storage_data = None
        self._pickled = (metadata, placed, sink, strings)
        return sink

    @staticmethod
    def _storage_data(plans: list[SavePlan], written: list[Written]) -> dict:
        """Where each item of every rank's plan went: ``{index: _StorageInfo}``, as DCP's
        ``finish`` makes it of the ranks' ``WriteResult``s."""
        if len(written) != len(plans):
            raise CheckpointError(f"{len(written)} ranks reported their writes, the plan has {len(plans)}")
        out = {}
        for rank, (plan, where) in enumerate(zip(plans, written)):
            if len(where.plan_index) != len(plan.items):
                raise CheckpointError(f"rank {rank} reported {len(where.plan_index)} items written, its "
                                      f"plan has {len(plan.items)}")
            name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
            for i, offset, length in zip(*where.placement()):
                out[plan.items[i].index] = _StorageInfo(name, offset, length)
        return out


class _Appender:
    """A file-like that appends what is written to a bytearray (``pickle.dump``'s target)."""

    def __init__(self, sink: bytearray) -> None:
        self.write = sink.extend


def _meta_strings(meta: StorageMeta) -> tuple[str, ...]:
    """The strings of ``meta`` that change from one save to the next: the directory's last
    component (its parents are pickled as strings of their own) and the save id."""
    checkpoint = os.fspath(meta.checkpoint_id) if meta.checkpoint_id is not None else ""
    return os.path.dirname(checkpoint), os.path.basename(checkpoint), str(meta.save_id)


def _replace(data: bytearray, old: tuple[str, ...], new: tuple[str, ...]) -> bool:
    """Replace in ``data`` (a pickle), in place, the strings ``old[1:]`` by ``new[1:]`` (same
    parent directory ``[0]``); ``False``, ``data`` untouched, unless each is as long as what
    it replaces and found exactly once."""
    if old[0] != new[0]:
        return False
    found = []
    for before, after in zip(old[1:], new[1:]):
        b, a = before.encode(), after.encode()
        at = data.find(b)
        if len(a) != len(b) or not b or at < 0 or data.find(b, at + 1) >= 0:
            return False
        found.append((at, a))
    for at, a in found:
        data[at:at + len(a)] = a
    return True
