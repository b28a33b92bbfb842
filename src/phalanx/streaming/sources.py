"""Where a streaming dataset's samples come from: shard readers for files, and the protocol a
user's own format implements.

A *shard* is one random-access sequence of samples (usually one file). Built-in readers:

* ``.npy`` (:class:`NpyShard`): an array of shape ``(n, ...)`` in C order; sample ``i`` is row
  ``i``, a tensor. Read with phalanx's own header parser (no numpy needed).
* raw token ``.bin`` (:class:`TokenBinShard`, through a :class:`TokenFiles` source): the file
  is a flat run of tokens of one dtype; sample ``i`` is tokens ``[i*seq_len, (i+1)*seq_len)``.
* ``.jsonl`` (:class:`JsonlShard`): one JSON value per line; sample ``i`` is the ``i``-th
  non-blank line, parsed. Blank lines are not records (skipped, as JSON Lines readers do).

Readers open their file lazily, per process: token and ``.npy`` files are mapped (each sample
a view of the file's pages), ``.jsonl`` is read with ``os.pread``, so a reader copied into
forked DataLoader workers never shares a file offset with another process.
"""

from __future__ import annotations

import ast
import errno
import glob
import json
import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Protocol, Sequence, runtime_checkable

import torch


@runtime_checkable
class ShardReader(Protocol):
    """A user's format: a sized, random-access sequence of samples, picklable (it travels to
    DataLoader workers: open files lazily, not in ``__init__``). ``name`` is what error
    messages call it, usually its path. ``__getitem__`` may be called in any order; an
    unreadable record must raise, naming ``name`` and the record."""

    name: str

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


class _File:
    """A file read with ``os.pread``, opened on first use and never pickled open."""

    def __init__(self, path: str) -> None:
        self.name = path
        self._fd: int | None = None
        self._map: mmap.mmap | None = None
        self._rows: torch.Tensor | None = None
        self._pid = -1

    def _open(self) -> int:
        if self._fd is None or self._pid != os.getpid():
            self._fd, self._map, self._pid = os.open(self.name, os.O_RDONLY), None, os.getpid()
            self._rows = None
        return self._fd

    def pread(self, size: int, offset: int) -> bytes:
        data = os.pread(self._open(), size, offset)
        if len(data) != size:
            raise ValueError(
                f"{self.name}: truncated: expected {size} bytes at offset {offset}, got "
                f"{len(data)} (the file changed or was cut short after it was indexed)"
            )
        return data

    def rows(self, dtype: torch.dtype, shape: tuple[int, ...], offset: int) -> torch.Tensor:
        """The file from byte ``offset`` as one tensor of ``shape`` (rows first), viewing the
        file's pages: mapped once per process, copy-on-write (a sample written to leaves the
        file as it is), made once per process, so a sample is a row of it: no system call and
        no copy per sample (``pread`` per sample took ~1.8x a plain loop's time in
        benchmarks/bench_data.py, a ``frombuffer`` per sample 1.4x)."""
        fd = self._open()
        if self._rows is not None:
            return self._rows
        count = math.prod(shape)
        if count == 0:  # (frombuffer refuses an empty view)
            self._rows = torch.empty(shape, dtype=dtype)
            return self._rows
        if self._map is None:
            self._map = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        size = count * dtype.itemsize
        if offset + size > len(self._map):
            raise ValueError(
                f"{self.name}: truncated: expected {size} bytes at offset {offset}, the file has "
                f"{len(self._map)} (the file changed or was cut short after it was indexed)"
            )
        self._rows = torch.frombuffer(self._map, dtype=dtype, count=count, offset=offset).view(shape)
        return self._rows

    def __getstate__(self) -> dict:
        return {"name": self.name}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["name"])

    def __del__(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)


def _missing(path: str) -> FileNotFoundError:
    return FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)


# .npy type strings (numpy's "descr") that torch has a dtype for; byte order '<' or '|' only.
_NPY_DTYPES = {
    "b1": torch.bool, "u1": torch.uint8, "i1": torch.int8, "i2": torch.int16,
    "u2": torch.uint16, "i4": torch.int32, "u4": torch.uint32, "i8": torch.int64,
    "u8": torch.uint64, "f2": torch.float16, "f4": torch.float32, "f8": torch.float64,
}
_NPY_MAGIC = b"\x93NUMPY"


