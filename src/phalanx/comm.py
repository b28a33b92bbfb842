"""Thin helpers over torch.distributed collectives.

Every helper takes a ``group`` (``None`` means the default group) and uses c10d's
collectives; nothing here moves bytes by itself.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

# torch's DDP broadcasts module states in 250 MiB coalesced chunks (distributed.py,
# _DEFAULT_BROADCAST_BUCKET); the same bound keeps our temporary flat buffers modest.
BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024


# Tensors this large are broadcast in place, each alone (no copies); smaller ones are packed
# into byte buffers, one broadcast per device and chunk. On Gloo over loopback (2 ranks, a
# shared 2-core machine) a broadcast cost ~0.3 ms however small and copying 1 MiB ~0.03 ms;
# of thresholds from 256 KiB to 16 MiB tried on three model shapes, 1 MiB was fastest or near.
IN_PLACE_BYTES = 1 << 20
# Packed tensors start at multiples of 16 bytes, so each one's bytes can be viewed back as its
# dtype (complex128, the widest, is 16 bytes).
_ALIGN = 16


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _packed_offsets(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-_nbytes(t) // _ALIGN) * _ALIGN
    return offsets, total


def _slot(flat: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """The bytes of ``flat`` from ``offset`` viewed as a tensor shaped and typed like ``like``."""
    return flat[offset : offset + _nbytes(like)].view(like.dtype).view(like.shape)


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The bytes of ``tensors`` (any dtypes, one device) in one aligned ``uint8`` buffer."""
    offsets, total = _packed_offsets(tensors)
    flat = torch.empty(total, dtype=torch.uint8, device=tensors[0].device)
    with torch.no_grad():
        for t, offset in zip(tensors, offsets):
            _slot(flat, offset, t).copy_(t)
    return flat


