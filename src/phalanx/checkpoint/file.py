"""One checkpoint file on disk: atomic write, checksum, verified and safe read, housekeeping.

Single-process code; :mod:`phalanx.checkpoint.checkpointer` decides who calls it and when.

File layout (little-endian)::

    [0, 64)      header: magic b"PHALANX\\x00", format (u32), payload length (u64),
                 payload CRC-32 (u32), zero padding, and at [60, 64) the CRC-32 of [0, 60)
    [64, end)    payload, format 1: the bytes of ``torch.save(state)``
                 payload, format 2 (framed): ``torch.save(state)``, then one
                 ``torch.save(tensor)`` per frame, then the end offset (u64) of each of
                 these n + 1 parts and n + 1 (u64)

Format 2 lets a writer stream tensors it never holds together (a sharded model gathered one
tensor at a time) and a reader decode and drop them one at a time (``select``).

Every byte is covered by a checksum: a flipped byte anywhere is reported, as is a file whose
size does not match the length its header announces. The payload is decoded only after its
checksum matched, from the very bytes that were checked (one read-only mapping of the file),
and only by ``torch.load(..., weights_only=True)``, which builds tensors and plain containers
and refuses any other object: a checkpoint cannot run code when it is loaded.

Writing: a temporary file in the target directory (created exclusively and ``flock``-ed by its
writer), the payload streamed through the checksum, the header written last, flush, fsync,
rename onto the final name, fsync of the directory. A writer that dies at any point leaves the
final names untouched; the temporary it leaves is removed by the next writer, which can tell a
dead writer's file by taking its lock.
"""

from __future__ import annotations

import ctypes
import fcntl
import io
import mmap
import os
import pickle
import re
import shutil
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from ..errors import CheckpointError

MAGIC = b"PHALANX\x00"
FORMAT_VERSION = 1
FRAMED_FORMAT = 2
_U64 = struct.Struct("<Q")
# 64 bytes keep the payload (and torch's 64-byte aligned storages inside it) aligned.
HEADER_SIZE = 64
_FIELDS = struct.Struct("<8sIQI")  # magic, format, payload length, payload CRC-32
_HEADER_CRC_AT = HEADER_SIZE - 4

_NAME = re.compile(r"^ckpt-(\d{12})\.ckpt$")
_TEMP = re.compile(r"^\.ckpt-\d{12}\.ckpt\.tmp-")


def checkpoint_name(step: int) -> str:
    """The file name of the checkpoint of ``step``: ``ckpt-000000000042.ckpt``."""
    return f"ckpt-{step:012d}.ckpt"


def checkpoint_step(path: str | os.PathLike) -> int:
    """The step in a checkpoint's file name (``ckpt-000000000042.ckpt`` -> 42)."""
    match = _NAME.match(Path(path).name)
    if match is None:
        raise ValueError(f"{path} is not named like a checkpoint (ckpt-<12 digits>.ckpt)")
    return int(match.group(1))


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Complete checkpoints (final names) in ``directory``, oldest step first; ``[]`` if none."""
    directory = Path(directory)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = sorted((int(m.group(1)), name) for name in names if (m := _NAME.match(name)))
    return [directory / name for _, name in found]


# A chunk this large has its CRC-32 computed on a helper thread while this thread writes it
# (zlib.crc32 and file writes both release the GIL), so the checksum adds no time where a
# second core is free. torch.save hands each tensor's storage over in one write; below
# 1 MiB the hand-off to the thread costs more than the checksum.
_PARALLEL_CRC_BYTES = 1 << 20
# After every 8 MiB written, start the kernel's writeback of those bytes (Linux
# sync_file_range, SYNC_FILE_RANGE_WRITE = 2, from <fcntl.h>): the disk writes overlap the rest
# of the serialisation and the final fsync has little left to wait for. Measured on a
# 105 MB save here: fsync went from ~35 ms after the write to ~5 ms.
_WRITEBACK_BYTES = 8 << 20
_SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux (glibc): the final fsync does all the work
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range()


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start the kernel's writeback of ``length`` bytes of ``fd`` from ``offset`` (no wait);
    nothing where there is no ``sync_file_range``."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


class _ChecksumWriter:
    """A write-only file object that checksums what passes through it to ``file``."""

    def __init__(self, file: io.BufferedWriter, pool: ThreadPoolExecutor) -> None:
        self._file = file
        self._pool = pool
        self._synced = 0  # payload bytes whose writeback has been started
        self.crc = 0
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.nbytes >= _PARALLEL_CRC_BYTES:
            crc = self._pool.submit(zlib.crc32, view, self.crc)
            written = self._file.write(view)
            self.crc = crc.result()  # before returning: torch may reuse the buffer
        else:
            self.crc = zlib.crc32(view, self.crc)
            written = self._file.write(view)
        self.size += written
        if self.size - self._synced >= _WRITEBACK_BYTES:
            self._file.flush()
            start_writeback(self._file.fileno(), HEADER_SIZE + self._synced, self.size - self._synced)
            self._synced = self.size
        return written

    def flush(self) -> None:
        self._file.flush()


def _header(payload_size: int, payload_crc: int, version: int = FORMAT_VERSION) -> bytes:
    fields = _FIELDS.pack(MAGIC, version, payload_size, payload_crc)
    head = fields.ljust(_HEADER_CRC_AT, b"\x00")
    return head + struct.pack("<I", zlib.crc32(head))


def write_checkpoint(path: str | os.PathLike, state: Any,
                     frames: Iterable[torch.Tensor] | None = None, sync: bool = True) -> int:
    """Write ``state`` to ``path`` atomically (see the module notes); return the file's size.

    The directory is created if needed. ``state`` must be made of what
    ``torch.load(weights_only=True)`` accepts; the caller checks that. With ``frames``
    (format 2), each tensor it yields is written after ``state`` and released before the
    next is asked for. ``sync=False``: neither the file nor the directory is fsynced (a file
    inside a directory the caller makes durable before anything names it).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
    f = open(tmp, "xb")  # exclusive creation: never another writer's file
    writer = None
    try:
        with f, ThreadPoolExecutor(1) as pool:
            # Held until the file is closed: tells clean_stale_temps this writer is alive.
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            f.write(bytes(HEADER_SIZE))
            writer = _ChecksumWriter(f, pool)
            torch.save(state, writer)
            if frames is not None:
                _write_frames(writer, frames)
            f.seek(0)
            f.write(_header(writer.size, writer.crc, FORMAT_VERSION if frames is None else FRAMED_FORMAT))
            f.flush()
            if sync:
                os.fsync(f.fileno())
            os.replace(tmp, path)  # still open and locked: no cleaner can take it meanwhile
    except BaseException as e:
        _remove(tmp)
        disk = _os_error(e)
        if disk is None:
            raise
        written = HEADER_SIZE + (writer.size if writer is not None else 0)
        raise CheckpointError(
            f"Cannot write checkpoint {path}: {disk.strerror.lower()} (errno {disk.errno}) after "
            f"{written} bytes; {_free(path.parent)}. The checkpoints already there are untouched"
        ) from e
    if sync:
        fsync_path(path.parent)
    return HEADER_SIZE + writer.size


