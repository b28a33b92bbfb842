"""The bytes ``torch.save`` writes for one tensor, without ``torch.save``: what each item of a
DCP file is (torch's ``FileSystemWriter`` ``torch.save``'s every tensor into the file, and its
reader ``torch.load``'s each item), written at the cost of the tensor's bytes alone.

``torch.save`` of a tensor is a small zip archive whose every part but one depends only on the
tensor's dtype and shape: the pickle, the version records, the zip headers and directory.
The one that does not is the storage's bytes, and two things computed from them: the
record's CRC-32 (in its data descriptor and in the central directory) and the archive's
``serialization_id`` (a hash of the record names, then a fold of every record's CRC-32, with
its own CRC-32). For each ``(dtype, shape)`` a :class:`Template` is made once, by
``torch.save`` itself under ``torch.serialization.skip_data()`` (which leaves a hole where the
storage goes, without reading or copying it): the bytes before the storage (:attr:`Template.head`,
the same for every tensor of that dtype and shape) and after it (:attr:`Template.tail`, whose
CRC-32 fields and ``serialization_id`` :meth:`Template.tail_for` fills in from the storage's
CRC-32). The storage's bytes themselves go from the tensor's memory to the file: no copy, no
``.clone()`` of a view into a larger storage (``torch.save`` writes whole storages, so DCP's
writer must copy such a view first; the bytes written here are those ``torch.save`` writes
for ``tensor.clone()``).

:func:`template` gives ``None`` where the result would not be exactly ``torch.save``'s (the
caller then uses ``torch.save``): a tensor that is not a plain, dense, contiguous CPU tensor
of 1 byte to 4 GiB, or a torch whose ``torch.save`` does not lay out its archive as this
module expects: the first template made in a process is checked against ``torch.save`` byte
for byte, and if they differ no template is used in that process.
"""

from __future__ import annotations

import ctypes
import io
import struct
import threading
import zlib
from typing import Any

import torch

from .._logging import get_logger

_log = get_logger(__name__)

_LOCAL = b"PK\x03\x04"
_CENTRAL = b"PK\x01\x02"
_DESCRIPTOR = b"PK\x07\x08"
_EOCD = b"PK\x05\x06"
_SERIALIZATION_ID = ".data/serialization_id"
_MASK = (1 << 64) - 1
_MAX_TEMPLATES = 4096  # distinct (dtype, shape)s kept: a model has a few dozen
# Storages from 4 GiB on make torch write zip64 records, which the checks below do not cover
# (torch.save writes those, as DCP's writer would)
_ZIP32 = 0xFFFF0000


def _hash_combine(seed: int, value: int) -> int:
    """c10::hash_combine on 64-bit size_t, as torch folds its records' CRC-32s."""
    return (seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _MASK) + (seed >> 2)) & _MASK)) & _MASK


class _Hole:
    """A file-like that keeps what ``torch.save`` writes under ``skip_data`` and where it
    skips the storage (a forward seek), without materialising it."""

    def __init__(self) -> None:
        self.before = bytearray()
        self.after = bytearray()
        self.hole: int | None = None  # the skipped storage's length
        self.pos = 0

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        (self.before if self.hole is None else self.after).extend(data)
        self.pos += n
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence not in (0, 1):
            raise ValueError(f"torch.save seeked with whence={whence}")
        target = offset if whence == 0 else self.pos + offset
        if target != self.pos:
            if target < self.pos or self.hole is not None:
                raise ValueError("torch.save seeked back, or skipped more than one storage")
            self.hole, self.pos = target - self.pos, target
        return self.pos

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass


