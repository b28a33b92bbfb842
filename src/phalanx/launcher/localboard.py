"""One node's board: the same verbs as the nodes' board (:mod:`phalanx.launcher.board`),
with nobody to meet: rounds follow each other, how each ended is kept in memory."""

from __future__ import annotations

from dataclasses import replace

from .membership import Layout
from .outcome import RoundEnd


class LocalBoard:
    """One node: rounds follow each other, how each ended is kept in memory."""

    multi = False

    def __init__(self, layout: Layout) -> None:
        self._first = layout
        self._ends: dict[int, RoundEnd] = {}
        self._done: set[int] = set()

    def start(self) -> None:
        """Nobody to meet."""

    def next_round(self, previous: Layout | None, restarts: int) -> Layout:
        if previous is None:
            return self._first
        return replace(previous, round=previous.round + 1, restarts=restarts)

    def membership(self, round_: int) -> RoundEnd | None:
        return None

    def acknowledge(self, round_: int) -> None:
        """Nobody to tell."""

    def lost_in(self, round_: int) -> list[str]:
        return []

    def publish_end(self, round_: int, record: RoundEnd) -> RoundEnd:
        """Record how ``round_`` ended unless it already is; return the record that stands."""
        return self._ends.setdefault(round_, record)

    def end_record(self, round_: int) -> RoundEnd | None:
        return self._ends.get(round_)

    def report_done(self, round_: int) -> None:
        self._done.add(round_)

    def all_done(self, round_: int) -> bool:
        return round_ in self._done

    def finish(self, record: RoundEnd) -> None:
        """Nobody waits outside a round."""

    def check_out(self) -> None:
        """Nothing to tell anyone."""

    def close(self) -> None:
        """Nothing to release."""
