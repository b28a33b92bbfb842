"""Launch to first training step: ``phalanx run`` against ``torchrun``, side by side.

Usage::

    python benchmarks/bench_launch.py                     # 5 turns each, 2 workers
    python benchmarks/bench_launch.py --repeats 9 --json launch.json

Both launchers start the same script (this file, in ``--worker`` mode) with ``--standalone
--nproc-per-node 2``: it joins the process group, wraps a small MLP in phalanx DDP, runs one
training step (forward, backward with the gradient all-reduce, optimizer step) and exits;
rank 0 writes the wall-clock time at which that first step completed. A turn measures from
just before the launcher's process is created to that moment, and to the launcher's exit.
The launchers take turns (A B, then B A, ...), so drifting machine load hits both alike; the
table gives medians and the phalanx/torchrun ratio (below 1: phalanx is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

LAUNCHERS = {
    "phalanx run": [sys.executable, "-m", "phalanx", "run"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
}


def _worker(out: str) -> None:
    import torch

    import phalanx

    phalanx.init_process_group(backend="gloo")
    torch.manual_seed(0)
    model = phalanx.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    if phalanx.get_rank() == 0:
        with open(out, "w") as f:
            f.write(repr(time.time()))
    phalanx.destroy_process_group()


def _turn(name: str, nproc: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        stamp = os.path.join(tmp, "first_step")
        cmd = LAUNCHERS[name] + ["--standalone", "--nproc-per-node", str(nproc),
                                 os.path.abspath(__file__), "--worker", stamp]
        began = time.time()
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        ended = time.time()
        if done.returncode != 0:
            raise RuntimeError(f"{name} failed ({done.returncode}):\n{done.stderr}")
        with open(stamp) as f:
            return float(f.read()) - began, ended - began


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="turns per launcher (default 5)")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=2)
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.worker)
        return []
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in LAUNCHERS}
    names = list(LAUNCHERS)
    for turn in range(args.repeats):
        for name in names if turn % 2 == 0 else names[::-1]:
            times[name].append(_turn(name, args.nproc_per_node))
    rows = [{"launcher": name,
             "first_step_s": statistics.median(t[0] for t in runs),
             "exit_s": statistics.median(t[1] for t in runs),
             "turns": len(runs)} for name, runs in times.items()]
    ratio = rows[0]["first_step_s"] / rows[1]["first_step_s"]
    print(f"launch to first step, --standalone --nproc-per-node {args.nproc_per_node}, "
          f"medians of {args.repeats} interleaved turns")
    print(f"{'launcher':<12} {'first step (s)':>15} {'launcher exit (s)':>18}")
    for row in rows:
        print(f"{row['launcher']:<12} {row['first_step_s']:>15.2f} {row['exit_s']:>18.2f}")
    print(f"ratio phalanx/torchrun (first step): {ratio:.2f}  (target <= 1.0)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "ratio_first_step": ratio}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