class Template:
    """``torch.save``'s bytes for a contiguous CPU tensor of one dtype and shape, but its
    storage's: ``head + storage + tail_for(crc32(storage))``."""

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        probe = torch.empty(shape, dtype=dtype)  # never read: skip_data does not touch it
        out = _Hole()
        with torch.serialization.skip_data():
            torch.save(probe, out)
        nbytes = probe.numel() * probe.element_size()
        if out.hole != nbytes:
            raise ValueError(f"torch.save skipped {out.hole} bytes for a storage of {nbytes}")
        self.head, self.nbytes = bytes(out.before), nbytes
        self.head_crc = zlib.crc32(self.head)
        tail = bytes(out.after)
        records = _central_directory(self.head, tail, nbytes)
        start = len(self.head)  # the storage's offset in the archive
        data = [r for r in records if r["start"] == start]
        sid = [r for r in records if r["name"].endswith("/" + _SERIALIZATION_ID)]
        if len(data) != 1 or len(sid) != 1 or records[-1] is not sid[0] or data[0]["size"] != nbytes:
            raise ValueError("torch.save's archive is not laid out as expected (storage, serialization id)")
        # every CRC-32 field that depends on the storage, as offsets into the tail
        self._data_fields = [data[0]["central_crc"] - start - nbytes, data[0]["descriptor_crc"] - start - nbytes]
        self._sid_fields = [sid[0]["central_crc"] - start - nbytes, sid[0]["descriptor_crc"] - start - nbytes]
        self._sid_at = sid[0]["start"] - start - nbytes
        old_sid = tail[self._sid_at:self._sid_at + sid[0]["size"]]
        if sid[0]["size"] != 40 or not old_sid.isdigit() or min(self._data_fields + self._sid_fields) < 0:
            raise ValueError(f"torch.save's serialization id is not 40 digits ({old_sid!r})")
        self._sid_head = old_sid[:20]  # the hash of the record names: the same for every storage
        # the fold of the records' CRC-32s, before and after the storage's (the id's excluded)
        crcs = [r["crc"] for r in records[:-1]]
        at = records.index(data[0])
        self._fold_before = 0
        for crc in crcs[:at]:
            self._fold_before = _hash_combine(self._fold_before, crc)
        self._after = crcs[at + 1:]
        self.tail = tail

    def tail_for(self, storage_crc: int) -> bytes:
        """The tail of the archive of a storage whose CRC-32 is ``storage_crc``."""
        fold = _hash_combine(self._fold_before, storage_crc)
        for crc in self._after:
            fold = _hash_combine(fold, crc)
        sid = self._sid_head + b"%020d" % fold
        tail = bytearray(self.tail)
        tail[self._sid_at:self._sid_at + 40] = sid
        sid_crc = zlib.crc32(sid)
        for at in self._data_fields:
            struct.pack_into("<I", tail, at, storage_crc)
        for at in self._sid_fields:
            struct.pack_into("<I", tail, at, sid_crc)
        return bytes(tail)

    def storage_in(self, archive: Any) -> memoryview | None:
        """The storage's bytes in ``archive`` (bytes-like) if it is this template's archive of
        some storage (``head`` and the tail's bytes but its CRC-32 fields and serialization
        id equal), else ``None``: read so, the bytes are what ``torch.load`` of the archive
        gives (a contiguous tensor of this dtype and shape), without ``torch.load``."""
        view = memoryview(archive).cast("B")
        head, end = len(self.head), len(self.head) + self.nbytes
        if view.nbytes != end + len(self.tail) or view[:head] != self.head:
            return None
        tail = bytearray(view[end:])
        for at in self._data_fields + self._sid_fields:
            tail[at:at + 4] = self.tail[at:at + 4]
        tail[self._sid_at:self._sid_at + 40] = self.tail[self._sid_at:self._sid_at + 40]
        return view[head:end] if tail == self.tail else None


def _central_directory(head: bytes, tail: bytes, hole: int) -> list[dict]:
    """Each record of the archive ``head + <hole bytes> + tail``: name, start of its data,
    size, CRC-32 (the central directory's), and the absolute offsets of its two CRC-32
    fields (central directory, data descriptor). Only ``tail`` and ``head`` are read."""
    start_of_tail = len(head) + hole

    def read(offset: int, n: int) -> bytes:
        if offset >= start_of_tail:
            return tail[offset - start_of_tail:offset - start_of_tail + n]
        if offset + n <= len(head):
            return head[offset:offset + n]
        raise ValueError("a zip structure inside the storage's bytes")

    eocd = tail.rfind(_EOCD)
    if eocd < 0:
        raise ValueError("no end of central directory")
    count, _, cd_offset = struct.unpack_from("<HII", tail, eocd + 10)
    if cd_offset == 0xFFFFFFFF or count == 0xFFFF:  # (below _ZIP32 torch fills in the 32-bit fields)
        raise ValueError("a zip64 central directory")
    records, at = [], cd_offset
    for _ in range(count):
        fixed = read(at, 46)
        if fixed[:4] != _CENTRAL:
            raise ValueError("a central directory entry without its signature")
        crc, csize, usize, name_len, extra_len, comment_len = struct.unpack_from("<IIIHHH", fixed, 16)
        (local,) = struct.unpack_from("<I", fixed, 42)
        name = read(at + 46, name_len).decode()
        if 0xFFFFFFFF in (usize, csize, local):
            raise ValueError(f"record {name}: zip64 sizes")
        header = read(local, 30)
        if header[:4] != _LOCAL:
            raise ValueError(f"record {name}: no local header")
        flags, method = struct.unpack_from("<HH", header, 6)
        local_name, local_extra = struct.unpack_from("<HH", header, 26)
        if method != 0 or csize != usize or not flags & 0x8:  # stored, with a data descriptor
            raise ValueError(f"record {name}: compressed or without a data descriptor")
        data_start = local + 30 + local_name + local_extra
        descriptor = data_start + usize
        if read(descriptor, 4) != _DESCRIPTOR:
            raise ValueError(f"record {name}: no data descriptor after its data")
        records.append({"name": name, "start": data_start, "size": usize, "crc": crc,
                        "central_crc": at + 16, "descriptor_crc": descriptor + 4})
        at += 46 + name_len + extra_len + comment_len
    return records


