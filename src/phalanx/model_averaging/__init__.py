"""Model averaging: each rank trains alone, the ranks average the model every few steps.

Instead of the gradients at every step (:mod:`phalanx.comm_hooks` compresses those), the
parameters themselves, or an outer optimizer's step from them, are averaged every ``every``
optimizer steps, as in torch's ``torch.distributed.algorithms.model_averaging``, which torch
keeps apart from its ``ddp_comm_hooks``. The files:

``periodic.py``
    :class:`LocalSGD` and :class:`DiLoCo` (also ``phalanx.LocalSGD``/``phalanx.DiLoCo``):
    local steps, the model averaged (or an outer Nesterov step taken) every ``every`` steps,
    optionally overlapped with the next ``overlap`` steps.

A meeting's averagings are phases (:mod:`phalanx.hooks`), run to their ends by the meeting
itself; DiLoCo's 16-bit pseudo-gradients go through :func:`phalanx.comm_hooks.average_16bit`.
They compose with phalanx's or torch's DDP, or a plain module, and import no DDP.
"""

from __future__ import annotations

from .periodic import DiLoCo, LocalSGD

__all__ = ["DiLoCo", "LocalSGD"]
