"""How a round ended: :class:`RoundEnd`, published by the first launcher to see the end.

On several nodes the record travels through node 0's store as JSON (:meth:`RoundEnd.to_json`),
and the first one published wins: every node acts on the same ending.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Literal, Mapping, Sequence

from ..errors import ranks_text
from .output import exception_line
from .workers import describe_exit

Kind = Literal["succeeded", "failed", "preempted", "signal", "lost", "membership"]


@dataclass(frozen=True)
class RoundEnd:
    """The end of one round of workers.

    Args:
        kind: ``"succeeded"`` (every worker everywhere exited 0), ``"failed"`` (a worker
            exited non-zero or died of a signal), ``"preempted"`` (a worker exited with
            :data:`~phalanx.errors.PREEMPTED_EXIT_CODE`), ``"signal"`` (a launcher received a
            stop signal), ``"lost"`` (the other nodes are gone) or ``"membership"`` (a node
            left or joined: the nodes meet again, and no restart is used).
        node: the node of the launcher that saw it (``failed``, ``preempted``, ``signal``).
        host: that node's host name.
        rank: the worker that ended the round (``failed``, ``preempted``).
        local_rank: its local rank.
        returncode: its exit status (``-N``: killed by signal ``N``).
        traceback: the end of its traceback.
        source: where the traceback was found: ``"stderr"`` or the ``@record`` error file.
        signal: the stop signal's name (``signal``).
        detail: what happened, in words (``membership``, ``lost``).
        culprits: the ranks a hang report names as the cause (``failed``): late, or gone,
            while ``rank`` timed out waiting for them (:mod:`phalanx.diagnostics`).
        report: that hang report.
    """

    kind: Kind
    node: int | None = None
    host: str = ""
    rank: int | None = None
    local_rank: int | None = None
    returncode: int | None = None
    traceback: str = ""
    source: str = ""
    signal: str = ""
    detail: str = ""
    culprits: list[int] = field(default_factory=list)
    report: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> RoundEnd:
        return cls(**json.loads(text))

    def who(self, alike: Sequence[tuple[int, int]] = ()) -> str:
        """``"rank 3 (local rank 1) on node 1 (host)"``: the worker that ended the round; with
        ``alike``, the ``(rank, local rank)`` of the workers of its node that failed the same
        way (itself among them), all of them: ``"ranks 2, 3 (local ranks 0, 1) on node 1 (host)"``."""
        if len(alike) < 2:
            return f"rank {self.rank} (local rank {self.local_rank}) on node {self.node} ({self.host})"
        ranks, local_ranks = zip(*sorted(alike))
        return (f"ranks {', '.join(map(str, ranks))} (local ranks {', '.join(map(str, local_ranks))}) "
                f"on node {self.node} ({self.host})")

    def exception_line(self) -> str:
        """The last line of :attr:`traceback`, its exception, without torch's rank prefix."""
        return exception_line(self.traceback)

    def cause(self, exits: Mapping[int, int | None] = MappingProxyType({})) -> str:
        """The root cause in a few words, each rank with its own exit status: the ranks a hang
        report blames (``exits``: the exit statuses known of them, by rank), else the worker.
        ``"rank 1 (exit code 0), named by the hang report (rank 0 (local rank 0) on node 0
        (vm) stopped waiting for it: exit code 1)"``."""
        own = describe_exit(self.returncode)
        if not self.culprits:
            return f"{self.who()}: {own}"
        exits = {**exits, self.rank: self.returncode}
        known = [r for r in self.culprits if exits.get(r) is not None]
        if len(self.culprits) == 1 and known:
            late = f"{ranks_text(self.culprits)} ({describe_exit(exits[known[0]])})"
        else:
            each = "; ".join(f"rank {r}: {describe_exit(exits[r])}" for r in known)
            late = ranks_text(self.culprits) + (f" ({each})" if known else "")
        if self.rank in self.culprits:
            return f"{late}, named by the hang report: {self.who()}"
        them = "it" if len(self.culprits) == 1 else "them"
        return f"{late}, named by the hang report ({self.who()} stopped waiting for {them}: {own})"
