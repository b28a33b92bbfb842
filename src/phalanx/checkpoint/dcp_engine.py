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
  checks each item's bytes against the manifest's CRC-32 as it reads them, before decoding
  (the next item read on a thread meanwhile; phalanx's own items decoded where they lie,
  without ``torch.load``; of an item with block CRC-32s whose rows a load needs only some
  of, only the blocks holding them read and checked).
* :func:`split` / :func:`merge`: only tensors go to DCP; every other leaf of a state dict goes
  to phalanx's state file (loaded ``weights_only``). phalanx never asks DCP for a non-tensor
  item, which torch's planner would unpickle with ``weights_only=False``.
* :func:`stage`: a host-memory copy of a tensor tree, for a save written in the background
  (into the buffers of the previous copy when they fit); :class:`DeferredStaging`: the same
  copy, made at save time only for what may change before the next optimizer step, the rest
  on the writer's thread while training goes on.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future
from torch.distributed.tensor import DTensor

from ..errors import CheckpointError
from .dcp_items import storage_bytes, template, template_for
from .dcp_layout import (DamagedCheckpoint, ItemCRC, Written, blocks_of, check_blocks, check_item,
                         crc32_combine, unpack_crcs)
from .file import start_writeback

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


# The file is written through its descriptor, in order, nothing copied: the pieces of small
# items (a tensor's storage straight from its memory, the archive's head and tail around it)
# are gathered, up to _GATHER bytes or _IOV pieces, into one writev; a storage of _GATHER
# bytes or more is written alone, in pieces of _PIECE bytes, each CRC-32'd just before it is
# written (while it is in the cache). Until written, each small item holds ~1.3 kB of Python
# objects (its storage's view, its archive's tail): 256 pieces (85 items) keep that near
# 0.1 MB, where 1024 held 0.46 MB in a save of 552 small tensors (tracemalloc), a writev
# each 85 items instead of 340.
_GATHER = 1 << 20
_PIECE = 2 << 20
_IOV = min(256, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 16
# Every _WRITEBACK bytes the disk is told to start writing what came before (Linux's
# sync_file_range, where there is one), so that the final fsync finds most of it written
# while the CPU was busy with the rest (the kernel would otherwise wait for fsync or for its
# dirty-page threshold, gigabytes on a large host).
_WRITEBACK = 16 << 20


class _File:
    """A new file written in order (see the constants above); :meth:`write` makes it a
    file-like for ``torch.save``. What :meth:`put_storage` and :meth:`write` write passes
    through :attr:`item` (the current item's CRC-32s); what :meth:`put` writes, the caller's."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        self.pos = 0  # bytes given, those waiting included
        self.item = ItemCRC()
        self._pieces: list[Any] = []  # waiting for the next writev
        self._waiting = 0
        self._owners: list[torch.Tensor] = []  # whose memory the waiting pieces are
        self._started = 0  # writeback started up to here

    def put(self, data: Any) -> None:
        """Append ``data`` (bytes-like, left as it is until written)."""
        self._pieces.append(data)
        self._waiting += len(data)
        self.pos += len(data)
        if self._waiting >= _GATHER or len(self._pieces) >= _IOV:
            self.flush()

    def put_storage(self, tensor: torch.Tensor) -> int:
        """Append a contiguous CPU tensor's bytes, from its memory; their CRC-32."""
        view = storage_bytes(tensor)
        self.item.mark()
        if view.nbytes < _GATHER:
            self._owners.append(tensor)
            self.item.update(view)
            self.put(view)
            return self.item.marked()
        self.flush()
        for start in range(0, view.nbytes, _PIECE):
            piece = view[start:start + _PIECE]
            self.item.update(piece)
            _write_all(self.fd, [piece])
        self.pos += view.nbytes
        self._writeback()
        return self.item.marked()

    def write(self, data: Any) -> int:  # (torch.save's file-like: its buffers are its own)
        view = memoryview(data).cast("B")
        self.item.update(view)
        if view.nbytes < _GATHER:
            self.put(bytes(view))
        else:
            self.flush()
            _write_all(self.fd, [view])
            self.pos += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:  # (no durability here: close() fsyncs)
        if self._pieces:
            _write_all(self.fd, self._pieces)
            self._pieces, self._waiting, self._owners = [], 0, []
            self._writeback()

    def _writeback(self) -> None:
        written = self.pos - self._waiting
        if written - self._started >= _WRITEBACK:
            start_writeback(self.fd, self._started, written - self._started)
            self._started = written

    def close(self, sync: bool = True) -> None:
        try:
            if sync:
                self.flush()
                os.fsync(self.fd)
        finally:
            os.close(self.fd)


def _write_all(fd: int, pieces: list[Any]) -> None:
    """``writev`` ``pieces`` whole (a write may stop short: it goes on from there)."""
    while pieces:
        done = os.writev(fd, pieces)
        while pieces and done >= len(pieces[0]):
            done -= len(pieces[0])
            pieces = pieces[1:]
        if done:
            pieces = [memoryview(pieces[0])[done:], *pieces[1:]]


def _local_shard(planner: Any, item: Any) -> torch.Tensor:
    """What ``planner.resolve_data(item)`` gives for a tensor item, without DCP's lookup and
    ``to_local()``'s autograd call for a DTensor with a plain local tensor."""
    found = planner.state_dict.get(item.index.fqn)
    if type(found) is DTensor and type(found._local_tensor) in (torch.Tensor, torch.nn.Parameter) and not any(
            p.is_partial() for p in found.placements):
        return found._local_tensor
    if type(found) in (torch.Tensor, torch.nn.Parameter) and (
            item.index.offset is None or not any(item.index.offset)):
        return found
    return planner.resolve_data(item)


class ChecksummingWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` into ``path``: one file ``__<rank>_0.distcp`` per rank, each
    tensor in it the bytes ``torch.save`` writes for it (DCP's format), fsynced, never
    overwriting; unlike DCP's writer (torch 2.13):

    * a contiguous CPU tensor's archive is written by :mod:`~phalanx.checkpoint.dcp_items`
      (``torch.save``'s bytes, from its template and the tensor's memory: no copy of a view
      into a larger storage, no Python per piece of the archive); any other through
      ``torch.save``, copied first if it is such a view, and freed once written (DCP's loop
      keeps every copy until the file is closed);
    * each byte passes through CRC-32 once, as it is written, in blocks of
      :data:`~.dcp_layout.BLOCK` bytes aligned to its item's start
      (:class:`~.dcp_layout.ItemCRC`): the item's CRC-32 is combined from its blocks', the
      file's from its items' (no second pass over the file); a contiguous tensor's archive
      keeps its blocks' CRC-32s and where its storage starts, for loads that read only some
      of its rows;
    * the disk starts writing as the file grows (``sync_file_range``), before the fsync.

    :meth:`write` gives what the manifest and ``.metadata`` record, as a compact
    :class:`~phalanx.checkpoint.dcp_layout.Written`."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, overwrite=False)

    def write_data(self, plan: SavePlan, planner: Any) -> Any:
        """DCP's ``StorageWriter.write_data``: :meth:`write`, then a future of the
        ``WriteResult``s, in ``plan.items``' order."""
        written = self.write(plan, planner)
        results: list[Any] = [None] * len(plan.items)
        for i, offset, length in zip(*written.placement()):
            results[i] = WriteResult(index=plan.items[i].index, size_in_bytes=length,
                                     storage_data=_StorageInfo(written.name, offset, length))
        future: Future = Future()
        future.set_result(results)
        return future

    def write(self, plan: SavePlan, planner: Any) -> Written:
        """Write this rank's file, fsynced; where each item went and the CRC-32s."""
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        # (as DCP's loop: byte items first, then tensors, in plan order)
        ordered = sorted(range(len(plan.items)), key=lambda i: plan.items[i].type != WriteItemType.BYTE_IO)
        written, crc = Written(name, 0, 0), 0
        f = _File(Path(self.path) / name)
        try:
            for i in ordered:
                item = plan.items[i]
                offset = f.pos
                f.item = ItemCRC()
                start = 0
                if item.type == WriteItemType.BYTE_IO:
                    data = planner.resolve_data(item).getbuffer()
                    f.item.update(data)
                    f.put(data)
                else:
                    start = _put_tensor(f, _local_shard(planner, item))
                length = f.pos - offset
                item_crc = f.item.finish()
                crc = crc32_combine(crc, item_crc, length)
                written.add(offset, length, item_crc, i, start, f.item.blocks)
        except BaseException:
            f.close(sync=False)
            raise
        f.close()
        written.size, written.crc = f.pos, crc
        return written


def _put_tensor(f: _File, tensor: torch.Tensor) -> int:
    """Append ``torch.save(tensor)``'s bytes (a view into a larger storage: its own bytes
    only, as ``torch.save(tensor.clone())``), through ``f.item``; where the contiguous
    storage starts in them if they are its template's archive (``head + storage + tail``),
    else 0."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    found = template(tensor)
    if found is not None:
        f.item.update(found.head)
        f.put(found.head)
        storage_crc = f.put_storage(tensor)
        tail = found.tail_for(storage_crc)
        f.item.update(tail)
        f.put(tail)
        return len(found.head)
    if tensor.untyped_storage().nbytes() != tensor.nbytes:
        tensor = tensor.clone()  # its own storage, this tensor's bytes only
    torch.save(tensor, f)
    return 0


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


@dataclasses.dataclass
class _Span:
    """The part of a stored item a read request needs, where the item has block CRC-32s:
    its blocks ``first`` to ``first + len(crcs) - 1``, bytes ``[lo, hi)`` of the item, and in
    them the rows asked for, bytes ``[rows_lo, rows_hi)`` of the item, of ``dtype``; each
    block ``block`` bytes (the item's last one shorter)."""

    dtype: torch.dtype
    block: int
    first: int
    crcs: Any
    lo: int
    hi: int
    rows_lo: int
    rows_hi: int


class SafeReader(FileSystemReader):
    """DCP's ``FileSystemReader``, its ``.metadata`` unpickled with an allow-list; with a
    ``manifest``, every byte checked against its CRC-32 before it is decoded: ``.metadata``
    whole, each stored item (a tensor's chunk) as DCP reads it, so no byte is read twice;
    where a request needs only a range of rows (dim 0) of an item with block CRC-32s, only
    the blocks that hold them, each checked."""

    def __init__(self, path: Path, manifest: dict | None = None) -> None:
        super().__init__(path)
        self.manifest = manifest
        self._metadata: bytes | None = None
        self._crcs = {} if manifest is None else {
            (name, offset): crc for name, entry in manifest["files"].items()
            for offset, _, crc in entry.get("items", ())}
        # (name, offset) -> (block size, where the storage starts in the item, its blocks' CRC-32s packed)
        self._blocks: dict[tuple[str, int], tuple[int, int, str]] = {}
        for name, entry in ({} if manifest is None else manifest["files"]).items():
            blocks = entry.get("blocks")
            size = blocks.get("bytes") if isinstance(blocks, dict) else None
            if type(size) is int and size > 0:
                for offset, start, packed in blocks.get("items", ()):
                    self._blocks[(name, offset)] = (size, start, packed)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        """As torch's ``FileSystemReader.read_data`` (torch 2.13), with a manifest: each file's
        items read in their order in it, the next one read on a thread while this one is
        checked and copied (reading and ``zlib.crc32`` let go of the GIL); each item checked
        against its CRC-32 before it is decoded; a tensor written as ``torch.save``'s archive
        of a contiguous tensor (every tensor phalanx writes but a non-contiguous one) decoded
        from the checked bytes where they are (:meth:`~.dcp_items.Template.storage_in`),
        anything else by ``torch.load(weights_only=True)``; then copied into the target."""
        if self.manifest is None:
            return super().read_data(plan, planner)
        per_file: dict[str, list] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        with ThreadPoolExecutor(1, thread_name_prefix="phalanx-read") as reading:
            for name, reqs in per_file.items():
                reqs.sort(key=lambda r: self.storage_data[r.storage_index].offset)
                spans = [self._span(req, planner) for req in reqs]
                with open(Path(self.path) / name, "rb", buffering=0) as f:
                    ahead = reading.submit(self._read_item, f, reqs[0], spans[0])
                    for i, req in enumerate(reqs):
                        data = ahead.result()
                        if i + 1 < len(reqs):
                            ahead = reading.submit(self._read_item, f, reqs[i + 1], spans[i + 1])
                        if spans[i] is None:
                            self._load_item(req, data, planner)
                        else:
                            self._load_rows(req, data, spans[i], planner)
        done: Future = Future()
        done.set_result(None)
        return done

    def _span(self, req: Any, planner: LoadPlanner) -> _Span | None:
        """The blocks to read for ``req`` if it needs only some of the rows (dim 0) of a stored
        item that has block CRC-32s and is the archive of a contiguous tensor of its chunk's
        dtype and shape (the metadata's), whose storage starts where the manifest says and
        whose length is the template's for that dtype and shape; else ``None``: read it whole."""
        sinfo = self.storage_data[req.storage_index]
        blocks = self._blocks.get((sinfo.relative_path, sinfo.offset))
        if blocks is None or req.type != LoadItemType.TENSOR or sinfo.transform_descriptors:
            return None
        found = _chunk(planner, req)
        if found is None:
            return None
        chunk, dtype = found
        sizes = tuple(chunk.sizes)
        offsets, lengths = tuple(req.storage_offsets), tuple(req.lengths)
        if not sizes or len(offsets) != len(sizes) or len(lengths) != len(sizes) or any(offsets[1:]) \
                or lengths[1:] != sizes[1:] or not 0 < lengths[0] < sizes[0] or offsets[0] + lengths[0] > sizes[0]:
            return None  # (not a strict range of whole rows)
        size, start, packed = blocks
        layout = template_for(dtype, sizes)
        if layout is None or start != len(layout.head) or \
                sinfo.length != len(layout.head) + layout.nbytes + len(layout.tail):
            return None
        try:
            crcs = unpack_crcs(packed)
        except (ValueError, TypeError):
            return None  # (not as phalanx writes them: read whole, checked by the item's CRC-32)
        if len(crcs) != blocks_of(sinfo.length, size):
            return None
        row = layout.nbytes // sizes[0]
        rows_lo = start + offsets[0] * row
        rows_hi = rows_lo + lengths[0] * row
        first, last = rows_lo // size, blocks_of(rows_hi, size)
        return _Span(dtype, size, first, crcs[first:last], first * size, min(last * size, sinfo.length),
                     rows_lo, rows_hi)

    def _read_item(self, f: Any, req: Any, span: _Span | None = None) -> bytearray:
        """The stored item of ``req``, whole, or its bytes ``[span.lo, span.hi)``."""
        sinfo = self.storage_data[req.storage_index]
        lo, hi = (0, sinfo.length) if span is None else (span.lo, span.hi)
        data = bytearray(hi - lo)
        view, got = memoryview(data), 0
        while got < hi - lo:
            n = os.preadv(f.fileno(), [view[got:]], sinfo.offset + lo + got)
            if n == 0:
                break  # (short: its CRC-32 fails below, naming the file)
            got += n
        return data if got == hi - lo else data[:got]

    def _load_rows(self, req: Any, data: bytearray, span: _Span, planner: LoadPlanner) -> None:
        """``req``'s rows from ``data``, the blocks of ``span`` (checked first), copied into the target."""
        sinfo = self.storage_data[req.storage_index]
        check_blocks(Path(self.path), sinfo.relative_path, sinfo.offset, span.first, data, span.crcs, span.block)
        tensor = torch.frombuffer(data, dtype=span.dtype, offset=span.rows_lo - span.lo,
                                  count=(span.rows_hi - span.rows_lo) // span.dtype.itemsize)
        self._copy(req, sinfo, tensor.view(tuple(req.lengths)), planner)

    def _load_item(self, req: Any, data: bytearray, planner: LoadPlanner) -> None:
        sinfo = self.storage_data[req.storage_index]
        check_item(Path(self.path), sinfo.relative_path, sinfo.offset, data,
                   self._crcs.get((sinfo.relative_path, sinfo.offset)))
        stream: Any = io.BytesIO(data)
        if sinfo.transform_descriptors:
            stream = io.BytesIO(self.transforms.transform_load_stream(
                req, sinfo.transform_descriptors, stream).read(-1))
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, stream)
            return
        tensor = None if sinfo.transform_descriptors else _decoded(planner, req, data)
        if tensor is None:
            tensor = torch.load(stream, map_location="cpu", weights_only=True)
        tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        self._copy(req, sinfo, tensor, planner)

    def _copy(self, req: Any, sinfo: Any, tensor: torch.Tensor, planner: LoadPlanner) -> None:
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise DamagedCheckpoint(f"Checkpoint {self.path}: the item of {req.storage_index.fqn} at offset "
                                    f"{sinfo.offset} of {sinfo.relative_path} holds {tuple(tensor.size())}, "
                                    f"the load asked for {tuple(target.size())}")
        target.copy_(tensor)
        planner.commit_tensor(req, target)

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


def _chunk(planner: Any, req: Any) -> tuple[Any, torch.dtype] | None:
    """The metadata of ``req``'s stored chunk (offsets and sizes) and its tensor's dtype."""
    metadata = getattr(planner, "metadata", None)
    entry = None if metadata is None else metadata.state_dict_metadata.get(req.storage_index.fqn)
    chunks = getattr(entry, "chunks", None)
    if not chunks:
        return None
    offset, index = req.storage_index.offset, req.storage_index.index
    chunk = chunks[index] if index is not None and index < len(chunks) and chunks[index].offsets == offset \
        else next((c for c in chunks if c.offsets == offset), None)
    if chunk is None:
        return None
    return chunk, entry.properties.dtype


def _decoded(planner: Any, req: Any, data: bytearray) -> torch.Tensor | None:
    """The tensor of the archive ``data`` (checked) of ``req``'s stored chunk, as a view of
    ``data``, if it is the archive :mod:`~.dcp_items` writes for the chunk's dtype and
    shape (from the checkpoint's metadata); else ``None``."""
    found = _chunk(planner, req)
    if found is None:
        return None
    chunk, dtype = found
    layout = template_for(dtype, tuple(chunk.sizes))
    storage = None if layout is None else layout.storage_in(data)
    if storage is None:
        return None
    return torch.frombuffer(storage, dtype=dtype).view(tuple(chunk.sizes))


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
    return _stage_tensor(tree, previous)


def _stage_tensor(tree: torch.Tensor, previous: Any) -> torch.Tensor:
    if isinstance(tree, DTensor):
        local = tree.to_local().detach()
        if (isinstance(previous, DTensor) and previous.shape == tree.shape
                and previous.placements == tree.placements and previous.device_mesh == tree.device_mesh
                and _fits(previous.to_local(), local)):
            previous.to_local().copy_(local)
            return previous
        # the tensor's own spec over the host copy (DTensor.from_local would copy it back
        # onto the mesh's device: a GPU's)
        return DTensor(local.to("cpu", copy=True), tree._spec, requires_grad=False)
    if not isinstance(previous, DTensor) and _fits(previous, tree):
        previous.copy_(tree.detach())
        return previous
    return tree.detach().to("cpu", copy=True)


def _fits(buffer: Any, tensor: torch.Tensor) -> bool:
    return (isinstance(buffer, torch.Tensor) and buffer.device.type == "cpu" and buffer.dtype == tensor.dtype
            and buffer.shape == tensor.shape and buffer.stride() == tensor.stride())


def _own(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory and version counter ``tensor`` uses (a DTensor's local one)."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


class StaleStaging(CheckpointError):
    """A tensor whose staging was deferred changed before it was copied."""


class DeferredStaging:
    """:func:`stage` split in two, so that a background save stalls training for the copies
    only of what may change before the next optimizer step.

    ``DeferredStaging(tree, previous, now)`` (the caller's thread, at save time) copies the
    tensors ``now(path, tensor)`` picks (a model's buffers, which a forward pass may change)
    and notes the version counter of every other one; :meth:`finish` (the writer's thread)
    copies those, then checks that none of their version counters moved: an in-place change
    (an optimizer step, ``copy_``, ``load_state_dict``) bumps it, so the copy is the state at
    save time, bit for bit, or :meth:`finish` raises :class:`StaleStaging` naming the first
    tensor that changed. :attr:`done` is set once :meth:`finish` has returned or raised;
    every optimizer's ``step()`` waits for it (see ``dcp_checkpoint``), which is what keeps
    the state still in between. With CUDA, the copies are made on the stream that was
    current at save time, after what it had queued (the updates being copied)."""

    def __init__(self, tree: dict, previous: Any, now: Any) -> None:
        self.done = threading.Event()
        self._later: list[tuple[tuple, torch.Tensor, Any, int]] = []
        self._stream = torch.cuda.current_stream() if (
            torch.cuda.is_available() and torch.cuda.is_initialized()) else None
        with torch.no_grad():  # (once: a decorator on _walk would enter it at every level)
            self.tree = self._walk(tree, previous if isinstance(previous, dict) else {}, (), now)

    def _walk(self, tree: dict, previous: dict, path: tuple, now: Any) -> dict:
        out: dict = {}
        for key, value in tree.items():
            before = previous.get(key)
            if isinstance(value, dict):
                out[key] = self._walk(value, before if isinstance(before, dict) else {}, (*path, key), now)
            elif now((*path, key), value):
                out[key] = _stage_tensor(value, before)
            else:
                out[key] = None
                self._later.append(((*path, key), value, before, _own(value)._version))
        return out

    @torch.no_grad()
    def finish(self) -> dict:
        """The staged tree (every tensor copied); raises :class:`StaleStaging`."""
        try:
            if self._stream is not None:
                with torch.cuda.stream(self._stream):
                    self._copy()
            else:
                self._copy()
            changed = next((path for path, value, _, version in self._later
                            if _own(value)._version != version), None)
            if changed is not None:
                raise StaleStaging(
                    f"{'.'.join(map(str, changed))} changed between save(blocking=False) and its copy "
                    "to host memory, by something other than an optimizer's step() (which waits "
                    "for the copy): the checkpoint would not hold the state at save time; call "
                    "Checkpointer.wait() before changing the state that way")
            return self.tree
        finally:
            self._later = []  # (the live tensors are not held past the staging)
            self.done.set()

    def _copy(self) -> None:
        for path, value, before, _ in self._later:
            node = self.tree
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = _stage_tensor(value, before)