def _write_frames(writer: _ChecksumWriter, frames: Iterable[torch.Tensor]) -> None:
    ends = [writer.size]
    for tensor in frames:
        torch.save(tensor, writer)
        ends.append(writer.size)
        del tensor  # before the next is made: one frame alive at a time
    writer.write(struct.pack(f"<{len(ends) + 1}Q", *ends, len(ends)))


def _os_error(error: BaseException) -> OSError | None:
    """The OSError behind ``error``: itself, or the one torch's writer turned into
    "enforce fail at inline_container.cc ... unexpected pos" (it is kept as the context)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError) and error.errno is not None:
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _free(directory: Path) -> str:
    try:
        usage = shutil.disk_usage(directory)
    except OSError:
        return "free space unknown"
    return f"{usage.free} bytes free of {usage.total} on that file system"


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file, or a directory, which makes its renames and unlinks durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def clean_stale_temps(directory: str | os.PathLike) -> list[Path]:
    """Remove temporary files left by writers that died; return what was removed."""
    return remove_unlocked(directory, lambda path: bool(_TEMP.match(path.name)), _remove)


def remove_unlocked(directory: str | os.PathLike, match: Callable[[Path], bool],
                    remove: Callable[[Path], None]) -> list[Path]:
    """``remove`` each entry of ``directory`` that ``match`` accepts and whose writer died;
    return what was removed.

    An entry whose ``flock`` can be taken has no living writer (the kernel drops a process's
    locks when it dies), so a concurrent save in progress is never touched.
    """
    directory = Path(directory)
    removed = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        path = directory / name
        if not match(path):
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its writer is alive
        else:
            remove(path)
            removed.append(path)
        finally:
            os.close(fd)
    return removed


def prune(directory: str | os.PathLike, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints in ``directory``; return the deleted."""
    doomed = list_checkpoints(directory)[:-keep]
    for path in doomed:
        _remove(path)
    if doomed:
        fsync_path(directory)
    return doomed


