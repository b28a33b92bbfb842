"""Sharded checkpoints on disk: names, the manifest and its checksums, the atomic commit, and
the housekeeping shared with the single-file format (listing, ``keep``, stale temporaries).

Single-process code; :mod:`phalanx.checkpoint.dcp_checkpoint` decides who calls it and when.

A sharded checkpoint is a directory ``ckpt-<step, 12 digits>.dcp`` that torch's
``torch.distributed.checkpoint`` reads as it is (``.metadata`` and ``__<rank>_<n>.distcp``),
plus two files of phalanx's that torch ignores:

``phalanx-state.ckpt``
    the non-tensor state (epoch, step, RNG states of every rank, sampler, scheduler, scaler,
    extras, the non-tensor leaves of the model's and optimizer's state dicts) as one
    :mod:`phalanx.checkpoint.file` file: checksummed, loaded with ``weights_only=True``.
``phalanx-manifest.json``
    step, epoch, world size, layout, and the size and CRC-32 of every other file, itself
    covered by a CRC-32 of its canonical JSON. It is written last: a directory without it was
    not written by phalanx (torch's ``dcp.save``), and is loaded without checksums. A tensor
    file's entry also lists each stored item (``"items"``: offset, length, CRC-32) and, for an
    item that is the archive of a contiguous tensor (its storage's bytes at a known offset in
    it) at least :data:`MIN_BLOCKS` blocks long, the CRC-32 of each :data:`BLOCK`-byte block
    of it (``"blocks"``, see :meth:`Written.entry_json`): a load that needs only some of its
    rows reads and checks only the blocks that hold them.

The directory is written under a temporary name ``ckpt-<step>.dcp.tmp-<random>`` beside the
final one, locked (``flock`` on the directory) by the writer while it lives, and renamed into
place only once everything in it is durable: a process killed at any point leaves no
directory under a final name, and the next save removes the temporary.
"""

from __future__ import annotations

import array
import base64
import dataclasses
import fcntl
import functools
import json
import os
import re
import shutil
import sys
import zlib
from pathlib import Path
from typing import Any, Iterator

from ..errors import CheckpointError, RankMismatchError
from .file import fsync_path, list_checkpoints, remove_unlocked

MANIFEST = "phalanx-manifest.json"
METADATA = ".metadata"  # DCP's
STATE_FILE = "phalanx-state.ckpt"
MANIFEST_FORMAT = "phalanx-dcp"
MANIFEST_VERSION = 1
# Read size of the streaming checksum: large enough that zlib.crc32 runs at memory speed.
_CHUNK = 8 << 20
# The block of the block CRC-32s, aligned to its item's start. A load that needs some rows of
# an item reads the blocks that hold them: at most one block too many at each end (128 KiB
# per item read in part: 6% of a 2 MB range), while the CRC-32s cost 4 bytes per block
# (0.006% of the data; in the manifest, base64: 0.008%, 34 kB for a 420 MB checkpoint), and
# a read of 64 KiB and more runs at the disk's speed.
BLOCK = 64 << 10
# Items shorter than this many blocks have no block CRC-32s (read whole, as before): reading
# part of an item of 1-3 blocks saves a block or two, not worth their manifest entry.
MIN_BLOCKS = 4

_DIR = re.compile(r"^ckpt-(\d{12})\.dcp$")
_DIR_TEMP = re.compile(r"^ckpt-\d{12}\.dcp\.tmp-")
_FILE = re.compile(r"^ckpt-(\d{12})\.ckpt$")


def sharded_name(step: int) -> str:
    """The directory name of the sharded checkpoint of ``step``: ``ckpt-000000000042.dcp``."""
    return f"ckpt-{step:012d}.dcp"


def step_of(path: str | os.PathLike) -> int:
    """The step in a checkpoint's name, file (``.ckpt``) or directory (``.dcp``)."""
    name = Path(path).name
    match = _DIR.match(name) or _FILE.match(name)
    if match is None:
        raise ValueError(f"{path} is not named like a checkpoint (ckpt-<12 digits>.ckpt or .dcp)")
    return int(match.group(1))


