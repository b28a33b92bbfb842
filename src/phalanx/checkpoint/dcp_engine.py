"""torch's ``torch.distributed.checkpoint`` (DCP) as phalanx's engine for sharded checkpoints.

* :class:`BalancedSavePlanner`: DCP's default planner, except that a tensor every rank holds
  (DDP's parameters, buffers, replicated optimizer state) is written by one rank chosen so that
  the ranks' bytes come out even: the shards each rank must write are counted first, then the
  replicated tensors go, largest first, to the least loaded rank holding them.
* :class:`ChecksummingWriter`: DCP's ``FileSystemWriter`` (fsyncs its file) whose loop
  checksums the file and each item in it as they are written, and holds at most one copied
  tensor at a time.
* :class:`SafeReader`: DCP's ``FileSystemReader`` whose ``.metadata`` is unpickled with an
  allow-list of DCP's metadata classes (torch's reader runs ``pickle.load`` on it), and which
  checks each item's bytes against the manifest's CRC-32 as it reads them, before decoding.
* :func:`split` / :func:`merge`: only tensors go to DCP; every other leaf of a state dict goes
  to phalanx's state file (loaded ``weights_only``). phalanx never asks DCP for a non-tensor
  item, which torch's planner would unpickle with ``weights_only=False``.
* :func:`stage`: a host-memory copy of a tensor tree, for a save written in the background
  (into the buffers of the previous copy when they fit).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import zlib
from collections import defaultdict
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _write_item
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.futures import Future
from torch.distributed.tensor import DTensor

from .dcp_layout import check_item, crc32_combine

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
# What a DCP ``.metadata`` pickle is made of (torch 2.13: found by unpickling torch's own).
_ALLOWED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
            ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
            ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}


def _size(item: Any) -> int:
    # (DCP's own rule: a non-tensor item counts as 1 byte)
    return item.tensor_storage_size() or 1


def balance(plans: list[SavePlan]) -> list[SavePlan]:
    """Each item that several plans hold kept in one of them: largest first, to the one with
    the fewest bytes so far (counting first the items only it holds; ties: lowest rank)."""
    holders: dict[Any, list[int]] = defaultdict(list)
    items: dict[Any, Any] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            holders[item.index].append(rank)
            items[item.index] = item
    load = [0] * len(plans)
    for index, ranks in holders.items():
        if len(ranks) == 1:
            load[ranks[0]] += _size(items[index])
    owner = {}
    shared = sorted((i for i, r in holders.items() if len(r) > 1), key=lambda i: -_size(items[i]))
    for index in shared:
        rank = min(holders[index], key=lambda r: (load[r], r))
        load[rank] += _size(items[index])
        owner[index] = rank
    return [dataclasses.replace(plan, items=[item for item in plan.items
                                             if owner.get(item.index, rank) == rank])
            for rank, plan in enumerate(plans)]


class BalancedSavePlanner(DefaultSavePlanner):
    """DCP's ``DefaultSavePlanner`` with replicated tensors spread over the ranks by size."""

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        # (no duplicates are left for DCP's own dedup, which only sees the shared items)
        return super().create_global_plan(balance(all_plans))


