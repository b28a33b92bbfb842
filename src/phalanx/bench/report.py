"""Tables and charts from benchmark step times; no torch, so the CLI can report cheaply.

Input is what ``python -m phalanx.bench`` writes (one JSON per process count)::

    {"world_size": N, "batch_size": B, "param_bytes": {model: bytes},
     "times": {model: {impl: {"sync": [s, ...], "no_sync": [...], "sent": [bytes, ...]}}}}

Step times are each step's time on the slowest rank. Definitions used in the table:

* **samples/s**: global batch (``N * B``) over the median step time;
* **scaling efficiency**: samples/s over ``N`` times the single bare process's samples/s at
  the same per-process batch; 1.00 is perfect scaling, and at one process it is the bare
  model's step time over the wrapped one's (the wrapper's overhead);
* **exposed comm**: median step time minus the median step time under ``no_sync()``, the
  communication the backward pass did not hide; below 0 when the steps with sync were the
  faster ones, which is timing noise around a communication hidden entirely (read it as 0;
  :func:`caveats` says so under the table, the chart draws 0);
* **phalanx/torch**: the median over steps of phalanx's step time over torch's step time
  taken beside it (the two alternate step by step, so a change in machine load cancels);
  lower is better. It is printed beside the median step times, which it is not the ratio of.
  phalanx's DDP is paired with torch's DDP, phalanx's ``fully_shard`` with torch's.
* **sent/step** (``phalanx bench --fully-shard``): the median over steps of the bytes rank 0
  wrote during a step (its collectives), in units of the model's parameter bytes.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Sequence

STEP = "step ms (median)"
SENT = "sent/step (x param bytes)"
RATIO = "phalanx/torch (median of paired step ratios; lower is better)"
COLUMNS = ("model", "implementation", "processes", STEP, RATIO, "samples/s",
           "scaling efficiency", "exposed comm ms")
_NAMES = {"bare": "single process", "phalanx": "phalanx DDP", "torch": "torch DDP",
          "phalanx-fsdp": "phalanx fully_shard", "torch-fsdp": "torch fully_shard",
          "torch-shm": "torch DDP over phalanx_shm"}
# the pairs of the paired ratio (torch's DDP over phalanx's backend against it over Gloo)
_PEERS = {"phalanx": "torch", "phalanx-fsdp": "torch-fsdp", "torch-shm": "torch"}
_RATIOS = ("scaling efficiency", RATIO, SENT)  # shown with 3 decimals
LEGEND = (
    "phalanx/torch: each phalanx step's time over the time of the torch step taken beside it,\n"
    "the median of those ratios (the two alternate step by step, so a change in the machine's\n"
    "load cancels); not the ratio of the two median step times. Lower is better: below 1.000\n"
    "phalanx is faster."
)


# A median of fewer timed steps than this is one step, or the mean of two: one slow step (a
# page fault, the scheduler) decides it. Three is the fewest whose median ignores one outlier.
FEW_STEPS = 3


def caveats(rows: Sequence[dict[str, Any]], *, steps: int, repeats: int, warmup: int) -> list[str]:
    """What the table's numbers cannot be trusted for, given how they were measured: no
    warm-up, too few timed steps, a negative exposed communication. Empty when none applies."""
    notes = []
    if warmup == 0:
        notes.append(
            "--warmup 0: the first timed step of each repeat paid one-time costs (memory "
            "allocation, lazy initialisation, DDP's first bucket rebuild), so the step times, "
            "samples/s, the scaling efficiency and the ratio compare un-warmed steps and can be "
            "far off (a scaling efficiency above 1.000 is one sign); use --warmup 1 or more")
    timed = steps * repeats
    if timed < FEW_STEPS:
        notes.append(
            f"only {timed} timed step{'s' if timed > 1 else ''} per implementation (--steps "
            f"{steps} x --repeats {repeats}): each median is that few steps, so one slow step "
            f"decides it; time at least {FEW_STEPS}")
    negative = [r for r in rows if (r.get("exposed comm ms") or 0.0) < 0]
    if negative:
        which = ", ".join(f"{r['implementation']} on {r['processes']} ({r['exposed comm ms']:.1f})"
                          for r in negative)
        notes.append(
            f"exposed comm ms below 0 for {which}: the steps with gradient sync were faster "
            "than those under no_sync(), so the communication was hidden entirely and the "
            "difference is timing noise; read it as 0")
    return notes


def busy_warning(peak_load: float, cores: int) -> str | None:
    """A warning when the load average went above the ``cores`` during the run, else ``None``."""
    if peak_load <= cores:
        return None
    return (f"the machine was busy: its load average reached {peak_load:.1f} on {cores} usable "
            f"core(s) during the run (the benchmark's own processes count too), so the step "
            f"times are noisy; the paired ratio is less affected. Rerun on an idle machine.")


def _ms(times: Sequence[float]) -> float:
    return 1000 * statistics.median(times)


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """Median of step-by-step ratios ``a[i] / b[i]``."""
    return statistics.median(x / y for x, y in zip(a, b))


def steps_per_repeat(result: dict[str, Any], repeats: int) -> dict[str, int]:
    """Per model, the timed steps each implementation took per repeat in ``result`` (one run's
    JSON): ``--steps``, or more under ``--min-seconds``."""
    return {model: len(next(iter(by_impl.values()))["sync"]) // repeats
            for model, by_impl in result["times"].items()}


def ddp_rows(single: dict[str, Any], multi: dict[str, Any], sent: bool = False) -> list[dict[str, Any]]:
    """Rows for every model: the bare single process, then each implementation, alone and at
    N; with ``sent``, a last column of the bytes sent per step (:data:`SENT`)."""
    rows = []
    batch = single["batch_size"]
    for model, by_impl in multi["times"].items():
        alone = single["times"][model]
        bare_ms = _ms(alone["bare"]["sync"])
        runs = [(impl, 1, t) for impl, t in alone.items()]
        runs += [(impl, multi["world_size"], t) for impl, t in by_impl.items()]
        for impl, procs, t in runs:
            step_ms = _ms(t["sync"])
            peer = by_impl.get(_PEERS.get(impl, ""))
            rows.append({
                "model": model,
                "implementation": _NAMES.get(impl, impl),
                "processes": procs,
                STEP: step_ms,
                RATIO: paired_ratio(t["sync"], peer["sync"]) if procs > 1 and peer else None,
                "samples/s": procs * batch / (step_ms / 1000),
                "scaling efficiency": bare_ms / step_ms,
                "exposed comm ms": step_ms - _ms(t["no_sync"]) if t["no_sync"] else None,
            })
            if sent:
                rows[-1][SENT] = statistics.median(t["sent"]) / multi["param_bytes"][model]
    return rows


def overheads(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Per model, what each DDP's step adds over the single bare process's step at the same
    per-process batch (ms), phalanx's share of torch's, and what torch's DDP adds without its
    gradient all-reduce (its step under ``no_sync()``: the processes' contention for the
    machine, which no transport removes); empty without those rows."""
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = {r["implementation"]: r[STEP] for r in rows if r["model"] == model
                and (r["processes"] > 1 or r["implementation"] == _NAMES["bare"])}
        bare, ours, theirs = (mine.get(_NAMES[k]) for k in ("bare", "phalanx", "torch"))
        if bare is None or ours is None or theirs is None:
            continue
        added = {k: mine[k] - bare for k in mine if k != _NAMES["bare"]}
        said = ", ".join(f"{k} {v:+.1f} ms" for k, v in added.items())
        share = (f"; phalanx's is {added[_NAMES['phalanx']] / added[_NAMES['torch']]:.2f} of torch's"
                 if added[_NAMES["torch"]] > 0 else "")
        floor = next((r[STEP] - r["exposed comm ms"] for r in rows if r["model"] == model
                      and r["processes"] > 1 and r["implementation"] == _NAMES["torch"]
                      and r["exposed comm ms"] is not None), None)
        if floor is not None:  # no DDP can add less: two processes compete for the machine
            share += (f"; under no_sync() (no gradient all-reduce) torch DDP's step adds "
                      f"{floor - bare:+.1f} ms already, the floor under any DDP's addition here")
        lines.append(f"{model}: over the single process's {bare:.1f} ms, {said}{share}")
    return lines


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A markdown table; ratios with 3 decimals, times with 1, counts as they are."""
    if not rows:
        return ""
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(k, v) for k, v in row.items()) + " |")
    return "\n".join(lines)


def _cell(column: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if column in _RATIOS or "ratio" in column else f"{value:.1f}"
    return str(value)


def plot(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Bar charts of step time (exposed communication marked) and samples/s, one pair per model."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(
            "the chart needs matplotlib: pip install 'phalanx[examples]' (or pass --no-plot)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(len(models), 2, figsize=(10, 3.2 * len(models)), squeeze=False)
    for (ax_time, ax_rate), model in zip(axes, models):
        mine = [r for r in rows if r["model"] == model]
        labels = [f"{r['implementation']}\n{r['processes']} proc" for r in mine]
        exposed = [max(r["exposed comm ms"] or 0.0, 0.0) for r in mine]  # < 0 is noise
        hidden = [r[STEP] - e for r, e in zip(mine, exposed)]
        ax_time.bar(labels, hidden, color="tab:blue", label="compute (+ hidden comm)")
        ax_time.bar(labels, exposed, bottom=hidden, color="tab:red", label="exposed comm")
        ax_time.set(title=f"{model}: median step time", ylabel="ms")
        ax_time.legend(fontsize=8)
        ax_rate.bar(labels, [r["samples/s"] for r in mine], color="tab:green")
        ax_rate.set(title=f"{model}: throughput", ylabel="samples/s")
        for ax in (ax_time, ax_rate):
            ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