def list_all(directory: str | os.PathLike) -> list[Path]:
    """Complete checkpoints of both formats in ``directory``, oldest step first (a file
    before a directory of the same step)."""
    directory = Path(directory)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = [directory / n for n in names if _DIR.match(n) and (directory / n).is_dir()]
    found += list_checkpoints(directory)
    return sorted(found, key=lambda p: (step_of(p), p.suffix == ".dcp"))


def _remove_tree(path: Path) -> None:
    """Delete a checkpoint directory: first renamed to a temporary name (a process killed
    while deleting leaves a temporary, never a partial checkpoint under its final name)."""
    doomed = path.with_name(f"{path.name}.tmp-deleted-{os.urandom(4).hex()}")
    os.rename(path, doomed)
    fsync_path(path.parent)
    shutil.rmtree(doomed, ignore_errors=True)


def prune_all(directory: str | os.PathLike, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints of either format; return the deleted."""
    doomed = list_all(directory)[:-keep]
    for path in doomed:
        if path.is_dir():
            _remove_tree(path)
        else:
            os.unlink(path)
    if doomed:
        fsync_path(directory)
    return doomed


class TempDir:
    """A new temporary directory for the checkpoint of ``step`` in ``directory``, locked by
    this process until :meth:`release` (or its death)."""

    def __init__(self, directory: Path, step: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{sharded_name(step)}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
        self.path.mkdir()  # exclusive: never another writer's
        self._fd: int | None = os.open(self.path, os.O_RDONLY)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def check_save_step(gathered: list, directory: Path) -> tuple[int, int]:
    """Rank 0 of a save: the ``(epoch, step)`` every rank passed (``gathered``: each rank's
    ``(epoch, step, ...)``), checked to agree and to come after the newest checkpoint in
    ``directory`` (keep-last-K and ``resume="auto"`` go by step: an earlier step would be pruned
    at once, and a resume would pick up the other run's newer checkpoint)."""
    epoch, step = gathered[0][:2]
    differ = [r for r, (e, s, *_) in enumerate(gathered) if (e, s) != (epoch, step)]
    if differ:
        e, s = gathered[differ[0]][:2]
        raise RankMismatchError(
            f"save(epoch, step) differs across ranks: ranks {', '.join(map(str, differ))} "
            f"disagree with rank 0, which has epoch={epoch}, step={step}; rank {differ[0]} "
            f"has epoch={e}, step={s}")
    existing = list_all(directory)
    if existing and step_of(existing[-1]) > step:
        raise CheckpointError(
            f"Cannot save step {step} in {directory}: it already holds {existing[-1].name}, "
            "a later step (another run?). Use a new directory or remove the old checkpoints")
    return epoch, step


def clean_stale_dirs(directory: str | os.PathLike) -> list[Path]:
    """Remove temporary checkpoint directories whose writer died (their lock can be taken)."""
    return remove_unlocked(directory, lambda path: bool(_DIR_TEMP.match(path.name)) and path.is_dir(),
                           lambda path: shutil.rmtree(path, ignore_errors=True))


def checksum(path: Path, items: list[tuple[int, int]] = ()) -> dict[str, Any]:
    """``{"bytes": size, "crc32": "0x..."}`` of the file at ``path``, read once in chunks;
    with ``items`` (``(offset, length)`` ranges of it), also ``"items"``: ``[offset, length,
    "0x..."]`` for each, their CRC-32s computed in the same pass."""
    crc, size = 0, 0
    ranges = sorted(items)
    crcs = [0] * len(ranges)
    with open(path, "rb") as f:
        buffer = bytearray(max(1, min(_CHUNK, os.fstat(f.fileno()).st_size)))  # (a small file: its size)
        view = memoryview(buffer)
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
            for i, (offset, length) in enumerate(ranges):  # (a few items per file)
                lo, hi = max(offset, size), min(offset + length, size + n)
                if lo < hi:
                    crcs[i] = zlib.crc32(view[lo - size:hi - size], crcs[i])
            size += n
    found: dict[str, Any] = {"bytes": size, "crc32": f"{crc:#010x}"}
    if ranges:
        found["items"] = [[o, n, f"{c:#010x}"] for (o, n), c in zip(ranges, crcs)]
    return found


_POLY = 0xEDB88320  # CRC-32's polynomial, reflected (zlib's)


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo CRC-32's polynomial (zlib's ``multmodp``)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^n) modulo the polynomial, n = 0..31
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def _shift(length: int) -> int:
    """x^(8 * length) modulo the polynomial (zlib's ``x2nmodp(length, 3)``)."""
    p, k = 1 << 31, 3
    while length:
        if length & 1:
            p = _multmodp(_X2N[k & 31], p)
        length >>= 1
        k += 1
    return p


