"""Bounds on a float result by the oracle's own distance, measured in the same run.

How far a distributed run lands from one process on the global batch depends on rounding:
the order in which the ranks' contributions are summed, and the order a BLAS kernel sums a
matrix product in, which differs between CPUs (an AMD EPYC and an Intel Xeon round the same
product otherwise). A constant tolerance tuned on one CPU fails on another. So a test holds
phalanx to torch's own implementation run on the same machine, in the same run: bit for bit
where that holds (a sum of two terms is the same whatever the order), otherwise within
:func:`oracle_bound` of one process, where torch's own distance from it sets the bound.

phalanx follows torch 2.13's API (CI's torch); pyproject allows an older one. A check whose
oracle the running torch lacks skips, naming it (:func:`torch_lacks`), and the rest of its
module still runs; a comparison with torch's surface leaves out, on a torch before 2.13, the
names torch 2.11 lacks (:func:`on_this_torch`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.torch_version import TorchVersion

# one unit in the last place of an fp32 value of 1.0 (2^-23)
FP32_EPS = torch.finfo(torch.float32).eps
# a few of them: the roundings a max-abs difference of two results can gain besides the order
# of a sum (the subtraction itself, Adam's division), and room for a torch distance of zero
# (torch's summation order happening to be one process's) where phalanx's order is another
ULPS = 4


def oracle_bound(torch_distance: float, magnitude: float, ulps: int = ULPS, factor: float = 2.0) -> float:
    """The largest distance from one process allowed to phalanx where torch's own is
    ``torch_distance``: twice it (``factor``), plus ``ulps`` units in the last place of
    ``magnitude``.

    phalanx and torch run the same arithmetic on the same numbers but for the order in which
    the ranks' contributions are summed (phalanx's reduce-scatter adds in rank order, Gloo's
    ring in its own). Each order's distance from one process is rounding noise of one size,
    amplified alike by what follows (Adam divides each gradient by its own running size, so
    its last bits move a parameter by up to about ``lr``): torch's distance, measured on the
    same machine, is that size; twice it lets phalanx's order round the other way wherever
    torch's happened to round toward one process. A real bug (a wrong divisor, a gradient
    lost or added twice, a shard in the wrong place) is of the size of the gradients, not of
    their last bits, and lies far above (the tests that use this check that it does).

    Args:
        torch_distance: torch's implementation's max-abs distance from one process.
        magnitude: the largest absolute value compared (the ULPs are of it).
        ulps: units in the last place of ``magnitude`` allowed besides. Default: ``ULPS``.
        factor: the multiple of ``torch_distance`` allowed. Default: 2 (a caller whose
            phalanx path rounds in more stages than torch's says why it allows more).
    """
    return factor * torch_distance + ulps * FP32_EPS * magnitude


def triangle_bound(ours_distance: float, torch_distance: float, magnitude: float) -> float:
    """The largest distance between phalanx's and torch's results where each is the given
    distance from one process: their sum (the triangle inequality), and one unit in the last
    place of ``magnitude`` for the rounding of the subtractions that measured them."""
    return ours_distance + torch_distance + FP32_EPS * magnitude


def reorder_bound(largest_term: float, terms: int) -> float:
    """The largest difference between two averages of the same ``terms`` values, each at
    most ``largest_term`` in size, summed in different orders (phalanx's reduction against
    torch's, on the same ranks' gradients): each sum rounds ``terms - 1`` times, the division
    once, each rounding within one unit in the last place of the sum of the terms' sizes
    (at most ``terms * largest_term``). Arithmetic alone: the same on every CPU."""
    return 2 * terms * FP32_EPS * terms * largest_term


def magnitude(tensors) -> float:
    """The largest absolute value in ``tensors`` (0.0 for none or empty ones)."""
    return max((t.detach().abs().max().item() for t in tensors if t.numel()), default=0.0)


# the torch whose surface phalanx follows, and CI's; an older one lacks some of its API
TORCH_2_13 = TorchVersion(torch.__version__) >= "2.13"


def on_this_torch(names, newer: set[str]) -> list[str]:
    """``names`` of torch 2.13's surface (in their order) that the running torch has: all on
    torch 2.13 and later, those not in ``newer`` (what torch 2.11 lacks) on an older one."""
    return [n for n in names if TORCH_2_13 or n not in newer]


def torch_lacks(owner: Any, name: str) -> str | None:
    """``None`` where the running torch has ``owner``'s attribute ``name`` (or, ``name``
    ending in ``=``, an argument of the callable ``owner``: ``"forward_sync_buffers="``);
    otherwise why a check whose oracle it is cannot run, to skip it with: "torch 2.11.0 has
    no torch.distributed.fsdp.FSDPModule.set_reduce_scatter_unused_params, this check's
    oracle"."""
    if name.endswith("="):
        if name[:-1] in inspect.signature(owner).parameters:
            return None
        what = f"{_name_of(owner)}({name})"
    elif hasattr(owner, name):
        return None
    else:
        what = f"{_name_of(owner)}.{name}"
    return f"torch {torch.__version__} has no {what}, this check's oracle"


def _name_of(owner: Any) -> str:
    if inspect.ismodule(owner):
        return owner.__name__
    return f"{owner.__module__.split('._')[0]}.{owner.__qualname__}"  # its public module