class NpyShard:
    """One ``.npy`` file, sample ``i`` being row ``i`` (a tensor of the array's dtype)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.name = str(path)
        self._file = _File(self.name)
        with open(self.name, "rb") as f:
            head = f.read(12)
            size = os.fstat(f.fileno()).st_size
            if len(head) < 10 or head[:6] != _NPY_MAGIC:
                raise ValueError(f"{self.name}: not a .npy file (no NUMPY magic at its start)")
            wide = head[6] >= 2  # format 2.0 and 3.0 have a 4-byte header length
            length = int.from_bytes(head[8:12] if wide else head[8:10], "little")
            self._data_offset = (12 if wide else 10) + length
            f.seek(12 if wide else 10)
            header = self._header(f.read(length))
        self.dtype = header[0]
        self.shape = header[1]
        self._row_bytes = math.prod(self.shape[1:]) * self.dtype.itemsize
        expected = self._data_offset + self.shape[0] * self._row_bytes
        if size < expected:
            raise ValueError(
                f"{self.name}: corrupt .npy: the header says shape {tuple(self.shape)}, "
                f"{expected} bytes in all, but the file has {size}"
            )

    def _header(self, raw: bytes) -> tuple[torch.dtype, tuple[int, ...]]:
        try:
            header = ast.literal_eval(raw.decode("latin1"))
            descr, fortran, shape = header["descr"], header["fortran_order"], header["shape"]
        except (ValueError, SyntaxError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise ValueError(f"{self.name}: corrupt .npy header ({e})") from None
        if not isinstance(descr, str) or descr[:1] not in "<|" or descr[1:] not in _NPY_DTYPES:
            raise ValueError(
                f"{self.name}: unsupported .npy dtype {descr!r}; expected a little-endian "
                f"one of {', '.join(_NPY_DTYPES)}"
            )
        if fortran or not shape:
            raise ValueError(
                f"{self.name}: expected a C-order array of at least one dimension (samples "
                f"first), got fortran_order={fortran}, shape={shape}"
            )
        return _NPY_DTYPES[descr[1:]], tuple(shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.rows()[index]

    def rows(self) -> torch.Tensor:
        """The whole array, a view of the mapped file (sample ``i`` is row ``i``)."""
        return self._file.rows(self.dtype, self.shape, self._data_offset)


class TokenBinShard:
    """A raw token file: sample ``i`` is tokens ``[i*seq_len, (i+1)*seq_len)`` (a 1-D tensor)."""

    def __init__(self, path: str | os.PathLike, seq_len: int, dtype: torch.dtype) -> None:
        self.name = str(path)
        self.seq_len = seq_len
        self.dtype = dtype
        self._file = _File(self.name)
        self._sample_bytes = seq_len * dtype.itemsize
        size = os.stat(self.name).st_size
        if size % self._sample_bytes:
            raise ValueError(
                f"{self.name}: corrupt token file: {size} bytes is not a whole number of "
                f"samples of seq_len {seq_len} x {dtype} ({self._sample_bytes} bytes each)"
            )
        self._len = size // self._sample_bytes

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.rows()[index]

    def rows(self) -> torch.Tensor:
        """All samples as one ``(len, seq_len)`` tensor, a view of the mapped file."""
        return self._file.rows(self.dtype, (self._len, self.seq_len), 0)


class JsonlShard:
    """A JSON Lines file: sample ``i`` is its ``i``-th non-blank line, parsed.

    Indexing the file (at construction) reads it once to find where each line starts.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.name = str(path)
        self._file = _File(self.name)
        spans, offset = [], 0
        with open(self.name, "rb") as f:
            for line in f:
                if line.strip():
                    spans.append((offset, len(line)))
                offset += len(line)
        self._spans = torch.tensor(spans, dtype=torch.int64).reshape(-1, 2)

    def __len__(self) -> int:
        return self._spans.shape[0]

    def __getitem__(self, index: int) -> Any:
        offset, size = self._spans[index].tolist()
        raw = self._file.pread(size, offset)
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(
                f"{self.name}: corrupt record {index} (the line at byte {offset}): {e}"
            ) from None


@dataclass(frozen=True)
class TokenFiles:
    """Raw token ``.bin`` files (a path, a directory or a glob) with their sample length.

    Args:
        pattern (str or PathLike): files, as for any source.
        seq_len (int): tokens per sample.
        dtype (torch.dtype, optional): the tokens' type. Default ``torch.uint16``.
    """

    pattern: str | os.PathLike
    seq_len: int
    dtype: torch.dtype = torch.uint16

    def readers(self) -> list[ShardReader]:
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise ValueError(f"TokenFiles: expected a positive int seq_len, got {self.seq_len!r}")
        return [TokenBinShard(p, self.seq_len, self.dtype) for p in expand(self.pattern)]