@functools.lru_cache(maxsize=1024)
def _shifter(length: int) -> tuple[array.array, ...]:
    """Multiplication by x^(8 * length) as four tables, one per byte of the CRC (it is linear
    over GF(2)): each entry the XOR of the products of its set bits. 32 products and 1024
    XORs to make (~0.5 ms); 4 KiB each, so the cache holds at most 4 MiB."""
    p = _shift(length)
    tables = []
    for byte in range(4):
        bits = [_multmodp(p, 1 << (8 * byte + k)) for k in range(8)]
        table = array.array("I", bytes(1024))
        for v in range(1, 256):
            low = v & -v
            table[v] = table[v ^ low] ^ bits[low.bit_length() - 1]
        tables.append(table)
    return tuple(tables)


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """The CRC-32 of ``a + b`` from ``crc1 = crc32(a)``, ``crc2 = crc32(b)`` and ``len(b)``
    (zlib's ``crc32_combine``, which Python's zlib does not expose): about 1 us for a length
    seen before (a checkpoint's items come in few sizes), 0.5 ms for a new one."""
    t0, t1, t2, t3 = _shifter(length2)
    return t0[crc1 & 0xFF] ^ t1[(crc1 >> 8) & 0xFF] ^ t2[(crc1 >> 16) & 0xFF] ^ t3[crc1 >> 24] ^ crc2


class ItemCRC:
    """The CRC-32s of one stored item's bytes, given in order to :meth:`update`: each
    :data:`BLOCK`-byte block's (aligned to the item's start), and from them the item's
    (:meth:`finish`); each byte passes through ``zlib.crc32`` once. Between :meth:`mark` and
    :meth:`marked`, also the CRC-32 of the bytes given in between (a template archive's
    storage, whose CRC-32 its tail holds), combined from its pieces' (:func:`crc32_combine`)."""

    __slots__ = ("blocks", "length", "_block", "_sub", "_sub_length")

    def __init__(self) -> None:
        self.blocks = array.array("I")  # the complete blocks' CRC-32s (all of them after finish())
        self.length = 0
        self._block = 0  # the CRC-32 of the current block's bytes so far
        self._sub: int | None = None  # between mark() and marked(): the CRC-32 of those bytes
        self._sub_length = 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        at, n = 0, view.nbytes
        while at < n:
            filled = self.length % BLOCK
            take = min(BLOCK - filled, n - at)
            piece = view[at:at + take]
            if self._sub is None:
                self._block = zlib.crc32(piece, self._block)
            else:  # (the piece's own CRC-32, combined into both)
                crc = zlib.crc32(piece)
                self._block = crc32_combine(self._block, crc, take) if filled else crc
                self._sub = crc32_combine(self._sub, crc, take) if self._sub_length else crc
                self._sub_length += take
            at += take
            self.length += take
            if filled + take == BLOCK:
                self.blocks.append(self._block)
                self._block = 0

    def mark(self) -> None:
        self._sub, self._sub_length = 0, 0

    def marked(self) -> int:
        """The CRC-32 of the bytes given since :meth:`mark`."""
        crc, self._sub = self._sub or 0, None
        return crc

    def finish(self) -> int:
        """The item's CRC-32 (its last block closed): what :func:`check_item` checks."""
        if self.length % BLOCK:
            self.blocks.append(self._block)
            self._block = 0
        blocks = self.blocks
        crc = blocks[0] if blocks else 0
        for i in range(1, len(blocks)):
            crc = crc32_combine(crc, blocks[i], min(BLOCK, self.length - i * BLOCK))
        return crc


