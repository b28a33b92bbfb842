"""Stragglers: the rank consistently slower than the others, although DDP's all-reduce makes
every rank's step last as long as the slowest one's.

Each synchronising DDP step, every rank splits its time three ways:

* **compute**: from the start of the forward to the end of the backward, less the time spent
  waiting for collectives within it;
* **wait**: time blocked in collectives (the forward's sync point, the end-of-backward wait
  for the buckets): the fast ranks' share of a straggler;
* **between**: from the end of one backward to the start of the next forward: data loading,
  the optimizer step, logging, whatever the script does between steps.

A slow rank shows in compute or between; the others in wait. Every ``every`` steps the ranks
exchange the medians of their last ``every`` steps, and rank 0 logs one line per rank whose
compute + between is above :data:`SLOW_RATIO` times the median of the other ranks' and more
than :data:`MIN_GAP_S` above it. :func:`phalanx.straggler_report` returns the last figures.

Two looks over a handful of steps name a *gross* straggler only (:data:`GROSS_RATIO` times the
fastest other rank, :data:`GROSS_GAP_S` more per step), so that a short run names the rank
holding it back, and the jitter of a few warm-up steps names nobody:

* the first look, once after the first :data:`EARLY_STEPS` steps (with a window longer than
  :data:`EARLY_WINDOW_MIN` steps);
* the look at the end, in ``destroy_process_group``: the steps since the last report (all of
  them in a run shorter than the first look), of the DDP models on the default group.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

# A rank this much slower than the others holds the whole job back by as much; smaller gaps
# are within the jitter of ranks sharing a machine (measured here: two ranks on two cores
# differ by up to ~10% step to step, much less in medians over a window).
SLOW_RATIO = 1.25
# ...and at least this many seconds per step slower, so that microsecond steps (a tiny model
# on an idle machine) never name a rank for noise.
MIN_GAP_S = 0.005
# Default report interval in steps: a line at most every few hundred steps, and medians over
# enough steps to be steady.
DEFAULT_EVERY = 200
# The first look: after this many steps (the first step's "between" is never measured, so 4
# measured gaps), when the window is longer than EARLY_WINDOW_MIN (a window of 20 steps or fewer
# is a first look already).
EARLY_STEPS = 5
EARLY_WINDOW_MIN = 20
# A straggler named from a handful of steps must be "several times slower" (issue 25 item 8).
# Over the first 5 steps warm-up alone made one of two ranks on two loaded cores 1.9x slower
# than the other (the quick start, measured here): three times the fastest rank's time, and a
# tenth of a second per step more (a delay a person notices over a handful of steps).
GROSS_RATIO = 3.0
GROSS_GAP_S = 0.1
PHASES = ("compute", "wait", "between")


@dataclass
class StepTimes:
    """One rank's time per phase in the current window (seconds per step)."""

    compute: list[float] = field(default_factory=list)
    wait: list[float] = field(default_factory=list)
    between: list[float] = field(default_factory=list)

    def medians(self) -> list[float]:
        return [statistics.median(getattr(self, p)) if getattr(self, p) else 0.0 for p in PHASES]


