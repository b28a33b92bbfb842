"""Sparse gradients: parameters of ``nn.Embedding``/``nn.EmbeddingBag(sparse=True)``.

Their gradients are ``torch.sparse_coo`` tensors: a few rows of a large table. As in torch's
DDP, they are averaged as sparse tensors (Gloo's sparse all-reduce: each rank's rows are
exchanged, summed where they coincide) and ``.grad`` stays sparse, coalesced. They are in no
bucket: :func:`sparse_positions` finds them at construction and
:func:`~phalanx.ddp.bucketing.plan_buckets` skips them; their hooks only note that the
gradient came (:class:`SparseGradients`), and the reducer launches their all-reduces at the end
of the backward, after every dense bucket but the last (whose control tail also carries
theirs: which ranks had a gradient), one per parameter, in the same order on every rank.
NCCL has no sparse all-reduce in torch's release builds ("NCCL does not support all_reduce
with sparse tensors"): sparse embeddings need Gloo, with phalanx's DDP as with torch's.

Unlike torch's DDP:

* a sparse parameter with no gradient on a rank takes part with an empty sparse tensor, so
  ``find_unused_parameters`` works with them (torch raises "Expected sparse gradient to be
  defined"); with no gradient on any rank, ``.grad`` is left untouched;
* its all-reduce starts when the backward is done instead of when its gradient is ready (an
  embedding is usually a model's first layer: its gradient is among the last anyway);
* a dense gradient for such a parameter (the table used directly in the loss as well) is
  made sparse (its non-zero rows) before the all-reduce instead of being refused;
* a parameter shared with a module that is not a sparse embedding (weights tied to an output
  ``nn.Linear``) is bucketed as a dense one: its gradient is dense, or densified if it comes
  sparse.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

# The modules whose ``sparse=True`` makes their weight's gradient sparse (torch's DDP looks for
# the same two when it decides which parameters expect sparse gradients).
SPARSE_MODULES = (nn.Embedding, nn.EmbeddingBag)


def sparse_positions(module: nn.Module, named_params: Sequence[tuple[str, torch.Tensor]]) -> list[int]:
    """Positions in ``named_params`` of the trainable parameters every module registering
    them is a sparse embedding (each tensor's first name only)."""
    sparse_only: dict[int, bool] = {}
    for sub in module.modules():
        sparse = isinstance(sub, SPARSE_MODULES) and bool(sub.sparse)
        for param in sub.parameters(recurse=False):
            sparse_only[id(param)] = sparse_only.get(id(param), True) and sparse
    seen: set[int] = set()
    positions = []
    for i, (_, param) in enumerate(named_params):
        if param.requires_grad and sparse_only.get(id(param), False) and id(param) not in seen:
            seen.add(id(param))
            positions.append(i)
    return positions


class SparseGradients:
    """One backward's worth of sparse parameters: which got a gradient, their all-reduces.

    Args:
        named_params: ``(name, parameter)`` of each sparse parameter, each tensor once.
        group: the process group (``None``: the default group).
        divisor: each gradient is divided by it before the all-reduce (sum), for the average.
    """

    def __init__(self, named_params: Sequence[tuple[str, torch.Tensor]],
                 group: dist.ProcessGroup | None, divisor: int) -> None:
        self.names = [name for name, _ in named_params]
        self.params = [param for _, param in named_params]
        self.group = group
        self.divisor = divisor
        self.reset()

    def reset(self) -> None:
        self.got = [False] * len(self.params)  # a hook fired in this backward
        self.late: list[int] = []  # a second gradient in one backward
        self.had_grad = [False] * len(self.params)  # a contribution that was a gradient
        self._reduced: list[torch.Tensor] = []

    def on_grad(self, j: int) -> None:
        if self.got[j]:
            self.late.append(j)  # reported by the reducer's control tail, on every rank
        self.got[j] = True

    def missing(self) -> list[str]:
        return [name for name, got in zip(self.names, self.got) if not got]

    def launch(self, nothing: bool = False) -> list[dist.Work]:
        """Start the all-reduce of each parameter's contribution (its ``.grad`` divided for
        the average, or an empty sparse tensor; always empty with ``nothing``: a rank that has
        joined, phalanx.join), in parameter order."""
        works = []
        with torch.no_grad():
            for j, param in enumerate(self.params):
                grad = None if nothing else param.grad
                self.had_grad[j] = grad is not None
                contribution = _as_sparse(grad, param) / self.divisor
                self._reduced.append(contribution)
                work = dist.all_reduce(contribution, group=self.group, async_op=True)
                # one at a time: with several sparse all-reduces in flight, Gloo's worker threads
                # corrupted the heap (an abort in about 1 of 4 runs of 400 steps; 0 of 8 so)
                work.wait()
                works.append(work)
        return works

    def write_back(self, used: Sequence[bool] | None) -> None:
        """Each reduced (coalesced, sparse) average to ``.grad``, unless ``used`` says no rank
        had a gradient for it."""
        for j, param in enumerate(self.params):
            if used is None or used[j]:
                param.grad = self._reduced[j]


def _as_sparse(grad: torch.Tensor | None, param: torch.Tensor) -> torch.Tensor:
    """``grad`` as a sparse tensor over the rows of ``param`` (empty for ``None``)."""
    if grad is None:
        indices = torch.empty((1, 0), dtype=torch.long, device=param.device)
        values = param.new_empty((0, *param.shape[1:]))
        return torch.sparse_coo_tensor(indices, values, param.shape, check_invariants=False)
    if grad.layout == torch.strided:
        return grad.to_sparse(1)  # its non-zero rows, sparse like an embedding's gradient
    return grad