def blocks_of(length: int, block: int = BLOCK) -> int:
    """How many blocks of ``block`` bytes an item of ``length`` bytes has."""
    return -(-length // block)


def pack_crcs(crcs: Any) -> str:
    """CRC-32s as the manifest holds them: base64 of their little-endian 32-bit words."""
    words = array.array("I", crcs)
    if sys.byteorder != "little":
        words.byteswap()
    return base64.b64encode(words.tobytes()).decode("ascii")


def unpack_crcs(text: str) -> array.array:
    """The inverse of :func:`pack_crcs`; ``ValueError`` if ``text`` is not such a string."""
    data = base64.b64decode(text, validate=True)
    if len(data) % 4:
        raise ValueError("not a whole number of 32-bit words")
    words = array.array("I")
    words.frombytes(data)
    if sys.byteorder != "little":
        words.byteswap()
    return words


class DamagedCheckpoint(CheckpointError):
    """A checkpoint's bytes differ from what its manifest says: ``resume="auto"`` sets it aside."""


def check_item(directory: Path, name: str, offset: int, data: bytes, expected: str | None) -> None:
    """Raise :class:`DamagedCheckpoint` unless ``data``, read at ``offset`` of the file
    ``name``, has the CRC-32 ``expected`` (``None``: the manifest lists no such item)."""
    if expected is None:
        raise DamagedCheckpoint(f"Checkpoint {directory} is damaged: its file {name} has no item at "
                                f"offset {offset} in {MANIFEST} (.metadata and the manifest disagree)")
    found = f"{zlib.crc32(data):#010x}"
    if found != expected:
        raise DamagedCheckpoint(f"Checkpoint {directory} is damaged: its file {name} fails its "
                                f"checksum at offset {offset} ({len(data)} bytes: CRC-32 stored "
                                f"{expected}, computed {found})")


def check_blocks(directory: Path, name: str, item_offset: int, first: int, data: Any,
                 expected: Any, block: int = BLOCK) -> None:
    """Raise :class:`DamagedCheckpoint` unless ``data``, the blocks ``first``, ``first + 1``,
    ... of the item at ``item_offset`` of the file ``name`` (each ``block`` bytes, the item's
    last one shorter), has the CRC-32s ``expected``, one per block."""
    view = memoryview(data).cast("B")
    count = blocks_of(view.nbytes, block)
    if count != len(expected):
        offset = item_offset + first * block
        raise DamagedCheckpoint(f"Checkpoint {directory} is damaged: its file {name} is short at offset "
                                f"{offset} (read {view.nbytes} bytes of blocks {first}-{first + len(expected) - 1} "
                                f"of the item at offset {item_offset})")
    for k in range(count):
        piece = view[k * block:(k + 1) * block]
        found = zlib.crc32(piece)
        if found != expected[k]:
            offset = item_offset + (first + k) * block
            raise DamagedCheckpoint(f"Checkpoint {directory} is damaged: its file {name} fails its "
                                    f"checksum at offset {offset} ({piece.nbytes} bytes, block {first + k} "
                                    f"of the item at offset {item_offset}: CRC-32 stored "
                                    f"{expected[k]:#010x}, computed {found:#010x})")


def fsync_files(paths: list[Path]) -> None:
    for path in paths:
        fsync_path(path)


@dataclasses.dataclass
class Written:
    """What a rank wrote into its tensor file, in a form that is small to hold and to send
    (rank 0 receives every rank's): the file's name, size and CRC-32, and each item's offset,
    length and CRC-32, in the order of the file (ascending offsets), with its index in the
    rank's save plan and where its storage starts in it (0: no block CRC-32s): 28 bytes per
    item, where lists of Python objects took about 300 (a 1024-rank job's rank 0 receives
    every rank's); and the block CRC-32s of the items whose storage start is not 0, one
    after the other (4 bytes per :data:`BLOCK` bytes of them)."""

    name: str
    size: int
    crc: int
    offsets: array.array = dataclasses.field(default_factory=lambda: array.array("Q"))
    lengths: array.array = dataclasses.field(default_factory=lambda: array.array("Q"))
    crcs: array.array = dataclasses.field(default_factory=lambda: array.array("I"))
    plan_index: array.array = dataclasses.field(default_factory=lambda: array.array("I"))
    starts: array.array = dataclasses.field(default_factory=lambda: array.array("I"))
    blocks: array.array = dataclasses.field(default_factory=lambda: array.array("I"))

    def add(self, offset: int, length: int, crc: int, plan_index: int, start: int = 0,
            blocks: Any = None) -> None:
        """One item; ``start`` and ``blocks``: where its storage (a contiguous tensor's bytes)
        starts in it and its block CRC-32s, kept if it has at least :data:`MIN_BLOCKS` blocks."""
        self.offsets.append(offset)
        self.lengths.append(length)
        self.crcs.append(crc)
        self.plan_index.append(plan_index)
        keep = start > 0 and blocks is not None and blocks_of(length) >= MIN_BLOCKS
        if keep and len(blocks) != blocks_of(length):
            raise ValueError(f"an item of {length} bytes with {len(blocks)} block CRC-32s")
        self.starts.append(start if keep else 0)
        if keep:
            self.blocks.extend(blocks)

    def placement(self) -> tuple[array.array, ...]:
        """Where each item of the plan went (what ``.metadata`` records): equal for two
        saves exactly when every item sits where it sat."""
        return self.plan_index, self.offsets, self.lengths

    def entry_json(self, separators: tuple[str, str]) -> str:
        """The manifest's entry for the file as ``json.dumps(entry, sort_keys=True,
        separators=separators)`` writes it, without making its Python objects: what
        :func:`checksum` computes, ``{"bytes", "crc32", "items": [[offset, length, crc32],
        ...]}``, and if some item has block CRC-32s, ``"blocks": {"bytes": BLOCK, "items":
        [[offset, start, crc32s], ...]}``: for each such item, its offset in the file, where
        its storage starts in it, and its blocks' CRC-32s (:func:`pack_crcs`)."""
        comma, colon = separators
        items = comma.join(f'[{o}{comma}{n}{comma}"{c:#010x}"]'
                           for o, n, c in zip(self.offsets, self.lengths, self.crcs))
        entry = (f'"bytes"{colon}{self.size}{comma}"crc32"{colon}"{self.crc:#010x}"{comma}'
                 f'"items"{colon}[{items}]')
        if not any(self.starts):
            return f"{{{entry}}}"
        blocked, at = [], 0
        for offset, length, start in zip(self.offsets, self.lengths, self.starts):
            if start:
                count = blocks_of(length)
                blocked.append(f'[{offset}{comma}{start}{comma}"{pack_crcs(self.blocks[at:at + count])}"]')
                at += count
        return (f'{{"blocks"{colon}{{"bytes"{colon}{BLOCK}{comma}"items"{colon}[{comma.join(blocked)}]}}'
                f'{comma}{entry}}}')


def _json(body: dict, separators: tuple[str, str]) -> Iterator[str]:
    """``json.dumps(body, sort_keys=True, separators=separators)`` in pieces, one file's entry
    of ``body["files"]`` at a time (a dict, or a :class:`Written` encoded as its entry): the
    manifest is never whole in memory (a 1024-rank one is megabytes, its entries' Python
    objects ten times that)."""
    comma, colon = separators
    files = body["files"]
    head, tail = json.dumps({**body, "files": 0}, sort_keys=True, separators=separators).split(
        f'"files"{colon}0', 1)  # (the one key "files": strings inside values have their quotes escaped)
    yield f'{head}"files"{colon}{{'
    for i, name in enumerate(sorted(files)):
        entry = files[name]
        yield (comma if i else "") + json.dumps(name) + colon + (
            entry.entry_json(separators) if isinstance(entry, Written)
            else json.dumps(entry, sort_keys=True, separators=separators))
    yield "}" + tail


_CANONICAL = (", ", ": ")  # json.dumps's own separators: the text the manifest's CRC-32 covers
_COMPACT = (",", ":")


def _body_crc(body: dict) -> str:
    """The CRC-32 of ``json.dumps(body, sort_keys=True)``, computed from :func:`_json`'s pieces."""
    crc = 0
    for piece in _json(body, _CANONICAL):
        crc = zlib.crc32(piece.encode(), crc)
    return f"{crc:#010x}"


def write_manifest(directory: Path, body: dict, sync: bool = True) -> None:
    """Write ``body`` (with ``format``, ``version`` and its own CRC-32) as the manifest (compact
    JSON), one file's entry at a time (``body["files"]``: name -> its entry, or the
    :class:`Written` it is made of); fsynced unless ``sync`` is false (the caller fsyncs it
    with the others)."""
    body = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, **body}
    with open(directory / MANIFEST, "x") as f:
        for piece in _json({**body, "crc32": _body_crc(body)}, _COMPACT):
            f.write(piece)
        f.flush()
        if sync:
            os.fsync(f.fileno())


