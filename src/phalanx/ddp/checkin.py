"""DDP's part in :mod:`phalanx.diagnostics`: a sync point at every forward that leads to
collectives, the step clock, and the straggler reports.

The check of a forward is started, not waited for: the first collective after it (the buffer
broadcast, a SyncBatchNorm's statistics, or the first bucket, well into the backward) waits
for it, so on a model without buffers its latency hides behind the forward. A rank that ran out
of batches and went elsewhere (an evaluation, a checkpoint, the end of the script) is named
there, before any bucket of the wrong size reaches Gloo.

On a model whose gradients fit one small bucket (a latency-bound step, where a collective of
its own would double the step) the check is not sent at the forward: it rides the bucket's
all-reduce, in front of the gradients, in the envelope every sync point has
(:mod:`phalanx.ledger.syncpoint`), and its verdict is read before the gradients are used. A
rank that went elsewhere sends its own sync point in an envelope of the same size: the two
meet, and every rank names the mismatch from the sums. Where the bucket cannot carry it (a
comm hook, ZeRO's owners, another dtype, several buckets, a buffer broadcast first, inside a
join, an evaluation forward) the check goes alone, as above; so it does when another
collective comes before the bucket (a SyncBatchNorm's).
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist

from ..diagnostics import diagnostics, ledger
from ..diagnostics.straggler import StepClock
from ..ledger import syncpoint
from ..ledger.log import call_site

CHECK = "DistributedDataParallel forward"
# A forward under no_grad that only broadcasts the buffers: an evaluation through the DDP model.
EVALUATION = f"{CHECK} without gradients"
# A synchronising forward whose check carries the step times (the straggler report).
WITH_REPORT = f"{CHECK} with a straggler report"


class DDPAction(IntEnum):
    """What a DDP shadows on a rank that has joined (phalanx.join); the codes travel in sync
    points between ranks: only add."""

    FORWARD = 1  # a forward's check (its collectives are announced one by one)
    BUFFERS = 2  # the buffer broadcast (argument: the source rank)
    BUCKET = 3  # a bucket (argument: its index)
    SPARSE = 4  # the sparse gradients


class StepCheck:
    """One DDP model's sync points and step clock.

    Args:
        group: the DDP's process group (``None``: the world).
    """

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.clock: StepClock | None = None
        self._reported_at = 0
        self._book: Any = None  # the ledger of the last checked forward

    def forward(self, sync: bool, broadcasts: bool, join_index: int | None = None,
                ride: str = "") -> Any:
        """Before a forward: ``sync`` (its backward will average), ``broadcasts`` (it sends
        rank 0's buffers first), ``ride`` (the reducer's bucket that can carry the check, see
        the module notes; ``""``: none). While ranks have joined (:mod:`phalanx.uneven`) the check is
        waited for and announces this DDP's step (``join_index``: its place in the join);
        returns the verdict then (who is still active), else ``None``."""
        book = ledger()
        if not book.enabled or not (sync or broadcasts):
            return None
        self._book = book  # the backward's end reads the step clock's waits from it
        report = False
        if sync:
            clock = self.clock
            if clock is None:
                watcher = diagnostics()
                clock = self.clock = StepClock(0) if watcher is None else watcher.new_clock(self.group)
            # while a join runs the ranks' step counts part: no report (restart() after it)
            report = clock.forward(book.waited_s) and self._reported_at != clock.steps and book.join is None
        what = WITH_REPORT if report else CHECK if sync or torch.is_grad_enabled() else EVALUATION
        if join_index is not None:
            announce = (syncpoint.JOINABLE, join_index, DDPAction.FORWARD)
            ride = ""
        else:
            announce = ()
            ride = ride if sync and not broadcasts else ""
        verdict = book.sync_point(what, self.group, wait=report, site=call_site(1, CHECK), announce=announce,
                                  ride=ride)
        if report:
            self._reported_at = clock.steps
            diagnostics().exchange_step_times(clock.take(), clock.steps, self.group, gross=clock.early())
        return verdict if book.join is not None else None

    def restart(self) -> None:
        """A join is over: the ranks ran different numbers of steps; count afresh, alike."""
        self.clock, self._reported_at = None, 0

    def backward_done(self) -> None:
        """A synchronising backward's gradients are averaged (the reducer calls this)."""
        book, self._book = self._book, None
        if self.clock is not None and book is not None:
            self.clock.backward_done(book.waited_s)
