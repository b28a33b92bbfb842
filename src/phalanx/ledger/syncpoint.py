"""A sync point's payload: one small int64 all-reduce (SUM) that tells every rank whether the
ranks agree, which of them take part, and what they announce.

Layout, ``3 + ANNOUNCE + FLAGS + W`` int64 (``W = ceil(world / 62)`` bitmap words)::

    [count of participants (1 each), h, h * h, announcement..., flags..., bitmap...]

* A rank at the point puts 1, ``h`` (a :data:`HASH_BITS`-bit CRC of where it is and of what it
  issued since the previous point), ``h * h``, the announcement (identical on every such rank:
  how a rank that has joined shadows the collective that follows, :mod:`phalanx.uneven`), its
  flags, and its own bit in the bitmap.
* A rank that has joined (inside ``phalanx.join``, out of inputs) puts zeros, but its flags.

From the sums every rank reads the same verdict: the participants (the bitmap), whether they
agree (Cauchy-Schwarz: ``(sum h)^2 == n * sum(h^2)`` exactly when every ``h`` is equal), the
announcement (each slot's sum divided by ``n``), and which flags some rank raised (a sum > 0).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import torch

# Bits of the fingerprint: h^2 summed over every rank must stay exact in int64: 2^40 * 2^22
# ranks < 2^63. Two different places collide with probability 2^-20.
HASH_BITS = 20
# Announcement slots: a kind and its parameters (a joinable's index, a bucket, a dtype...).
ANNOUNCE = 6
# Flag slots, raised by any rank (joined ranks too): the preemption check's two signals.
FLAGS = 2
# Bits per bitmap word: a rank's bit is 2^(rank % 62) in word rank // 62; every rank sets only
# its own bit, so the sums never carry and stay below 2^62.
WORD_BITS = 62


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
    return zlib.crc32(what.encode(), since) & ((1 << HASH_BITS) - 1)


def payload(h: int | None, announce: tuple[int, ...], flags: tuple[int, ...], rank: int,
            world: int) -> torch.Tensor:
    """This rank's contribution; ``h=None``: a rank that has joined (zeros, but its flags)."""
    words = -(-world // WORD_BITS)
    out = torch.zeros(3 + ANNOUNCE + FLAGS + words, dtype=torch.int64)
    out[3 + ANNOUNCE:3 + ANNOUNCE + len(flags)] = torch.tensor(flags, dtype=torch.int64)
    if h is not None:
        out[:3] = torch.tensor([1, h, h * h])
        out[3:3 + len(announce)] = torch.tensor(announce, dtype=torch.int64)
        out[3 + ANNOUNCE + FLAGS + rank // WORD_BITS] = 1 << (rank % WORD_BITS)
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
    """The verdict of the summed payloads of ``world`` ranks."""
    values = summed.tolist()
    count, s, q = values[:3]
    words = values[3 + ANNOUNCE + FLAGS:]
    ranks = tuple(r for r in range(world) if words[r // WORD_BITS] >> (r % WORD_BITS) & 1)
    if len(ranks) != count:  # a bitmap that does not add up: payloads of another layout met
        return Verdict(ranks, False, (), ())
    announce = tuple(v // count for v in values[3:3 + ANNOUNCE]) if count else ()
    flags = tuple(v > 0 for v in values[3 + ANNOUNCE:3 + ANNOUNCE + FLAGS])
    return Verdict(ranks, s * s == count * q, announce, flags)


def mismatch_message(everyone: list[dict[str, Any]]) -> str:
    """Name the first collective that differs between ranks, and where each rank issued it;
    or, if their collectives agree, the points the ranks are at."""
    signatures = [[entry.split(" (")[0] for entry in info["since"]] for info in everyone]
    longest = max(len(s) for s in signatures)
    index = next((i for i in range(longest)
                  if len({tuple(s[i:i + 1]) for s in signatures}) > 1), None)
    if index is None:
        where = {info["rank"]: info["at"] for info in everyone}
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