def write_file(path: Path, data: bytes) -> dict[str, Any]:
    """Write the new file ``path`` (not fsynced: the caller fsyncs it with the others); what
    the manifest records of it (as :func:`checksum` computes, without reading it back)."""
    with open(path, "xb") as f:
        f.write(data)
    return {"bytes": len(data), "crc32": f"{zlib.crc32(data):#010x}"}


def read_manifest(directory: Path) -> dict | None:
    """The manifest of the checkpoint ``directory``, checked; ``None`` if it has none."""
    if not directory.is_dir():
        raise CheckpointError(f"Checkpoint {directory} does not exist")
    try:
        text = (directory / MANIFEST).read_text()
    except FileNotFoundError:
        return None
    try:
        body = json.loads(text)
        stored = body.pop("crc32")
    except (ValueError, KeyError, AttributeError, TypeError):
        raise CheckpointError(f"Checkpoint {directory} is corrupt: {MANIFEST} is not a manifest") from None
    if f"{zlib.crc32(json.dumps(body, sort_keys=True).encode()):#010x}" != stored:
        raise CheckpointError(f"Checkpoint {directory} is corrupt: {MANIFEST} fails its checksum")
    if body.get("format") != MANIFEST_FORMAT or body.get("version") != MANIFEST_VERSION:
        raise CheckpointError(f"Checkpoint {directory}: {MANIFEST} has format {body.get('format')!r} "
                              f"version {body.get('version')!r}; this phalanx reads {MANIFEST_FORMAT!r} "
                              f"version {MANIFEST_VERSION}")
    return body