_templates: dict[tuple, Template | None] = {}
# dtypes whose archive is not one plain storage of their element size (sub-byte, quantized)
_NO_TEMPLATE = {getattr(torch, n) for n in ("quint8", "qint8", "qint32", "quint4x2", "quint2x4", "bits1x8",
                                             "bits2x4", "bits4x2", "bits8", "bits16", "uint1", "uint2",
                                             "uint3", "uint4", "uint5", "uint6", "uint7", "int1", "int2",
                                             "int3", "int4", "int5", "int6", "int7") if hasattr(torch, n)}
_lock = threading.Lock()
_checked: bool | None = None  # whether this torch's archives are as expected (checked once)


def _check() -> bool:
    """Whether :class:`Template` reproduces ``torch.save`` byte for byte here (a few dtypes
    and shapes, random bytes)."""
    gen = torch.Generator().manual_seed(0)
    for dtype, shape in ((torch.float32, (3, 5)), (torch.bfloat16, (70,)), (torch.int64, ()),
                         (torch.uint8, (2, 3, 4))):
        tensor = torch.randint(0, 100, shape, generator=gen).to(dtype)
        expected = io.BytesIO()
        torch.save(tensor, expected)
        view = storage_bytes(tensor)
        found = Template(dtype, shape)
        if found.head + bytes(view) + found.tail_for(zlib.crc32(view)) != expected.getvalue():
            return False
    return True


def template(tensor: torch.Tensor) -> Template | None:
    """The template of ``tensor``'s archive, or ``None`` if :mod:`this module <.dcp_items>`
    cannot write it exactly as ``torch.save`` would (see the module notes)."""
    if not (type(tensor) is torch.Tensor and tensor.device.type == "cpu" and tensor.layout == torch.strided
            and 0 < tensor.numel() * tensor.element_size() < _ZIP32 and not tensor.requires_grad
            and tensor.is_contiguous()
            and not tensor.is_quantized and not tensor.is_conj() and not tensor.is_neg()
            and not any(getattr(tensor, "names", None) or ()) and tensor.stride() == _contiguous(tensor.shape)):
        return None
    return _template((tensor.dtype, tuple(tensor.shape)))


def template_for(dtype: torch.dtype, shape: tuple[int, ...]) -> Template | None:
    """The template of a contiguous tensor of ``dtype`` and ``shape``, or ``None`` (as
    :func:`template`)."""
    if not isinstance(dtype, torch.dtype):
        return None
    try:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    except Exception:
        return None
    if not 0 < nbytes < _ZIP32 or dtype in _NO_TEMPLATE:
        return None
    return _template((dtype, tuple(shape)))


def _template(key: tuple) -> Template | None:
    global _checked
    found = _templates.get(key, False)
    if found is not False:
        return found
    with _lock:
        if _checked is None:
            try:
                _checked = _check()
            except Exception as e:  # (a torch whose archive differs: torch.save it is)
                _log.debug("torch.save's archives are not as expected (%s): DCP items go through torch.save", e)
                _checked = False
            if not _checked:
                _log.info("torch.save's archive layout differs from what phalanx expects: the "
                          "sharded writer uses torch.save for every tensor")
        if not _checked:
            return None
        try:
            made: Template | None = Template(*key)
        except ValueError as e:
            _log.debug("no template for %s %s: %s", *key, e)
            made = None
        if len(_templates) >= _MAX_TEMPLATES:
            _templates.clear()
        _templates[key] = made
        return made


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def storage_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, as a read-only view of its memory (no copy);
    the caller keeps ``tensor`` alive while it uses the view."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    buffer = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    return memoryview(buffer).cast("B").toreadonly()
