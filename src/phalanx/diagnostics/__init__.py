"""Diagnostics, always on: name the late rank, the mismatched collective and the slow rank.

The ledger (:mod:`phalanx.ledger`) records and checks every collective; diagnostics watch it.
The files:

``attach.py``
    :func:`ledger`: the ledger of the job's default group, attached on first use whoever made
    the group (phalanx, torch, a launcher's environment), with the observer below.
``monitor.py``
    :class:`Diagnostics`, the ledger's observer: a failed wait becomes the hang report; the
    straggler settings and last report.
``collectives.py``
    ``phalanx.all_reduce`` and the other group collectives: torch's, after a sync point.
``hang.py``
    When a collective waits past the watchdog limit (or a peer leaves): every rank publishes
    its log and stacks to the store; the report names the ranks that never arrived.
``interrupt.py``
    Ctrl-C in a worker: the ``KeyboardInterrupt``'s traceback without phalanx's frames (the
    script's and torch's, as torchrun's workers print it).
``straggler.py``
    Per step and rank: compute, waiting in collectives, time between steps; rank 0 names a
    rank that is consistently slower than the others, and a grossly slower one after a handful
    of steps and at ``destroy_process_group``.
"""

from __future__ import annotations

from .attach import diagnostics, ledger


def straggler_report() -> dict | None:
    """The last straggler report of this process's DDP steps, or ``None`` before the first
    (every ``straggler_every`` synchronising steps, see ``init_process_group``).

    Returns:
        ``{"steps": N, "ranks": {rank: {"compute": s, "wait": s, "between": s}}, "slow":
        [ranks], "lines": [sentences]}``: per rank, the median seconds per step of the last
        window in forward+backward, waiting in collectives, and between steps.

    Example::

        >>> report = phalanx.straggler_report()
        >>> if report and report["slow"]:
        ...     print(report["lines"])
    """
    diag = diagnostics()
    return None if diag is None else diag.straggler
