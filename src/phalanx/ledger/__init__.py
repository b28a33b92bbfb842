"""The ledger: one place every collective phalanx issues goes through.

The files, in the order a collective goes through them:

``core.py``
    :class:`Ledger` (one per job's default process group) and :class:`Collective`, the one
    call site: ``with ledger.collective(op, tensors, group, check=..., shadow=...) as c:
    c.wait(work)`` records the collective, puts a sync point first (``check``), announces it
    to ranks that have joined, and turns a failed wait into what its observers say (the hang
    report). :class:`Observer` and :class:`JoinView` are the two ways to watch it.
``syncpoint.py``
    A sync point's payload: one all-reduce of a fixed-size envelope from which every rank reads
    whether the ranks agree, who takes part, and what the active ranks announce to the joined
    ones; a DDP step's check may ride its only bucket's all-reduce in that envelope
    (:meth:`Ledger.take_ride`, :mod:`phalanx.ddp.checkin`).
``log.py``
    The collective log: op, dtype, shape, group, the script's call site, start and end, the
    running fingerprint.

The ledger of the running job is found with :func:`phalanx.diagnostics.ledger`, which attaches
one to the default group whoever made it (``phalanx.init_process_group``, torch's, a launcher's
environment) together with its observer, the hang and straggler reports.
"""

from __future__ import annotations

from .core import Collective, JoinView, Ledger, Observer

__all__ = ["Collective", "JoinView", "Ledger", "Observer"]