_BY_SUFFIX = {".npy": NpyShard, ".jsonl": JsonlShard}


def expand(pattern: str | os.PathLike) -> list[str]:
    """The files ``pattern`` names: itself, a directory's files (sorted), or a glob's matches
    (sorted, ``**`` recursive).

    Raises:
        FileNotFoundError: nothing there, naming the path or pattern.
    """
    text = os.fspath(pattern)
    if glob.has_magic(text):
        found = sorted(p for p in glob.glob(text, recursive=True) if os.path.isfile(p))
        if not found:
            raise FileNotFoundError(errno.ENOENT, "No files match the pattern", text)
        return found
    if os.path.isdir(text):
        found = sorted(str(p) for p in Path(text).iterdir() if p.is_file())
        if not found:
            raise FileNotFoundError(errno.ENOENT, "No files in the directory", text)
        return found
    if not os.path.exists(text):
        raise _missing(text)
    return [text]


def _file_readers(path: str) -> ShardReader:
    reader = _BY_SUFFIX.get(Path(path).suffix)
    if reader is None:
        raise ValueError(
            f"{path}: no reader for files ending {Path(path).suffix!r}; phalanx reads "
            f"{', '.join(_BY_SUFFIX)} by name, raw token files through TokenFiles(pattern, "
            "seq_len, dtype), and other formats through a ShardReader"
        )
    return reader(path)


def resolve(sources: Iterable[Any]) -> list[ShardReader]:
    """The shard readers of ``sources``, in order: paths, directories and globs (``str`` or
    ``PathLike``), :class:`TokenFiles`, and :class:`ShardReader` objects.

    Raises:
        TypeError: a source of another type.
        FileNotFoundError, ValueError: as the readers raise, naming the file.
    """
    if isinstance(sources, (str, os.PathLike, TokenFiles, ShardReader)):
        sources = [sources]  # one source
    readers: list[ShardReader] = []
    for source in sources:
        if isinstance(source, (str, os.PathLike)):
            readers += [_file_readers(p) for p in expand(source)]
        elif isinstance(source, TokenFiles):
            readers += source.readers()
        elif isinstance(source, ShardReader):
            readers.append(source)
        else:
            raise TypeError(
                "expected sources given as paths or globs (str or PathLike), TokenFiles, or "
                f"ShardReader objects (with name, __len__ and __getitem__), got "
                f"{type(source).__name__}"
            )
    return readers


def write_token_shards(tokens: torch.Tensor, directory: str | os.PathLike, seq_len: int,
                       samples_per_shard: int, dtype: torch.dtype = torch.uint16) -> list[str]:
    """Write a 1-D run of ``tokens`` as raw ``.bin`` shards of whole ``seq_len`` samples, for
    :class:`TokenFiles`; a trailing partial sample is left out. Returns the files written,
    ``shard-00000.bin``, ``shard-00001.bin``, ... in ``directory``."""
    os.makedirs(directory, exist_ok=True)
    samples = tokens.reshape(-1)[: tokens.numel() // seq_len * seq_len].to(dtype).reshape(-1, seq_len)
    paths = []
    for i, start in enumerate(range(0, samples.shape[0], samples_per_shard)):
        path = os.path.join(os.fspath(directory), f"shard-{i:05d}.bin")
        chunk = samples[start:start + samples_per_shard]
        if os.path.exists(path):
            os.remove(path)  # from_file maps the file at its current size when it is larger
        # torch.from_file(shared=True) creates the file and writes through to it (no numpy)
        torch.from_file(path, shared=True, size=chunk.numel(), dtype=dtype).copy_(chunk.reshape(-1))
        paths.append(path)
    return paths


def sizes(readers: Sequence[ShardReader]) -> list[int]:
    """Each reader's number of samples.

    Raises:
        ValueError: a shard with no samples (naming it): it would shorten the epoch silently.
    """
    out = []
    for reader in readers:
        n = len(reader)
        if n < 1:
            raise ValueError(
                f"{reader.name}: empty shard (0 samples); remove it from the sources or fill it"
            )
        out.append(n)
    return out