def pack_as_views(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """:func:`pack` ``tensors`` (one device), then point each one's ``.data`` at its slot of
    the buffer, so the buffer *is* their storage: one collective on it moves all of them."""
    flat = pack(tensors)
    offsets, _ = _packed_offsets(tensors)
    for t, offset in zip(tensors, offsets):
        t.data = _slot(flat, offset, t)
    return flat


def unpack_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy what :func:`pack` put in ``flat`` back into ``tensors``, in place."""
    offsets, _ = _packed_offsets(tensors)
    with torch.no_grad():
        for t, offset in zip(tensors, offsets):
            t.copy_(_slot(flat, offset, t))


def _chunks(tensors: Iterable[torch.Tensor], limit: int) -> Iterable[list[torch.Tensor]]:
    """Tensors grouped by device, in order, in lists of at most ``limit`` bytes (one may exceed it)."""
    groups: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        groups[t.device].append(t)
    for same in groups.values():
        chunk: list[torch.Tensor] = []
        size = 0
        for t in same:
            if chunk and size + _nbytes(t) > limit:
                yield chunk
                chunk, size = [], 0
            chunk.append(t)
            size += _nbytes(t)
        if chunk:
            yield chunk


class LastWorks:
    """Holds the last collectives' work handles (or objects holding them) until the next ones
    replace them.

    torch 2.13 aborts the process ("terminate called without an active exception") when a
    Gloo thread drops the last reference to a finished work while the interpreter shuts down;
    seen in about 1 of 25 two-rank runs whose last collective was a DDP bucket, and in 1 of
    10 loaded runs ending with a checkpoint save. A handle held here is dropped by the main
    thread instead: when replaced, or at exit (0 aborts in 80 runs). Every holder of a
    collective that may be a script's last (the reducer, buffer sync, ZeRO's step, a
    checkpoint's outcome) keeps one; :func:`phalanx.destroy_process_group` covers the rest.
    """

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: tuple[object, ...] = ()

    def hold(self, *works: object) -> None:
        """Keep ``works`` (dropping the ones held before)."""
        self._held = works


class PendingBroadcast:
    """Broadcasts in flight; :meth:`wait` completes them and fills the receiving tensors.

    Hold it in a :class:`LastWorks` after ``wait()`` when it may be a script's last collective.
    """

    def __init__(self, works: list, landing: list[tuple[torch.Tensor, list[torch.Tensor]]]) -> None:
        self._works = works
        self._landing = landing

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        for flat, chunk in self._landing:
            unpack_into(flat, chunk)


def broadcast_async(
    tensors: Sequence[torch.Tensor],
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    chunk_bytes: int = BROADCAST_CHUNK_BYTES,
) -> PendingBroadcast:
    """Start overwriting ``tensors`` on every rank with rank ``src``'s values.

    Contiguous tensors of :data:`IN_PLACE_BYTES` or more go in place, one broadcast each; the
    rest are packed, whatever their dtypes, into one byte buffer per device and chunk. Every
    broadcast is in flight at once. ``src`` is a global rank, as in
    ``torch.distributed.broadcast``. Call ``wait()`` on the result before using ``tensors``.
    """
    works: list = []
    landing: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
    if dist.get_world_size(group) == 1:
        return PendingBroadcast(works, landing)
    small = []
    for t in tensors:
        if _nbytes(t) >= IN_PLACE_BYTES and t.is_contiguous():
            works.append(dist.broadcast(t.detach(), src, group, async_op=True))
        elif t.numel():
            small.append(t)
    for chunk in _chunks(small, chunk_bytes):
        flat = pack(chunk)
        works.append(dist.broadcast(flat, src, group, async_op=True))
        if dist.get_rank() != src:
            landing.append((flat, chunk))
    return PendingBroadcast(works, landing)


def broadcast_tensors(
    tensors: Sequence[torch.Tensor],
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    chunk_bytes: int = BROADCAST_CHUNK_BYTES,
) -> None:
    """Overwrite ``tensors`` on every rank with rank ``src``'s values (see :func:`broadcast_async`)."""
    broadcast_async(tensors, src, group, chunk_bytes).wait()


def all_gather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``obj``, indexed by rank within ``group``."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def all_reduce_any(flag: bool, group: dist.ProcessGroup | None = None) -> bool:
    """True on every rank if ``flag`` is true on any rank (one small all-reduce)."""
    return all_reduce_max(1 if flag else 0, group) > 0


def all_reduce_max(value: int, group: dist.ProcessGroup | None = None) -> int:
    """The largest of every rank's ``value`` (a small integer), on every rank."""
    t = torch.tensor([float(value)], device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a small tensor must live for ``group``'s backend (NCCL wants the current GPU)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# torch 2.13 deprecates all_gather_into_tensor (a FutureWarning at every call) for
# all_gather_single, which torch 2.10, the oldest phalanx supports, does not have.
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# ---- reduce-scatter ------------------------------------------------------------------------
# Gloo's reduce_scatter_tensor is an all-reduce of the whole input followed by a slice
# (pytorch/pytorch#118911): with a ring all-reduce each rank sends 2(N-1)/N of the input,
# twice what a reduce-scatter needs. On Gloo, phalanx sends each rank its chunk with one
# all_to_all_single ((N-1)/N of the input per rank, as a ring reduce-scatter) and reduces the
# N received chunks locally. Every other backend (NCCL) keeps its own reduce_scatter_tensor.
_LOCAL_REDUCE = {
    "SUM": torch.Tensor.add_,
    "AVG": torch.Tensor.add_,  # then divided by the group's size
    "PRODUCT": torch.Tensor.mul_,
    "MIN": lambda acc, t: torch.minimum(acc, t, out=acc),
    "MAX": lambda acc, t: torch.maximum(acc, t, out=acc),
}
_REDUCE_OPS = {getattr(dist.ReduceOp, name): name for name in _LOCAL_REDUCE}


class PendingReduceScatter:
    """A reduce-scatter in flight (:func:`reduce_scatter_async`); :meth:`wait` completes it
    and fills its output. Hold it in a :class:`LastWorks` after ``wait()`` when it may be a
    script's last collective."""

    def __init__(self, work: Any, received: torch.Tensor | None, output: torch.Tensor,
                 op: str, world: int) -> None:
        self._work, self._received, self._output = work, received, output
        self._op, self._world = op, world

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
        if self._received is None:  # the backend's own reduce-scatter filled the output
            return
        rows = self._received.view(self._world, -1)
        with torch.no_grad():
            out = self._output.view(-1)
            out.copy_(rows[0])
            reduce = _LOCAL_REDUCE[self._op]
            for row in rows[1:]:  # in rank order, each step rounded to the dtype, as Gloo's
                reduce(out, row)
            if self._op == "AVG":
                out.div_(self._world)
        self._received = None


# torch 2.13 deprecates reduce_scatter_tensor (a FutureWarning at every call) for
# reduce_scatter_single, which torch 2.10 does not have (as all_gather_tensor above).
_native_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def cpu_backend_is_gloo(pg: dist.ProcessGroup) -> bool:
    """Whether ``pg``'s CPU backend is Gloo's, whatever the group's backend name."""
    try:
        return isinstance(pg._get_backend(torch.device("cpu")), dist.ProcessGroupGloo)
    except RuntimeError:  # no CPU backend
        return False


def gloo_serves(group: dist.ProcessGroup | None = None) -> bool:
    """Whether Gloo's own transport runs ``group``'s CPU collectives (default: the world's): a
    ``"gloo"`` group, or a plain c10d group of another backend name whose CPU backend is
    Gloo's (a ``"phalanx_shm"`` group whose members span hosts). A group that overrides
    collectives itself (the shared-memory one, served by Gloo only for the rest) is not."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if dist.get_backend(pg) == "gloo":
        return True
    return type(pg) is dist.ProcessGroup and cpu_backend_is_gloo(pg)


def reduce_scatter_async(output: torch.Tensor, input: torch.Tensor, op: Any = dist.ReduceOp.SUM,
                         group: dist.ProcessGroup | None = None) -> PendingReduceScatter:
    """Start ``torch.distributed.reduce_scatter_tensor(output, input, op, group)``: rank ``r``
    of ``group`` gets chunk ``r`` of ``input`` (``world`` equal chunks of ``output``'s size)
    reduced over the ranks. Call ``wait()`` on the result before reading ``output``.

    On Gloo with CPU tensors it is one ``all_to_all_single`` and a local reduction in rank
    order (see the notes above); elsewhere, the backend's own reduce-scatter.
    ``op``: ``SUM``, ``AVG``, ``PRODUCT``, ``MIN`` or ``MAX``.
    """
    world = dist.get_world_size(group)
    name = _REDUCE_OPS.get(op)
    if name is None:
        raise ValueError(f"reduce_scatter supports ReduceOp SUM, AVG, PRODUCT, MIN and MAX, got {op}")
    if input.numel() != output.numel() * world or input.dtype != output.dtype:
        raise ValueError(
            "input tensor must be the same type as the output tensor and its size must be "
            f"{world} (the group's size) times the output's: got input {input.dtype}"
            f"[{input.numel()}], output {output.dtype}[{output.numel()}]")
    if not (input.is_contiguous() and output.is_contiguous()):
        raise ValueError("reduce_scatter needs contiguous input and output tensors")
    if not gloo_serves(group) or input.device.type != "cpu":
        work = _native_reduce_scatter(output, input, op=op, group=group, async_op=True)
        return PendingReduceScatter(work, None, output, name, world)
    received = torch.empty_like(input).view(-1)
    work = dist.all_to_all_single(received, input.view(-1), group=group, async_op=True)
    return PendingReduceScatter(work, received, output, name, world)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: Any = dist.ReduceOp.SUM,
                          group: dist.ProcessGroup | None = None) -> None:
    """:func:`reduce_scatter_async`, waited for."""
    reduce_scatter_async(output, input, op, group).wait()


# ---- reduce ------------------------------------------------------------------------------
# Gloo's reduce moves as many bytes as its all-reduce (measured with /proc/self/io: the ranks
# of a reduce of n elements write 2n in all at world 2, 3n at world 3; an all-reduce 2n, 4n),
# where a reduce needs each rank but the destination to send its n once. On Gloo, phalanx
# sends every rank's tensor to the destination with one all_to_all_single (all splits but the
# destination's empty) and sums there, in rank order.
class PendingReduce:
    """A reduce in flight (:func:`reduce_async`); :meth:`wait` completes it and, on the
    destination, leaves the sum in the tensor.

    Waited for, it lets go of its work handle, which holds the received copies (``world - 1``
    times the tensor) for as long as it lives: unlike the other helpers' results, do not
    count on it to hold a script's last collective (see :class:`LastWorks`)."""

    def __init__(self, work: Any, received: torch.Tensor | None, tensor: torch.Tensor, dst: int) -> None:
        self._work, self._received, self._tensor, self._dst = work, received, tensor, dst

    def is_completed(self) -> bool:
        """Whether the collective has finished (:meth:`wait` then only sums, on ``dst``)."""
        return self._work is None or self._work.is_completed()

    def wait(self) -> None:
        if self._work is None:
            return
        self._work.wait()
        # done: nothing of the tensors is kept (a caller may hold this past the tensor's use)
        received, flat = self._received, self._tensor.view(-1)
        self._work = self._received = self._tensor = None
        if received is None:  # the backend's own reduce, or not the destination
            return
        others = received.view(-1, flat.numel())
        with torch.no_grad():  # in rank order (this rank's own tensor at its place)
            rows = [*others[:self._dst], flat, *others[self._dst:]]
            acc = rows[0]  # flat itself on rank 0, else a received copy, free to overwrite
            for row in rows[1:]:
                acc.add_(row)
            if acc is not flat:
                flat.copy_(acc)


def reduce_async(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> PendingReduce:
    """Start ``torch.distributed.reduce(tensor, dst, op=SUM)`` with ``dst`` a rank **of**
    ``group``; call ``wait()`` before reading ``tensor`` on ``dst``. On the other ranks
    ``tensor`` is left unchanged (torch leaves it unspecified).

    On Gloo with a contiguous CPU tensor it is one ``all_to_all_single`` (each rank but ``dst``
    sends its tensor to ``dst``, once) and a sum in rank order on ``dst``, which needs room for
    ``world - 1`` copies of ``tensor`` meanwhile; elsewhere, the backend's own reduce.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if not 0 <= dst < world:
        raise ValueError(f"reduce's dst must be a rank of the group (0..{world - 1}), got {dst}")
    if not gloo_serves(group) or tensor.device.type != "cpu" or not tensor.is_contiguous():
        dst_global = dst if group is None else dist.get_global_rank(group, dst)
        return PendingReduce(dist.reduce(tensor, dst_global, group=group, async_op=True), None, tensor, dst)
    n = tensor.numel()
    sends = [n if r == dst and r != rank else 0 for r in range(world)]
    gets = [n if rank == dst and r != rank else 0 for r in range(world)]
    received = tensor.new_empty(sum(gets))
    sent = tensor.view(-1)[:sum(sends)]  # all of it, or nothing on dst
    work = dist.all_to_all_single(received, sent, output_split_sizes=gets,
                                  input_split_sizes=sends, group=group, async_op=True)
    return PendingReduce(work, received if rank == dst else None, tensor, dst)
