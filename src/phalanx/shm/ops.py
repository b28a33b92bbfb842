"""The collectives, each a sequence of :class:`~phalanx.shm.channel.Channel` steps.

Every collective moves its tensors through the staging area in chunks of at most the slot's
capacity, so any size passes through a bounded area. Reductions add (multiply, ...) the
members' slots in rank order, ``((x0 + x1) + x2) + ...``, on every member alike: replicas
never drift, and at world size 2 the sum is Gloo's bit for bit (a two-term sum is exact to
the order). Functions here take flat contiguous tensors; :mod:`phalanx.shm.group` prepares them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .channel import Channel

ALL_REDUCE, BROADCAST, ALL_GATHER, REDUCE_SCATTER, REDUCE, ALL_TO_ALL, BARRIER = range(1, 8)
OP_NAMES = {ALL_REDUCE: "all_reduce", BROADCAST: "broadcast", ALL_GATHER: "all_gather",
            REDUCE_SCATTER: "reduce_scatter", REDUCE: "reduce", ALL_TO_ALL: "all_to_all",
            BARRIER: "barrier"}
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32,
          torch.int64, torch.bool, torch.uint8, torch.int8, torch.int16)
DTYPE_CODES = {d: i for i, d in enumerate(DTYPES)}
REDUCE_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.PRODUCT,
              dist.ReduceOp.MIN, dist.ReduceOp.MAX)
SUM, AVG, PRODUCT, MIN, MAX = range(5)
_REDUCE_NAMES = ("SUM", "AVG", "PRODUCT", "MIN", "MAX")


def reduce_code(op: object) -> int | None:
    """The code of a ``ReduceOp`` this backend serves, ``None`` for others (PREMUL_SUM...)."""
    for code, known in enumerate(REDUCE_OPS):
        if op == known:
            return code
    return None


def header(op: int, dtype: int, numel: int, extra: int = 0, extra2: int = 0) -> tuple[int, int]:
    """The two words every member publishes for a collective, which must agree: the op (4
    bits), the dtype's code (8), ``extra`` (24: the reduction's code or a root) and ``extra2``
    (27: a root) in the first, the number of elements in the second."""
    return op | dtype << 4 | extra << 12 | extra2 << 36, numel


def unpack(words: tuple[int, ...]) -> tuple[int, int, int, int, int]:
    """``(op, dtype, numel, extra, extra2)`` of a :func:`header`."""
    w0, numel = words
    return w0 & 0xF, (w0 >> 4) & 0xFF, numel, (w0 >> 12) & 0xFFFFFF, w0 >> 36


def describe(words: tuple[int, ...]) -> str:
    """A header in words: ``all_reduce(float32, 1024 elements, SUM)``."""
    op, dtype, numel, extra, extra2 = unpack(words)
    name = OP_NAMES.get(op, f"op {op}")
    if op == BARRIER:
        return "barrier()"
    dname = str(DTYPES[dtype]).replace("torch.", "") if 0 <= dtype < len(DTYPES) else "?"
    what = f"{dname}, {numel} elements" if op != ALL_TO_ALL else dname
    if op in (ALL_REDUCE, REDUCE_SCATTER, REDUCE) and 0 <= extra < len(_REDUCE_NAMES):
        what += f", {_REDUCE_NAMES[extra]}"
    if op == BROADCAST:
        what += f", src={extra}"
    if op == REDUCE:
        what += f", dst={extra2}"
    return f"{name}({what})"


def _combine(out: torch.Tensor, parts: list[torch.Tensor], code: int) -> None:
    """``out = parts[0] (op) parts[1] (op) ...`` in rank order."""
    if len(parts) == 1:
        out.copy_(parts[0])
    elif code in (SUM, AVG):
        torch.add(parts[0], parts[1], out=out)
        for p in parts[2:]:
            out.add_(p)
        if code == AVG:  # as NCCL's: the sum divided by the members, truncated for integers
            if out.is_floating_point():
                out.div_(len(parts))
            else:
                out.copy_(torch.div(out, len(parts), rounding_mode="trunc"))
    else:
        fn = {PRODUCT: torch.mul, MIN: torch.minimum, MAX: torch.maximum}[code]
        fn(parts[0], parts[1], out=out)
        for p in parts[2:]:
            fn(out, p, out=out)


def _spans(numel: int, per: int) -> list[tuple[int, int]]:
    """``(offset, count)`` chunks of at most ``per`` elements; one empty chunk for none, so
    that every collective takes at least one step (and is checked against the others)."""
    return [(o, min(per, numel - o)) for o in range(0, numel, per)] or [(0, 0)]


def _view(ch: Channel, rank: int, dtype: torch.dtype, start: int, count: int) -> torch.Tensor:
    size = dtype.itemsize
    return ch.slot(rank, ch.seq)[start * size:(start + count) * size].view(dtype)


def _mine(ch: Channel, dtype: torch.dtype, start: int, count: int) -> torch.Tensor:
    size = dtype.itemsize
    return ch.slot(ch.rank)[start * size:(start + count) * size].view(dtype)


def _per(ch: Channel, dtype: torch.dtype, pieces: int = 1) -> int:
    return ch.capacity // (dtype.itemsize * pieces)


def all_reduce_one(ch: Channel, t: torch.Tensor, code: int, root: int = -1) -> None:
    """:func:`all_reduce` of a contiguous ``t`` that fits one slot: one step, through views
    of the slots kept by shape (the small collectives' path: no slicing, no copy but in and out)."""
    views = ch.views(t.dtype, t.shape)[(ch.seq + 1) & 1]
    views[ch.rank].copy_(t)
    ch.step(*header(ALL_REDUCE if root < 0 else REDUCE, DTYPE_CODES[t.dtype], t.numel(), code,
                    max(root, 0)))
    if root < 0 or root == ch.rank:
        _combine(t, views, code)


def broadcast_one(ch: Channel, t: torch.Tensor, root: int) -> None:
    """:func:`broadcast` of a contiguous ``t`` that fits one slot, in one step."""
    views = ch.views(t.dtype, t.shape)[(ch.seq + 1) & 1]
    if ch.rank == root:
        views[root].copy_(t)
    ch.step(*header(BROADCAST, DTYPE_CODES[t.dtype], t.numel(), root))
    if ch.rank != root:
        t.copy_(views[root])


def all_gather_one(ch: Channel, out: torch.Tensor, t: torch.Tensor) -> None:
    """:func:`all_gather` of a contiguous ``t`` that fits one slot into the contiguous ``out``
    (``size`` times as many elements), in one step."""
    views = ch.views(t.dtype, t.shape)[(ch.seq + 1) & 1]
    views[ch.rank].copy_(t)
    ch.step(*header(ALL_GATHER, DTYPE_CODES[t.dtype], t.numel()))
    torch.stack(views, out=out.view((ch.size,) + t.shape))


def reduce_scatter_one(ch: Channel, out: torch.Tensor, t: torch.Tensor, code: int) -> None:
    """:func:`reduce_scatter` of the contiguous ``t`` (``size`` pieces of ``out``'s size, at
    most :func:`_per` elements each: the pieces lie where :func:`reduce_scatter` puts them) into
    the contiguous ``out``, in one step."""
    n = out.numel()
    mine, parts = ch.scatter_views(t.dtype, n, _per(ch, t.dtype, ch.size))[(ch.seq + 1) & 1]
    mine.copy_(t.view(ch.size, n))
    ch.step(*header(REDUCE_SCATTER, DTYPE_CODES[t.dtype], n, code))
    _combine(out.view(-1), parts, code)


def all_reduce(ch: Channel, flat: torch.Tensor, code: int, root: int = -1) -> None:
    """``flat`` becomes the reduction of every member's; with ``root >= 0`` only there (reduce)."""
    words = header(ALL_REDUCE if root < 0 else REDUCE, DTYPE_CODES[flat.dtype], flat.numel(), code,
                   max(root, 0))
    for off, k in _spans(flat.numel(), _per(ch, flat.dtype)):
        src = flat[off:off + k]
        _mine(ch, flat.dtype, 0, k).copy_(src)
        ch.step(*words)
        if root < 0 or root == ch.rank:
            _combine(src, [_view(ch, r, flat.dtype, 0, k) for r in range(ch.size)], code)


def broadcast(ch: Channel, flat: torch.Tensor, root: int) -> None:
    words = header(BROADCAST, DTYPE_CODES[flat.dtype], flat.numel(), root)
    for off, k in _spans(flat.numel(), _per(ch, flat.dtype)):
        if ch.rank == root:
            _mine(ch, flat.dtype, 0, k).copy_(flat[off:off + k])
        ch.step(*words)
        if ch.rank != root:
            flat[off:off + k].copy_(_view(ch, root, flat.dtype, 0, k))


def all_gather(ch: Channel, outs: list[torch.Tensor], flat: torch.Tensor) -> None:
    """``outs[r]`` (flat, as long as ``flat``) becomes member r's ``flat``."""
    words = header(ALL_GATHER, DTYPE_CODES[flat.dtype], flat.numel())
    for off, k in _spans(flat.numel(), _per(ch, flat.dtype)):
        _mine(ch, flat.dtype, 0, k).copy_(flat[off:off + k])
        ch.step(*words)
        for r, out in enumerate(outs):
            out[off:off + k].copy_(_view(ch, r, flat.dtype, 0, k))


def reduce_scatter(ch: Channel, out: torch.Tensor, ins: list[torch.Tensor], code: int) -> None:
    """``out`` becomes the reduction over members of their ``ins[this rank]``."""
    words = header(REDUCE_SCATTER, DTYPE_CODES[out.dtype], out.numel(), code)
    per = _per(ch, out.dtype, ch.size)
    for off, k in _spans(out.numel(), per):
        for r, piece in enumerate(ins):
            _mine(ch, out.dtype, r * per, k).copy_(piece[off:off + k])
        ch.step(*words)
        parts = [_view(ch, q, out.dtype, ch.rank * per, k) for q in range(ch.size)]
        _combine(out[off:off + k], parts, code)


def all_to_all(ch: Channel, out: torch.Tensor, flat: torch.Tensor,
               sends: list[int], receives: list[int]) -> None:
    """Member q's elements ``sends[r]`` (in order, from ``flat``) land in member r's ``out``;
    ``receives[q]`` is what this member expects from q. Checked on every member first."""
    w, me = ch.size, ch.rank
    words = header(ALL_TO_ALL, DTYPE_CODES[flat.dtype], 0)
    counts = _mine(ch, torch.int64, 0, 2 * w)
    counts.copy_(torch.tensor(sends + receives, dtype=torch.int64))
    ch.step(*words)
    table = [_view(ch, q, torch.int64, 0, 2 * w).tolist() for q in range(w)]
    wrong = [(q, r) for q in range(w) for r in range(w) if table[q][r] != table[r][w + q]]
    if wrong:
        q, r = wrong[0]
        raise ValueError(
            f"all_to_all_single: split sizes disagree: rank {q} sends {table[q][r]} elements to "
            f"rank {r}, which expects {table[r][w + q]} from it")
    send_at = [sum(sends[:r]) for r in range(w)]
    recv_at = [sum(receives[:q]) for q in range(w)]
    per = _per(ch, flat.dtype, w)
    longest = max(max(row[:w]) for row in table)
    for start in range(0, max(longest, 1), per):
        for r in range(w):
            k = max(0, min(per, sends[r] - start))
            _mine(ch, flat.dtype, r * per, k).copy_(flat[send_at[r] + start:send_at[r] + start + k])
        ch.step(*words)
        for q in range(w):
            k = max(0, min(per, receives[q] - start))
            out[recv_at[q] + start:recv_at[q] + start + k].copy_(
                _view(ch, q, flat.dtype, me * per, k))


def barrier(ch: Channel) -> None:
    ch.step(BARRIER, 0)
