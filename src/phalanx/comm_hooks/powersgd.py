"""PowerSGD (Vogels et al., 2019) as a phased hook: low-rank gradients, any number of buckets, Gloo and NCCL.

Each gradient matrix ``M`` (a parameter of 2 or more dimensions, viewed as ``shape[0] x
rest``) worth compressing is sent as two thin matrices: ``P = M Q`` (all-reduced, then
orthonormalised) and ``Q = M^T P`` (all-reduced, averaged); every rank then holds
``P Q^T``, a rank-``r`` approximation of the average. Vectors (biases) and matrices too
small to gain are averaged exactly, packed into ``P``'s all-reduce.

* **Error feedback**: what the approximation missed on this rank (``M - P Q^T``) is added to
  its next gradient, so nothing is lost for good.
* **Warm start**: each step starts from the last step's ``Q`` (one power iteration per step
  refines it); fresh ``Q``\\ s are drawn from a generator seeded by the seed, bucket and
  iteration, the same on every rank, leaving torch's global RNG alone.
* **Order**: two all-reduces per bucket, issued by the reducer's thread at fixed points
  (:class:`~phalanx.hooks.PhasedHook`), so several buckets work on Gloo; torch's
  hook issues its second and third all-reduce from Gloo's callback thread, where they race
  the next bucket's first (its "Received data size doesn't match expected size").
* **Checkpoints**: :meth:`PowerSGDState.state_dict` holds the iteration, the errors and the
  ``Q``\\ s; :class:`~phalanx.Checkpointer` saves every rank's (``comm_state=``), so a resumed
  run continues exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist

from ..hooks import GradBucket, PhasedHook, Phases


@dataclass(frozen=True)
class _Matrix:
    """A compressed gradient of a bucket: which one, its matrix shape and rank, its slices."""

    index: int  # in bucket.gradients()
    rows: int
    cols: int
    rank: int
    p: slice  # of the P part of the first all-reduce
    q: slice  # of the bucket's Q memory
    error: slice  # of the bucket's error memory


@dataclass(frozen=True)
class _Layout:
    numel: int  # the bucket's
    matrices: tuple[_Matrix, ...]
    exact: tuple[int, ...]  # gradients averaged uncompressed
    exact_numel: int
    p_numel: int
    q_numel: int
    error_numel: int


class PowerSGDState:
    r"""State of :func:`powerSGD_hook`: settings, iteration, error feedback, warm-start ``Q``\ s.

    torch's ``PowerSGDState`` arguments, with the same meaning and defaults. One state serves
    every bucket of one DDP; it keeps its memories per bucket index.

    Args:
        process_group (ProcessGroup, optional): the group to average over; ``None``: the
            default group. The DDP's group.
        matrix_approximation_rank (int): the rank ``r`` of the approximation. Default ``1``.
        start_powerSGD_iter (int): plain all-reduce for this many iterations first (early
            gradients are the most sensitive). Default ``1000`` (torch's); any value from 0
            works, as phalanx never rebuilds its buckets.
        min_compression_rate (float): compress an ``n x m`` matrix only when
            ``(n + m) r * min_compression_rate < n m``. Default ``2``.
        use_error_feedback (bool): default ``True``.
        warm_start (bool): default ``True``.
        orthogonalization_epsilon (float): added to column norms when orthonormalising P
            and Q, for gradients that vanish. Default ``0``.
        random_seed (int): seeds the initial ``Q``\ s. Default ``0``.

    Example::

        >>> state = phalanx.comm_hooks.PowerSGDState(None, matrix_approximation_rank=4,
        ...                                          start_powerSGD_iter=10)
        >>> ddp.register_comm_hook(state, phalanx.comm_hooks.powerSGD_hook)
        >>> ckpt = phalanx.Checkpointer("runs/x", ddp, opt, comm_state=state)
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, matrix_approximation_rank: int = 1,
                 start_powerSGD_iter: int = 1_000, min_compression_rate: float = 2,
                 use_error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0, random_seed: int = 0) -> None:
        for name, value, least in (("matrix_approximation_rank", matrix_approximation_rank, 1),
                                   ("start_powerSGD_iter", start_powerSGD_iter, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        self.process_group = process_group
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.random_seed = random_seed
        self.iter = 0
        self.errors: dict[int, torch.Tensor] = {}
        self.qs: dict[int, torch.Tensor] = {}
        self.numel_before = 0  # elements of the buckets compressed so far
        self.numel_after = 0  # elements all-reduced for them
        self._layouts: dict[int, _Layout] = {}

    def compression_stats(self) -> tuple[float, int, int]:
        """``(rate, elements before, elements sent)`` over the compressed iterations so far."""
        rate = self.numel_before / self.numel_after if self.numel_after else 0.0
        return rate, self.numel_before, self.numel_after

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: iteration, error feedback and ``Q``\\ s per bucket (tensors)."""
        return {"iter": self.iter, "errors": dict(self.errors), "qs": dict(self.qs)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (copied: the state keeps its own tensors)."""
        missing = {"iter", "errors", "qs"} - set(state)
        if missing:
            raise ValueError(f"a PowerSGDState state dict has iter, errors and qs; missing {sorted(missing)}")
        self.iter = int(state["iter"])
        self.errors = {int(b): t.clone() for b, t in state["errors"].items()}
        self.qs = {int(b): t.clone() for b, t in state["qs"].items()}

    def layout(self, bucket: GradBucket) -> _Layout:
        """Which gradients of ``bucket`` are compressed, and where their pieces go (cached)."""
        b = bucket.index()
        layout = self._layouts.get(b)
        if layout is None or layout.numel != bucket.buffer().numel():
            layout = self._layouts[b] = self._plan(bucket)
        return layout

    def _plan(self, bucket: GradBucket) -> _Layout:
        matrices, exact, p, q, err, exact_numel = [], [], 0, 0, 0, 0
        for i, grad in enumerate(bucket.gradients()):
            rows = grad.shape[0] if grad.dim() >= 2 else 0
            cols = grad.numel() // rows if rows else 0
            r = min(rows, cols, self.matrix_approximation_rank)
            if rows and (rows + cols) * r * self.min_compression_rate < rows * cols:
                n = rows * cols
                matrices.append(_Matrix(i, rows, cols, r, slice(p, p + rows * r), slice(q, q + cols * r),
                                        slice(err, err + n)))
                p, q, err = p + rows * r, q + cols * r, err + n
            else:
                exact.append(i)
                exact_numel += grad.numel()
        return _Layout(bucket.buffer().numel(), tuple(matrices), tuple(exact), exact_numel, p, q, err)

    def memories(self, b: int, layout: _Layout, like: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Bucket ``b``'s Q memory and whether it holds a warm start; creates its error memory."""
        if self.use_error_feedback and b not in self.errors:
            self.errors[b] = torch.zeros(layout.error_numel, dtype=like.dtype, device=like.device)
        for what, memory, numel in (("error", self.errors.get(b), layout.error_numel),
                                    ("Q", self.qs.get(b), layout.q_numel)):
            if memory is not None and memory.numel() != numel:
                raise ValueError(f"PowerSGD's {what} memory of bucket {b} has {memory.numel()} elements, the "
                                 f"bucket needs {numel}: a state of another model or bucket plan")
        warm = self.warm_start and b in self.qs
        if not warm:
            self.qs[b] = torch.empty(layout.q_numel, dtype=like.dtype, device=like.device)
            seed = hash((self.random_seed, b, self.iter)) & 0xFFFF_FFFF  # ints hash alike in every process
            generator = torch.Generator().manual_seed(seed)
            self.qs[b].copy_(torch.randn(layout.q_numel, generator=generator, dtype=like.dtype))
        return self.qs[b], warm

    def count(self, bucket: GradBucket) -> None:
        if bucket.is_last():
            self.iter += 1


def _orthonormalise(matrix: torch.Tensor, epsilon: float) -> None:
    """Make ``matrix``'s columns orthonormal, in place: one column is normalised (plus
    ``epsilon``; a zero column stays zero), several go through a QR factorisation
    (Householder: stable for any rank, where one pass of Gram-Schmidt is not)."""
    if matrix.shape[1] == 1:
        norm = torch.linalg.vector_norm(matrix) + epsilon
        if norm > 0:
            matrix /= norm
    else:
        matrix.copy_(torch.linalg.qr(matrix.float()).Q)


def _powersgd(state: PowerSGDState, bucket: GradBucket) -> Phases:
    group = state.process_group
    world = dist.get_world_size(group)
    flat = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        flat.div_(world)
        yield dist.all_reduce(flat, group=group, async_op=True)
        state.count(bucket)
        return flat
    b, layout, grads = bucket.index(), state.layout(bucket), bucket.gradients()
    q_memory, _ = state.memories(b, layout, flat)
    error = state.errors.get(b)
    ms = [grads[m.index].view(m.rows, m.cols) for m in layout.matrices]
    # Q^T, rank x cols: the products below then run as BLAS likes them (M^T P is ~20x slower)
    qts = [q_memory[m.q].view(m.rank, m.cols) for m in layout.matrices]
    ps = [torch.empty(0)] * len(ms)
    first = _first_message(state, layout, grads, ms, qts, error)
    yield dist.all_reduce(first, group=group, async_op=True)
    exact, p_memory = first[: layout.exact_numel], first[layout.exact_numel :]
    offset = 0
    for i in layout.exact:
        n = grads[i].numel()
        torch.div(exact[offset : offset + n].view_as(grads[i]), world, out=grads[i])
        offset += n
    for k, (m, matrix, qt) in enumerate(zip(layout.matrices, ms, qts)):
        ps[k] = p_memory[m.p].view(m.rows, m.rank)
        _orthonormalise(ps[k], state.orthogonalization_epsilon)
        torch.mm(ps[k].T, matrix, out=qt)  # (M^T P)^T
    yield dist.all_reduce(q_memory, group=group, async_op=True)
    q_memory.div_(world)
    for m, matrix, p, qt in zip(layout.matrices, ms, ps, qts):
        if error is not None:  # what this rank's M + error had beyond P Q^T
            torch.addmm(matrix, p, qt, alpha=-1, out=error[m.error].view_as(matrix))
        torch.mm(p, qt, out=matrix)
    if not state.warm_start:
        del state.qs[b]
    state.numel_before += layout.numel
    state.numel_after += layout.exact_numel + layout.p_numel + layout.q_numel
    state.count(bucket)
    return flat


def _first_message(state: PowerSGDState, layout: _Layout, grads: list[torch.Tensor], ms: list[torch.Tensor],
                   qts: list[torch.Tensor], error: torch.Tensor | None) -> torch.Tensor:
    """``[the uncompressed gradients | each (M + error) Q]``, for the first all-reduce."""
    like = grads[0]
    first = torch.empty(layout.exact_numel + layout.p_numel, dtype=like.dtype, device=like.device)
    if layout.exact:
        torch.cat([grads[i].reshape(-1) for i in layout.exact], out=first[: layout.exact_numel])
    p_memory = first[layout.exact_numel :]
    for m, matrix, qt in zip(layout.matrices, ms, qts):
        if error is not None:
            matrix += error[m.error].view_as(matrix)
        _orthonormalise(qt.T, state.orthogonalization_epsilon)  # a fresh Q, or the last step's
        torch.mm(matrix, qt.T, out=p_memory[m.p].view(m.rows, m.rank))
    return first


powerSGD_hook = PhasedHook(_powersgd, "powerSGD_hook")
powerSGD_hook.__doc__ = """PowerSGD on each bucket (see :mod:`phalanx.comm_hooks.powersgd`); ``state``
is a :class:`PowerSGDState`. Works with any number of buckets on Gloo and NCCL.

Example::

    >>> state = phalanx.comm_hooks.PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=10)
    >>> ddp.register_comm_hook(state, phalanx.comm_hooks.powerSGD_hook)
"""
