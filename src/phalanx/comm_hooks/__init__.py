"""Compressed gradients that beat torch's on slow links: 16-bit and PowerSGD hooks.

Hooks for :meth:`phalanx.DistributedDataParallel.register_comm_hook` (torch's names, so
``from phalanx import comm_hooks`` replaces torch's ``default_hooks``/``powerSGD_hook``
imports); the schemes that average the model every few steps instead of the gradients every
step (local SGD, DiLoCo) are :mod:`phalanx.model_averaging`, as torch keeps
``ddp_comm_hooks/`` and ``model_averaging/`` apart. The files:

``lowprec.py``
    ``fp16_compress_hook``, ``bf16_compress_hook`` and the :func:`average_16bit` under them:
    one 16-bit all-reduce per bucket, as torch's, on Gloo and NCCL; fp16 with a scale the
    ranks agree on without a collective, proven not to overflow.
``powersgd.py``
    ``PowerSGDState`` and ``powerSGD_hook``: rank-r approximations with error feedback and
    warm start, with any number of buckets on Gloo and NCCL; the state is checkpointable.

The hooks are :class:`~phalanx.hooks.PhasedHook` generators (the contract, :mod:`phalanx.hooks`):
phalanx's reducer issues their collectives in the same order on every rank
(:mod:`phalanx.ddp.hook_comm`); nothing here imports the DDP.
:func:`by_name` gives the ``(state, hook)`` pair for a name a command line takes.
"""

from __future__ import annotations

from typing import Any

from .lowprec import average_16bit, bf16_compress_hook, fp16_compress_hook
from .powersgd import PowerSGDState, powerSGD_hook

# What by_name() knows: the hooks a --comm-hook option offers ("none": no hook).
HOOK_NAMES = ("none", "fp16", "bf16", "powersgd")


def by_name(name: str, process_group: Any = None, **options: Any) -> tuple[Any, Any] | None:
    """``(state, hook)`` for ``ddp.register_comm_hook(*...)``, or ``None`` for ``"none"``.

    ``options`` go to :class:`PowerSGDState` for ``"powersgd"`` (default rank 4, compressing
    from the 10th iteration).
    """
    if name not in HOOK_NAMES:
        raise ValueError(f"comm hook must be one of {', '.join(HOOK_NAMES)}, got {name!r}")
    if name == "none":
        return None
    if name == "powersgd":
        settings = {"matrix_approximation_rank": 4, "start_powerSGD_iter": 10, **options}
        return PowerSGDState(process_group, **settings), powerSGD_hook
    return process_group, {"fp16": fp16_compress_hook, "bf16": bf16_compress_hook}[name]


__all__ = ["HOOK_NAMES", "PowerSGDState", "average_16bit", "bf16_compress_hook", "by_name",
           "fp16_compress_hook", "powerSGD_hook"]