def verify(directory: Path, manifest: dict, names: list[str]) -> None:
    """Check the files ``names`` of ``directory`` against the manifest's sizes and checksums;
    raise :class:`DamagedCheckpoint` naming the first file that is missing or differs."""
    for name in names:
        problem = _problem(directory, name, manifest["files"][name])
        if problem is not None:
            raise DamagedCheckpoint(problem)


def problems(directory: Path, manifest: dict, names: list[str]) -> list[str]:
    """What :func:`verify` would say of each of the files ``names`` that is missing or differs."""
    found = [_problem(directory, name, manifest["files"][name]) for name in names]
    return [p for p in found if p is not None]


def _problem(directory: Path, name: str, expected: dict) -> str | None:
    try:
        found = checksum(directory / name)
    except FileNotFoundError:
        return f"Checkpoint {directory} is damaged: its file {name} is missing"
    if found["bytes"] != expected["bytes"]:
        return (f"Checkpoint {directory} is damaged: its file {name} has "
                f"{found['bytes']} bytes, the manifest says {expected['bytes']}")
    if found["crc32"] != expected["crc32"]:
        return (f"Checkpoint {directory} is damaged: its file {name} fails its "
                f"checksum (CRC-32 stored {expected['crc32']}, computed {found['crc32']})")
    return None


def share(sizes: dict[str, int], world: int) -> list[list[str]]:
    """The names of ``sizes`` split among ``world`` ranks, largest first to the least loaded
    (ties to the lowest rank): the same answer on every rank."""
    load = [0] * world
    shares: list[list[str]] = [[] for _ in range(world)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(world), key=lambda r: (load[r], r))
        load[rank] += sizes[name]
        shares[rank].append(name)
    return shares


def commit(temp: Path, final: Path) -> None:
    """Rename the complete ``temp`` directory to ``final`` and make it durable. A checkpoint
    already at ``final`` (the same step saved again) is moved aside first, then deleted."""
    if final.exists():
        _remove_tree(final)
    os.rename(temp, final)
    fsync_path(final.parent)
