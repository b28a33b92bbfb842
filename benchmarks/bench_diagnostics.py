"""What phalanx's always-on diagnostics cost a DDP step: on against off, side by side.

Usage::

    python benchmarks/bench_diagnostics.py                  # MLP and CNN, 2 processes
    python benchmarks/bench_diagnostics.py --repeats 9 --steps 20

Runs ``python -m phalanx.bench`` on ``--nproc`` processes with two implementations taking
turns step by step (A B, B A, ...) on fresh models from the same seed: phalanx's DDP as it
ships (``phalanx``: every synchronising forward starts a sync point, every bucket is
recorded) and the same DDP with this process's diagnostics switched off during its steps
(``phalanx-nodiag``). The ratio is the median of step-by-step ratios (on / off; 1.00 is no
cost); the spread is the lowest and highest per-repeat median ratio.
"""

from __future__ import annotations

import argparse
import statistics

from phalanx.bench.ranks import launch_ranks
from phalanx.bench.report import paired_ratio


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="processes (default 2)")
    p.add_argument("--models", nargs="+", default=["mlp", "cnn"], choices=("mlp", "cnn"))
    p.add_argument("--repeats", type=int, default=7, help="fresh models per implementation (default 7)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per repeat (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per repeat (default 3)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = _parse(argv)
    result = launch_ranks("phalanx.bench", args.nproc, [
        "--models", *args.models, "--impls", "phalanx", "phalanx-nodiag",
        "--repeats", str(args.repeats), "--steps", str(args.steps), "--warmup", str(args.warmup),
    ], module=True)
    print(f"\n{args.nproc} processes, Gloo, {args.repeats} repeats x {args.steps} steps, batch 64 "
          "per process, 1 thread; step times are the slowest rank's\n")
    print("| model | diagnostics on, step ms | off, step ms | on/off (paired median) | spread over repeats |")
    print("|---|---|---|---|---|")
    for model, times in result["times"].items():
        on, off = times["phalanx"]["sync"], times["phalanx-nodiag"]["sync"]
        per_repeat = [paired_ratio(on[i:i + args.steps], off[i:i + args.steps])
                      for i in range(0, len(on), args.steps)]
        print(f"| {model} | {1e3 * statistics.median(on):.1f} | {1e3 * statistics.median(off):.1f} "
              f"| {paired_ratio(on, off):.3f} | {min(per_repeat):.3f}-{max(per_repeat):.3f} |")


if __name__ == "__main__":
    main()
