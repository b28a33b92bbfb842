"""Ctrl-C in a worker: the ``KeyboardInterrupt``'s traceback without phalanx's own frames.

A terminal's Ctrl-C reaches every worker wherever it is, most often inside phalanx, waiting
for a collective (a DDP bucket, a sync point): Python would print the traceback through
phalanx's ledger and reducer. Under torchrun, a worker of torch's DDP prints the script's
frames and torch's; phalanx's :func:`install` makes ``sys.excepthook`` drop phalanx's frames
from a ``KeyboardInterrupt``'s traceback (the script's and torch's stay), and the exception
it interrupted (a peer stopped first: Gloo's "Connection closed" in this rank's wait), and
hands every exception, that one included, to the hook it replaced.
"""

from __future__ import annotations

import os
import sys
from types import TracebackType
from typing import Any, Callable

_PHALANX = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def without_phalanx(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` with the frames of phalanx's package left out (relinked in place)."""
    kept = []
    while tb is not None:
        if not tb.tb_frame.f_code.co_filename.startswith(_PHALANX):
            kept.append(tb)
        tb = tb.tb_next
    for outer, inner in zip(kept, kept[1:]):
        outer.tb_next = inner
    if kept:
        kept[-1].tb_next = None
    return kept[0] if kept else None


class _Hook:
    """``sys.excepthook``: a ``KeyboardInterrupt`` without phalanx's frames, then ``previous``."""

    def __init__(self, previous: Callable[..., Any]) -> None:
        self.previous = previous

    def __call__(self, kind: type[BaseException], error: BaseException,
                 tb: TracebackType | None) -> None:
        if issubclass(kind, KeyboardInterrupt):
            tb = without_phalanx(tb)
            error = error.with_traceback(tb)
            # what it cut short (a peer that had stopped first closed the collective this rank
            # waited in: Gloo's error, its hang report) is the same Ctrl-C's consequence
            error.__suppress_context__ = True
        self.previous(kind, error, tb)


def install() -> None:
    """Make ``sys.excepthook`` leave phalanx's frames out of a Ctrl-C's traceback (once)."""
    if not isinstance(sys.excepthook, _Hook):
        sys.excepthook = _Hook(sys.excepthook)
