"""Diagnostics, always on: name the late rank, the mismatched collective and the slow rank.

The files, in the order a collective goes through them:

``collectives.py``
    ``phalanx.all_reduce`` and the other group collectives: torch's, after a sync point.
``monitor.py``
    :class:`Diagnostics`, one per process: every collective is recorded (``begin``/``end``);
    at sync points the ranks compare a fingerprint of what they issued (one tiny all-reduce)
    and a mismatch raises :class:`~phalanx.errors.CollectiveMismatchError` on every rank,
    before a payload of the wrong size reaches Gloo.
``log.py``
    The collective log: op, dtype, shape, group, the script's call site, start and end, the
    running fingerprint.
``hang.py``
    When a collective waits past the watchdog limit (or a peer leaves): every rank publishes
    its log and stacks to the store; the report names the ranks that never arrived.
``straggler.py``
    Per step and rank: compute, waiting in collectives, time between steps; rank 0 names a
    rank that is consistently slower than the others.
"""

from __future__ import annotations

from .monitor import current


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
    diag = current()
    return None if diag is None else diag.straggler
