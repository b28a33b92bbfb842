"""The same torch script's training step under ``torchrun`` and under ``phalanx run``.

The script is torch's own: ``torch.distributed.init_process_group("gloo")`` and torch's
``DistributedDataParallel`` around the benchmark models (:mod:`phalanx.bench.engine`: mlp, cnn,
gpt), SGD with momentum, 2 processes, one torch thread each. Only the launcher differs, so the
difference is what the launcher gives its workers: under ``phalanx run``, glibc malloc
thresholds that keep the memory a step frees for the next step (docs/launching.md), where
glibc's defaults give it back to the kernel and fault it in again, page by page. A third
launch, ``phalanx run --no-malloc-tuning``, tells that apart from everything else the launcher
does.

Usage::

    python benchmarks/bench_launcher_step.py                  # mlp cnn gpt, 3 rounds
    python benchmarks/bench_launcher_step.py --models cnn --rounds 5

The launchers take turns, round by round (the order rotating), each a fresh launch of every
model; rank 0 reports the median of ``--steps`` timed steps (after 3 untimed ones, each step's
time on the slower rank) and the minor page faults a step cost it. The table gives, per model and
launcher, the median over rounds, and the ratio to torchrun's with its spread (rounds paired by
index).
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
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    "phalanx run": [sys.executable, "-m", "phalanx", "run"],
    "phalanx run --no-malloc-tuning": [sys.executable, "-m", "phalanx", "run", "--no-malloc-tuning"],
}
WARMUP = 3


def _worker(model: str, steps: int, out: str) -> None:
    import resource

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from phalanx.bench.engine import MODELS, make_batch

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.parallel.DistributedDataParallel(MODELS[model][0]())
    opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
    x, y = make_batch(model, 64, seed=1 + rank)
    times, faults = [], resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for step in range(WARMUP + steps):
        if step == WARMUP:
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        began = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        opt.step()
        seconds = torch.tensor(time.perf_counter() - began)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the step ends when the slower rank's does
        times.append(seconds.item())
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"step_ms": 1e3 * statistics.median(times[WARMUP:]), "faults": faults / steps}, f)
    dist.barrier()  # rank 0 has written: leave together (Gloo's teardown may wait on a peer gone)
    dist.destroy_process_group()


def _launch(launcher: str, model: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-") as scratch:
        out = os.path.join(scratch, "result.json")
        # glibc's malloc as the user left it: no threshold set (phalanx run's tuning applies)
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        cmd = LAUNCHERS[launcher] + ["--standalone", "--nproc-per-node", "2", __file__,
                                     "--worker", model, "--steps", str(steps), "--out", out]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{launcher} failed on {model} ({done.returncode}):\n{done.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["mlp", "cnn", "gpt"],
                   choices=("mlp", "cnn", "deep-mlp", "gpt"))
    p.add_argument("--rounds", type=int, default=3, help="launches per launcher and model (default 3)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per launch (default 20)")
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.steps, args.out)
        return {}
    names = list(LAUNCHERS)
    runs = {model: {name: [] for name in names} for model in args.models}
    for turn in range(args.rounds):
        order = names[turn % len(names):] + names[:turn % len(names)]
        for model in args.models:
            for name in order:
                runs[model][name].append(_launch(name, model, args.steps))
    print(f"torch's DDP script, 2 processes on Gloo, 1 thread each; medians of {args.rounds} "
          f"launches of {args.steps} timed steps; ratio: over torchrun's (lowest-highest round)")
    print(f"{'model':<9} {'launcher':<31} {'step ms':>8} {'faults/step':>12} {'ratio':>20}")
    for model, by_name in runs.items():
        theirs = [r["step_ms"] for r in by_name["torchrun"]]
        for name, rs in by_name.items():
            mine = [r["step_ms"] for r in rs]
            ratios = [a / b for a, b in zip(mine, theirs)]
            ratio = "-" if name == "torchrun" else (
                f"{statistics.median(mine) / statistics.median(theirs):.3f} "
                f"({min(ratios):.3f}-{max(ratios):.3f})")
            print(f"{model:<9} {name:<31} {statistics.median(mine):>8.1f} "
                  f"{statistics.median(r['faults'] for r in rs):>12.0f} {ratio:>20}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=2)
    return runs


if __name__ == "__main__":
    main()