class _Summing:
    """The file being written, passing every byte through CRC-32 once: the CRC-32 of the
    current item (:attr:`item`, reset by the writer between items); the file's is combined
    from its items' (:func:`~phalanx.checkpoint.dcp_layout.crc32_combine`)."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file = file
        self.item = 0

    def write(self, data: Any) -> int:
        self.item = zlib.crc32(data, self.item)
        return self.file.write(data)

    def tell(self) -> int:
        return self.file.tell()

    def flush(self) -> None:
        self.file.flush()


class ChecksummingWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` into ``path``: one file ``__<rank>_0.distcp`` per rank, each
    item ``torch.save``'d into it by DCP's own ``_write_item``, fsynced, never overwriting;
    unlike DCP's writer loop (torch 2.13), the CRC-32s of the file and of each item are taken
    from the bytes as they are written (no second pass over the file), and each tensor that
    must be copied (a view into a larger storage: ``torch.save`` writes whole storages) is
    freed once written, where DCP's loop keeps every copy until the file is closed: at most
    one tensor is copied at a time. :meth:`checksums` gives what the manifest records."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, overwrite=False)
        self._sums: dict[str, dict] = {}

    def write_data(self, plan: SavePlan, planner: Any) -> Any:
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        results, items, crc = [], [], 0
        # (as DCP's loop: byte items first, then tensors, in plan order)
        ordered = sorted(plan.items, key=lambda item: item.type != WriteItemType.BYTE_IO)
        with open(Path(self.path) / name, "wb") as f:
            stream = _Summing(f)
            for item in ordered:
                data = planner.resolve_data(item)
                if item.type != WriteItemType.BYTE_IO:
                    data = data.detach().cpu()
                    if data.untyped_storage().size() != data.nbytes:
                        data = data.clone()  # its own storage, this tensor's bytes only
                stream.item = 0
                offset = f.tell()
                result = _write_item(self.transforms, stream, data, item, name, self.serialization_format)
                del data
                length = f.tell() - offset  # (every byte of the file belongs to one item)
                crc = crc32_combine(crc, stream.item, length)
                items.append([result.storage_data.offset, result.storage_data.length, f"{stream.item:#010x}"])
                results.append(result)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        self._sums = {name: {"bytes": size, "crc32": f"{crc:#010x}", "items": sorted(items)}}
        future: Future = Future()
        future.set_result(results)
        return future

    def checksums(self) -> dict[str, dict]:
        """``{file name: {"bytes", "crc32", "items": [[offset, length, crc32], ...]}}`` of the
        file this rank wrote (as :func:`~phalanx.checkpoint.dcp_layout.checksum` computes)."""
        return self._sums


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        found = super().find_class(module, name) if module in ("torch", _METADATA_MODULE) else None
        if module == "torch" and isinstance(found, torch.dtype):
            return found
        if module == _METADATA_MODULE and isinstance(found, type):
            return found
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP checkpoint's metadata")


class SafeReader(FileSystemReader):
    """DCP's ``FileSystemReader``, its ``.metadata`` unpickled with an allow-list; with a
    ``manifest``, every byte checked against its CRC-32 before it is decoded: ``.metadata``
    whole, each stored item (a tensor's chunk) as DCP reads it, so no byte is read twice."""

    def __init__(self, path: Path, manifest: dict | None = None) -> None:
        super().__init__(path)
        self.manifest = manifest
        self._metadata: bytes | None = None
        self._crcs = {} if manifest is None else {
            (name, offset): crc for name, entry in manifest["files"].items()
            for offset, _, crc in entry.get("items", ())}

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        # torch's FileSystemReader.read_data reads each item through this view (torch 2.13)
        if self.manifest is None:
            return super()._slice_file(file, sinfo)
        file.seek(sinfo.offset)
        data = file.read(sinfo.length)
        check_item(Path(self.path), sinfo.relative_path, sinfo.offset, data,
                   self._crcs.get((sinfo.relative_path, sinfo.offset)))
        return io.BytesIO(data)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:  # (read once, checked once: a load may ask twice)
            with open(Path(self.path) / ".metadata", "rb") as f:
                data = f.read()
            if self.manifest is not None:
                expected = self.manifest["files"].get(".metadata", {}).get("crc32")
                check_item(Path(self.path), ".metadata", 0, data, expected)
            self._metadata = data
        data = self._metadata
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f".metadata holds a {type(metadata).__name__}, not DCP's Metadata")
        # the rest as torch's reader does
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


def split(tree: dict) -> tuple[dict, dict]:
    """``(tensors, rest)`` of a nest of dicts: the tensor leaves (under string keys, down
    through dicts) and everything else. A tensor inside a list or tuple stays in ``rest``."""
    tensors, rest = {}, {}
    for key, value in tree.items():
        if isinstance(key, str) and isinstance(value, torch.Tensor):
            tensors[key] = value
        elif isinstance(key, str) and isinstance(value, dict):
            t, r = split(value)
            if t:
                tensors[key] = t
            if r or not t:
                rest[key] = r
        else:
            rest[key] = value
    return tensors, rest


def merge(tensors: dict, rest: dict) -> dict:
    """The inverse of :func:`split`: a new nest of dicts holding both."""
    out = dict(rest)
    for key, value in tensors.items():
        out[key] = merge(value, out.get(key, {})) if isinstance(value, dict) else value
    return out


@torch.no_grad()
def stage(tree: Any, previous: Any = None) -> Any:
    """A copy of a tensor tree in host memory (DTensors stay DTensors, their local shards
    copied); what a save written in the background reads while training changes the state.
    ``previous``: the copy an earlier call returned, whose buffers are reused (copied into)
    wherever a tensor has the same shape, dtype and strides: no new memory, no page faults,
    so the copy runs at memory speed. The caller must be done with ``previous``."""
    if isinstance(tree, dict):
        before = previous if isinstance(previous, dict) else {}
        return {k: stage(v, before.get(k)) for k, v in tree.items()}
    if isinstance(tree, DTensor):
        local = tree.to_local().detach()
        if (isinstance(previous, DTensor) and previous.shape == tree.shape
                and previous.placements == tree.placements and previous.device_mesh == tree.device_mesh
                and _fits(previous.to_local(), local)):
            previous.to_local().copy_(local)
            return previous
        return DTensor.from_local(local.to("cpu", copy=True), tree.device_mesh, tree.placements,
                                  run_check=False, shape=tree.shape, stride=tree.stride())
    if not isinstance(previous, DTensor) and _fits(previous, tree):
        previous.copy_(tree.detach())
        return previous
    return tree.detach().to("cpu", copy=True)


def _fits(buffer: Any, tensor: torch.Tensor) -> bool:
    return (isinstance(buffer, torch.Tensor) and buffer.device.type == "cpu" and buffer.dtype == tensor.dtype
            and buffer.shape == tensor.shape and buffer.stride() == tensor.stride())
