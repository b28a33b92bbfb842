"""A sync point's payload: one small all-reduce (SUM) that tells every rank whether the ranks
agree, which of them take part, and what they announce.

The payload is a fixed-size *envelope* of :func:`envelope_size` floats (:func:`envelope_dtype`:
float32 up to 65536 ranks), whatever the point: its head holds the check, the rest is zeros, or,
when the check rides a DDP step's only bucket (:mod:`phalanx.ddp.reducer`), that bucket's
gradients. Every rank's collective after a forward is then the same size and dtype whether it
rides or not, so ranks that went different ways still meet in one well-formed all-reduce
(Gloo aborts the process on one of another size: "op.preamble.length <= op.nbytes") and read a
verdict that names them. Head layout (:func:`head_size` floats)::

    [count of participants (1 each), 8 x (piece, piece^2), announcement pieces..., flags...,
     bitmap...]

* A rank at the point puts 1; its 32-bit fingerprint (a CRC of where it is and of what it
  issued since the previous point) as eight 4-bit pieces ``p``, each with ``p * p``; the
  announcement (identical on every such rank: how a rank that has joined shadows the
  collective that follows, :mod:`phalanx.uneven`), each value as :data:`ANNOUNCE_PIECES` 8-bit
  pieces; its flags; its own bit in the bitmap (16 bits a word).
* A rank that has joined (inside ``phalanx.join``, out of inputs) puts zeros, but its flags.

From the sums every rank reads the same verdict: the participants (the bitmap), whether they
agree (Cauchy-Schwarz per piece: ``(sum p)^2 == n * sum(p^2)`` exactly when every ``p`` is
equal), the announcement (each piece's sum divided by ``n``), and which flags some rank raised
(a sum > 0). Every sum is an integer below 2^24 while ``n <= 65536`` (``225 n`` for the squares,
``255 n`` for the announcement pieces, ``2^16 - 1`` for a bitmap word): exact in float32.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import torch

# Bits of the fingerprint; two different places collide with probability 2^-32.
HASH_BITS = 32
# The fingerprint travels as pieces of this many bits, each with its square: the squares' sum,
# 15^2 per rank, stays exact in float32 (2^24) up to 74565 ranks.
PIECE_BITS = 4
PIECES = HASH_BITS // PIECE_BITS
# Announcement slots: a kind and its parameters (a joinable's index, a bucket, a dtype...).
ANNOUNCE = 6
# Each announced value (0 <= v < 2^48: element counts) as six 8-bit pieces: 255 n exact.
ANNOUNCE_PIECES = 6
# Flag slots, raised by any rank (joined ranks too): the preemption check's two signals.
FLAGS = 2
# Bits per bitmap word: a rank's bit is 2^(rank % 16) in word rank // 16; every rank sets only
# its own bit, so the sums never carry and stay below 2^16.
WORD_BITS = 16
# Ranks up to which every sum above is exact in float32; larger jobs use float64 (and no
# check rides a float32 bucket).
FLOAT32_RANKS = 1 << 16
# Floats in an envelope: the head and room for a small bucket to carry it (4 KiB in float32:
# one TCP segment on loopback, 33 us at 1 Gbit/s). A step whose gradients fit is latency-bound,
# where an extra collective would double it; larger ones keep a separate check, started at the
# forward, whose latency hides behind it.
ENVELOPE = 1024

_HEAD = 1 + 2 * PIECES  # count and the fingerprint's pieces
_ANNOUNCED = _HEAD + ANNOUNCE * ANNOUNCE_PIECES
_FLAGGED = _ANNOUNCED + FLAGS


def head_size(world: int) -> int:
    """Floats of a sync point's head for ``world`` ranks."""
    return _FLAGGED + -(-world // WORD_BITS)


def envelope_size(world: int) -> int:
    """Floats every sync point of ``world`` ranks all-reduces (the head, then room)."""
    return max(ENVELOPE, head_size(world))


def envelope_dtype(world: int) -> torch.dtype:
    """The dtype of every sync point of ``world`` ranks: float32 while its sums are exact."""
    return torch.float32 if world <= FLOAT32_RANKS else torch.float64


# ---- announcements: how a rank that has joined takes part in what the others do next -------
# (kind, parameters...), read by phalanx.join. Codes are the protocol between ranks: only add.
UNSHADOWABLE = 1  # nothing a joined rank can take part in: it raises, naming the collective
SYNC_ONLY = 2  # the sync point itself is all (a preemption check)
ALL_REDUCE = 3  # (dtype, numel, reduce op): a joined rank contributes the op's neutral element
BROADCAST = 4  # (dtype, numel, src): a joined rank receives
ALL_GATHER_INTO_TENSOR = 5  # (dtype, numel per rank): a joined rank contributes zeros
ALL_GATHER_OBJECT = 6  # a joined rank contributes None
BROADCAST_OBJECT = 7  # (src, number of objects): a joined rank receives
GATHER_OBJECT = 8  # (dst): a joined rank contributes None
BARRIER = 9
JOINABLE = 10  # (index in the join, action, args...): that joinable shadows it

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
REDUCE_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG", "PREMUL_SUM")


def tensor_shadow(kind: int, tensor: Any, *args: int) -> tuple[int, ...]:
    """The announcement of a collective of ``kind`` over ``tensor`` (dtype and element count
    first, then ``args``), or :data:`UNSHADOWABLE` for a dtype this protocol does not name."""
    if getattr(tensor, "dtype", None) not in DTYPES:
        return (UNSHADOWABLE,)
    return (kind, DTYPES.index(tensor.dtype), tensor.numel(), *args)


def fingerprint(what: str, since: int) -> int:
    """The :data:`HASH_BITS`-bit hash of ``what`` after the running CRC ``since``."""
    return zlib.crc32(what.encode(), since)


def head(h: int | None, announce: tuple[int, ...], flags: tuple[int, ...], rank: int,
         world: int) -> list[float]:
    """This rank's head (:func:`head_size` values); ``h=None``: a rank that has joined (zeros,
    but its flags)."""
    out = [0.0] * head_size(world)
    out[_ANNOUNCED:_ANNOUNCED + len(flags)] = flags
    if h is None:
        return out
    out[0] = 1
    for i in range(PIECES):
        piece = h >> (PIECE_BITS * i) & ((1 << PIECE_BITS) - 1)
        out[1 + 2 * i], out[2 + 2 * i] = piece, piece * piece
    for i, value in enumerate(announce):
        if not 0 <= value < 1 << (8 * ANNOUNCE_PIECES):
            raise ValueError(f"a sync point announces values in [0, 2^{8 * ANNOUNCE_PIECES}), got {value}")
        for j in range(ANNOUNCE_PIECES):
            out[_HEAD + i * ANNOUNCE_PIECES + j] = value >> (8 * j) & 0xFF
    out[_FLAGGED + rank // WORD_BITS] = 1 << (rank % WORD_BITS)
    return out


def unanimous(h: int, announce: tuple[int, ...], world: int) -> list[float]:
    """The sums of the heads when all ``world`` ranks are at the point of fingerprint ``h``,
    announcing ``announce``, no flag raised: what a step that agrees reads (compared in one
    call, where :func:`read` takes tens of microseconds)."""
    out = [world * v for v in head(h, announce, (), 0, world)]
    words = head_size(world) - _FLAGGED
    out[_FLAGGED:] = [float((1 << min(WORD_BITS, world - w * WORD_BITS)) - 1) for w in range(words)]
    return out


def payload(h: int | None, announce: tuple[int, ...], flags: tuple[int, ...], rank: int,
            world: int) -> torch.Tensor:
    """This rank's envelope for a sync point of its own: its :func:`head`, then zeros."""
    mine = head(h, announce, flags, rank, world)
    out = torch.zeros(envelope_size(world), dtype=envelope_dtype(world))
    out[:len(mine)] = torch.tensor(mine, dtype=out.dtype)
    return out


@dataclass(frozen=True)
class Verdict:
    """What every rank reads from a sync point's sums."""

    ranks: tuple[int, ...]  # the participants (not joined), in rank order
    agree: bool  # the participants are at the same place with the same history
    announce: tuple[int, ...]  # the participants' announcement (() when none took part)
    flags: tuple[bool, ...]  # raised by some rank

    @property
    def count(self) -> int:
        return len(self.ranks)


def read(summed: torch.Tensor, world: int) -> Verdict:
    """The verdict of the summed heads (or envelopes) of ``world`` ranks."""
    values = [round(v) for v in summed[:head_size(world)].tolist()]
    count = values[0]
    words = values[_FLAGGED:]
    ranks = tuple(r for r in range(world) if words[r // WORD_BITS] >> (r % WORD_BITS) & 1)
    if len(ranks) != count:  # a bitmap that does not add up: payloads of another layout met
        return Verdict(ranks, False, (), ())
    agree = all(values[1 + 2 * i] ** 2 == count * values[2 + 2 * i] for i in range(PIECES))
    announce: tuple[int, ...] = ()
    if count:
        sums = values[_HEAD:_ANNOUNCED]
        announce = tuple(sum((sums[i * ANNOUNCE_PIECES + j] // count) << (8 * j)
                             for j in range(ANNOUNCE_PIECES)) for i in range(ANNOUNCE))
    flags = tuple(v > 0 for v in values[_ANNOUNCED:_FLAGGED])
    return Verdict(ranks, agree, announce, flags)


def mismatch_message(everyone: list[dict[str, Any]]) -> str:
    """Name the first collective that differs between ranks, and where each rank issued it;
    or, if their collectives agree, the points the ranks are at."""
    signatures = [[entry.split(" (")[0] for entry in info["since"]] for info in everyone]
    longest = max(len(s) for s in signatures)
    index = next((i for i in range(longest)
                  if len({tuple(s[i:i + 1]) for s in signatures}) > 1), None)
    if index is None:
        where = {info["rank"]: info["at"] for info in everyone}
        if len(set(where.values())) == 1 and all(info.get("then") for info in everyone):
            # the same point, gone out differently: riding a bucket, or alone before another
            where = {info["rank"]: f"{info['at']}, then {info['then']}" for info in everyone}
        subject = "The ranks are at different collectives"
    else:
        where = {info["rank"]: (info["since"][index] if index < len(info["since"])
                                else f"nothing more before {info['at']}") for info in everyone}
        subject = "The ranks' collectives differ"
    by_place: dict[str, list[int]] = {}
    for rank, place in where.items():
        by_place.setdefault(place, []).append(rank)
    parts = [f"{'ranks' if len(r) > 1 else 'rank'} {', '.join(map(str, r))} "
             f"{'are' if len(r) > 1 else 'is'} at {place}" for place, r in by_place.items()]
    return f"{subject}: " + "; ".join(parts) + (_hint(list(by_place)) if len(by_place) > 1 else "")


def _hint(places: list[str]) -> str:
    """The likely fix, from what the ranks were doing (the most specific cause first)."""
    if any(p.startswith("ZeroRedundancyOptimizer.step") for p in places):
        return (". A rank skipped ZeroRedundancyOptimizer.step while the others stepped (a "
                "GradScaler that found an inf in its own gradients only: with shard_gradients() "
                "each rank holds its shard): use phalanx.ShardedGradScaler in place of torch's "
                "GradScaler: it agrees on the skip")
    if any(p.startswith("DistributedDataParallel forward without gradients") for p in places):
        return (". A forward through the DDP model broadcasts rank 0's buffers (BatchNorm "
                "statistics), a collective: to evaluate on some ranks only, call `model.module`, "
                "or evaluate on every rank")
    if any(p.startswith(("barrier ", "check before barrier ")) for p in places):
        return (". A barrier waits for every rank of the group: one that some ranks skip (inside "
                "`if rank == 0:`) waits for ranks that never come; call it on every rank")
    if any("DistributedDataParallel" in p for p in places):
        return ". " + OUT_OF_BATCHES
    return ""


# The likely cause when the ranks part at DDP's steps, or one ends its script while the others
# still wait for it in a collective (the hang report, :mod:`phalanx.diagnostics.hang`).
OUT_OF_BATCHES = (
    "A rank that runs out of batches before the others stops joining DDP's steps: give every "
    "rank as many batches (DistributedSampler(drop_last=True)) or wrap the loop in "
    "`with model.join():` (or phalanx.join; torch's torch.distributed.algorithms.Join)")
