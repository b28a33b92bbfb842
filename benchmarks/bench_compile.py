"""phalanx's DDP and torch's DDP under ``torch.compile``, side by side, on a deep narrow GPT.

Usage::

    python benchmarks/bench_compile.py                     # 2 processes, inductor
    python benchmarks/bench_compile.py --gloo              # everything on Gloo
    python benchmarks/bench_compile.py --backend aot_eager --steps 30 --json compile.json

Each rank builds the GPT of ``phalanx bench --model gpt`` (24 pre-norm blocks of width 64,
293 parameter tensors; ``--depth`` changes the blocks) four times from the same seed: phalanx's
DDP and torch's DDP, each eager and under ``torch.compile(ddp)`` (Dynamo's DDPOptimizer splits
the compiled graph at the buckets' boundaries for both, so the buckets' all-reduces start while
the compiled backward still runs). Each takes ``--warmup`` untimed steps (the compilation
happens there), then the four take turns step by step (A B C D, D C B A, ...) for ``--steps``
timed steps of SGD with momentum (``zero_grad``, forward, cross-entropy, backward, ``step``).
A step's time is the slowest rank's. The table shows each one's median step time and the
medians of the paired ratios (each step's time over the time of the other's step taken in the
same turn: a change in the machine's load cancels), with their spread (the 25th and 75th
percentiles) over the steps. phalanx runs at its defaults (on one host its shared-memory
backend), torch's DDP on Gloo (a group of its own); ``--gloo`` puts phalanx on Gloo too.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

from phalanx.bench.engine import GPT, Trainer, make_batch
from phalanx.bench.ranks import RESULT_FLAG, add_gloo_option, run_script, slowest, torch_group, transport
from phalanx.ddp import DistributedDataParallel

VARIANTS = ("phalanx eager", "phalanx compiled", "torch eager", "torch compiled")
RATIOS = (("phalanx compiled", "torch compiled"), ("phalanx compiled", "phalanx eager"),
          ("torch compiled", "torch eager"), ("phalanx eager", "torch eager"))


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", "--world_size", type=int, default=2)
    p.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    p.add_argument("--depth", type=int, default=24, help="transformer blocks (default 24)")
    p.add_argument("--batch", type=int, default=16, help="sequences of 32 tokens per rank (default 16)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps each (default 3)")
    p.add_argument("--steps", type=int, default=20, help="timed steps each (default 20)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    add_gloo_option(p.add_argument)
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument(RESULT_FLAG, dest="rank_result", help="(set by the script for its ranks)")
    return p.parse_args(argv)


def _trainer(variant: str, args: argparse.Namespace, batch: tuple) -> Trainer:
    torch.manual_seed(0)
    net = GPT(depth=args.depth)
    if variant.startswith("phalanx"):
        ddp = DistributedDataParallel(net)
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(net, process_group=torch_group())
    if variant.endswith("compiled"):
        ddp = torch.compile(ddp, backend=args.backend)
    return Trainer(ddp, batch)



def _rank(args: argparse.Namespace) -> dict:
    batch = make_batch("gpt", args.batch, seed=1 + dist.get_rank())
    trainers = {v: _trainer(v, args, batch) for v in VARIANTS}
    for trainer in trainers.values():
        for _ in range(args.warmup):
            trainer.step()
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for i in range(args.steps):
        for v in VARIANTS if i % 2 == 0 else reversed(VARIANTS):
            times[v].append(slowest(trainers[v].step()))
    return {"times": times, "transport": transport()}


def _report(args: argparse.Namespace, result: dict) -> dict:
    times = result["times"]
    print(f"world size {args.world_size}, {result['transport']}, GPT {args.depth} blocks of width 64, {args.batch} "
          f"sequences per rank, torch.compile backend {args.backend}, {args.steps} timed steps each")
    print(f"{'variant':<18}{'step ms (median)':>18}")
    for v in VARIANTS:
        print(f"{v:<18}{statistics.median(times[v]) * 1e3:>18.1f}")
    rows = {}
    print(f"\n{'ratio':<38}{'median':>8}{'25%':>8}{'75%':>8}")
    for a, b in RATIOS:
        q1, q2, q3 = statistics.quantiles([x / y for x, y in zip(times[a], times[b])], n=4)
        rows[f"{a} / {b}"] = {"median": q2, "q1": q1, "q3": q3}
        print(f"{a + ' / ' + b:<38}{q2:>8.3f}{q1:>8.3f}{q3:>8.3f}")
    return rows


def main(argv=None) -> None:
    run_script(__file__, argv, _parse, _rank, _report)


if __name__ == "__main__":
    main()