class StepClock:
    """Times this rank's synchronising DDP steps (see the module notes).

    The DDP wrapper calls :meth:`forward` when a synchronising forward starts and
    :meth:`backward_done` when the backward's gradients are averaged, each with the seconds
    this process has waited in collectives so far (:attr:`phalanx.ledger.Ledger.waited_s`).
    :meth:`due` says when the window is full.

    Args:
        every: steps per window; ``0`` switches the report off. Default :data:`DEFAULT_EVERY`.
    """

    def __init__(self, every: int = DEFAULT_EVERY) -> None:
        self.every = every
        self.window = StepTimes()
        self.steps = 0
        self._start: float | None = None
        self._last_end: float | None = None
        self._waited_before = 0.0

    def forward(self, waited_s: float, now: float | None = None) -> bool:
        """A synchronising forward starts; returns :meth:`due` (one call a step)."""
        now = time.monotonic() if now is None else now
        if self._last_end is not None and self._start is None:
            self.window.between.append(now - self._last_end)
        self._start, self._waited_before = now, waited_s
        steps, every = self.steps, self.every
        # due(), inline
        return every > 0 and steps > 0 and (steps == EARLY_STEPS and every > EARLY_WINDOW_MIN or steps % every == 0)

    def backward_done(self, waited_s: float, now: float | None = None) -> None:
        if self._start is None:  # a backward without a timed forward (no_sync() first)
            return
        now = time.monotonic() if now is None else now
        waited = waited_s - self._waited_before
        self.window.compute.append(max(0.0, now - self._start - waited))
        self.window.wait.append(waited)
        self._start, self._last_end = None, now
        self.steps += 1

    def due(self) -> bool:
        """Whether the next forward's sync point should carry a report (every rank agrees: the
        ranks' step counts are equal, or the sync point itself fails first)."""
        if self.every <= 0 or self.steps == 0:
            return False
        return self.early() or self.steps % self.every == 0

    def early(self) -> bool:
        """Whether a report now is the first look (a handful of steps: gross stragglers only)."""
        return self.every > EARLY_WINDOW_MIN and self.steps == EARLY_STEPS

    def pending(self) -> bool:
        """Whether steps were timed since the last report (the look at the end takes them)."""
        return self.every > 0 and bool(self.window.compute)

    def take(self) -> list[float]:
        """This window's medians (compute, wait, between), and a fresh window."""
        medians, self.window = self.window.medians(), StepTimes()
        return medians


def assess(per_rank: list[list[float]], steps: int, gross: bool = False) -> dict:
    """The report for every rank's medians ``[compute, wait, between]``: the figures, and the
    ranks found slow with a sentence each; ``gross``: measured over a handful of steps, so
    compared with the fastest other rank by :data:`GROSS_RATIO` and :data:`GROSS_GAP_S`."""
    ranks = {r: dict(zip(PHASES, values)) for r, values in enumerate(per_rank)}
    busy = {r: v["compute"] + v["between"] for r, v in ranks.items()}
    ratio, gap = (GROSS_RATIO, GROSS_GAP_S) if gross else (SLOW_RATIO, MIN_GAP_S)
    slow, lines = [], []
    for r, mine in busy.items():
        others = [b for q, b in busy.items() if q != r]
        if not others:
            continue
        typical = min(others) if gross else statistics.median(others)
        if mine > ratio * typical and mine - typical > gap:
            slow.append(r)
            lines.append(_sentence(r, ranks, typical, mine, gross))
    return {"steps": steps, "ranks": ranks, "slow": slow, "lines": lines}


def _sentence(rank: int, ranks: dict, typical: float, mine: float, gross: bool) -> str:
    figures = ranks[rank]
    others = [v for q, v in ranks.items() if q != rank]
    pick = min if gross else statistics.median
    gaps = {p: figures[p] - pick(o[p] for o in others) for p in ("compute", "between")}
    phase = max(gaps, key=gaps.get)
    where = "forward+backward" if phase == "compute" else "time between steps (data, optimizer, logging)"
    ratio = mine / typical if typical > 0 else float("inf")
    than = "the fastest other rank" if gross else "the median of the other ranks"
    return (f"rank {rank} is {ratio:.1f}x slower than {than}, in {where}: "
            f"{figures[phase]:.3f} s per step (others {figures[phase] - gaps[phase]:.3f} s); "
            f"forward+backward {figures['compute']:.3f} s, between steps {figures['between']:.3f} s, "
            f"waiting {figures['wait']:.3f} s")


def look_back(by_rank: dict[int, list], world_size: int) -> dict | None:
    """The report of the look at the end, from what each rank sent: ``[clock, steps, steps in
    the window, medians]`` per DDP with steps since its last report (``clock``: the DDP's
    number, in the order they were made). The first DDP every rank sent is assessed for gross
    stragglers (:func:`assess`), with ``"window"``: the steps it covers. ``None`` when a rank
    is missing (it never came) or no DDP is common to all."""
    if sorted(by_rank) != list(range(world_size)):
        return None
    rows = [{entry[0]: entry for entry in by_rank[rank]} for rank in range(world_size)]
    common = set(rows[0]).intersection(*rows[1:])
    if not common:
        return None
    first = min(common)
    report = assess([row[first][3] for row in rows], rows[0][first][1], gross=True)
    report["window"] = rows[0][first][2]
    return report