class _Window(io.RawIOBase):
    """A read-only, seekable file object over a byte buffer (no copy until read)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), len(self._view) - self._pos))
        buffer[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n


def read_checkpoint(path: str | os.PathLike, map_location: Any = "cpu",
                    select: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Any:
    """Verify the file at ``path`` and return what was saved in it, tensors on ``map_location``.

    A framed file (format 2) returns its state (a dict) with the list of its frames under
    ``"frames"``, each passed through ``select`` as soon as it is decoded (default: kept whole).

    Raises:
        CheckpointError: naming ``path`` and what failed: missing, empty, truncated, not a
            phalanx checkpoint, header or payload checksum mismatch, an object that safe
            loading refuses (e.g. a pickle that would run code), or undecodable content.
    """
    path = Path(path)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise CheckpointError(f"Checkpoint {path} does not exist") from None
    except OSError as e:
        raise CheckpointError(f"Checkpoint {path} cannot be opened: {e}") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise CheckpointError(f"Checkpoint {path} is empty (0 bytes)")
        if size < HEADER_SIZE:
            raise CheckpointError(
                f"Checkpoint {path} is truncated: {size} bytes, shorter than its "
                f"{HEADER_SIZE}-byte header"
            )
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _decode(memoryview(mapped), path, map_location, select)
    finally:
        try:
            mapped.close()
        except BufferError:
            pass  # a traceback still holds a view into it; the mapping goes with it


def _decode(view: memoryview, path: Path, map_location: Any, select: Callable | None) -> Any:
    magic, version, payload_size, payload_crc = _FIELDS.unpack_from(view)
    if magic != MAGIC:
        raise CheckpointError(
            f"Checkpoint {path} is not a phalanx checkpoint: it starts with {bytes(view[:8])!r}, "
            f"expected {MAGIC!r}"
        )
    (header_crc,) = struct.unpack_from("<I", view, _HEADER_CRC_AT)
    if zlib.crc32(view[:_HEADER_CRC_AT]) != header_crc:
        raise CheckpointError(f"Checkpoint {path} is corrupt: its header fails its checksum")
    if version not in (FORMAT_VERSION, FRAMED_FORMAT):
        raise CheckpointError(f"Checkpoint {path} has format {version}; this phalanx reads "
                              f"formats {FORMAT_VERSION} and {FRAMED_FORMAT}")
    expected = HEADER_SIZE + payload_size
    if len(view) != expected:
        state = "truncated" if len(view) < expected else "too long"
        raise CheckpointError(
            f"Checkpoint {path} is {state}: {len(view)} bytes, its header announces {expected}"
        )
    payload = view[HEADER_SIZE:]
    # The checksum is computed on a helper thread while torch decodes the same bytes, and the
    # result is used only if the checksum matched. Decoding unverified bytes is safe because
    # the weights-only unpickler builds tensors and plain containers and nothing else, whatever
    # the bytes (the reason for torch >= 2.10, which fixed a memory-safety hole in it).
    with ThreadPoolExecutor(1) as pool:
        crc = pool.submit(zlib.crc32, payload)
        try:
            if version == FRAMED_FORMAT:
                state = _load_framed(payload, path, map_location, select)
            else:
                state = _load(payload, path, map_location)
        except BaseException:
            _verify(crc.result(), payload_crc, path)  # damage, if any, explains the failure
            raise
        _verify(crc.result(), payload_crc, path)
    return state


def _load_framed(payload: memoryview, path: Path, map_location: Any, select: Callable | None) -> Any:
    count = _U64.unpack_from(payload, len(payload) - _U64.size)[0] if len(payload) >= _U64.size else 0
    table = len(payload) - _U64.size * (count + 1)
    ends = list(struct.unpack_from(f"<{count}Q", payload, table)) if 0 < count and table >= 0 else []
    if not ends or ends != sorted(ends) or ends[-1] != table:
        raise CheckpointError(f"Checkpoint {path} is corrupt: its frame table does not describe "
                              f"its {len(payload)}-byte payload")
    state = _load(payload[:ends[0]], path, map_location)
    if not isinstance(state, dict):
        raise CheckpointError(f"Checkpoint {path} is framed but its first frame is not a dict")
    state["frames"] = []
    for start, end in zip(ends, ends[1:]):
        frame = _load(payload[start:end], path, map_location)
        if not isinstance(frame, torch.Tensor):
            raise CheckpointError(f"Checkpoint {path}: a frame holds a {type(frame).__name__}, not a tensor")
        state["frames"].append(frame if select is None else select(frame))
        del frame  # (only what select kept stays)
    return state


def _verify(found: int, stored: int, path: Path) -> None:
    if found != stored:
        raise CheckpointError(
            f"Checkpoint {path} is corrupt: checksum mismatch (CRC-32 stored {stored:#010x}, "
            f"computed {found:#010x})"
        )


def _load(payload: memoryview, path: Path, map_location: Any) -> Any:
    try:
        return torch.load(_Window(payload), map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"Checkpoint {path} was refused: it holds objects that safe loading "
            f"(torch.load weights_only=True) does not allow, such as a pickle that would run "
            f"code; nothing in it was executed. torch says: {_unpickler_reason(e)}"
        ) from None
    except Exception as e:
        raise CheckpointError(
            f"Checkpoint {path} cannot be decoded: {type(e).__name__}: {e}"
        ) from e


def _unpickler_reason(error: Exception) -> str:
    """The specific part of torch's weights-only refusal (its second paragraph names the object)."""
    paragraphs = [p.strip() for p in str(error).split("\n\n") if p.strip()]
    if not paragraphs:
        return type(error).__name__
    return paragraphs[1] if len(paragraphs) > 1 else paragraphs[0]
