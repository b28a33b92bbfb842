"""SyncBatchNorm's step-time overhead against plain BatchNorm, in a small CNN under DDP.

Usage::

    python benchmarks/bench_sync_batchnorm.py                 # starts 2 ranks itself (Gloo, CPU)
    python benchmarks/bench_sync_batchnorm.py --world-size 2 --repeats 7 --steps 10

Both variants are the same CNN (4 conv + BatchNorm blocks) wrapped in phalanx's
``DistributedDataParallel`` (torch's when phalanx's is not importable; the report says which):
"plain" keeps ``nn.BatchNorm2d`` (each rank normalises its own batch), "sync" converts them with
``phalanx.SyncBatchNorm.convert_sync_batchnorm``. They are timed in turns (plain, sync, plain,
sync, ...), each turn ``--steps`` training steps after a warm-up; a step's time is the slowest
rank's. The report gives the medians, the ratio sync/plain and the overhead per step and per
BatchNorm layer. torch's own ``nn.SyncBatchNorm`` cannot take part: it refuses CPU tensors.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import phalanx
from phalanx.bench.ranks import RESULT_FLAG, launch_ranks, serve


def _cnn(width: int) -> nn.Module:
    def block(cin, cout, stride):
        return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(
        *block(3, width, 1), *block(width, width, 1), *block(width, 2 * width, 2),
        *block(2 * width, 2 * width, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(2 * width, 10),
    )


def _wrap(model: nn.Module):
    try:
        return phalanx.DistributedDataParallel(model), "phalanx"
    except AttributeError:  # phalanx without DDP: torch's
        return nn.parallel.DistributedDataParallel(model), "torch"


def _time_steps(model, opt, x, y, steps: int) -> float:
    """Seconds per step of the slowest rank over ``steps`` steps."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    elapsed = torch.tensor([(time.perf_counter() - start) / steps])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _worker(args: argparse.Namespace) -> tuple[dict, int, str]:
    """({variant: seconds per step of each turn}, BatchNorm layers, whose DDP)."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = _cnn(args.width)
    n_bn = sum(isinstance(m, nn.BatchNorm2d) for m in base.modules())
    variants = {}
    for name in ("plain", "sync"):
        model = copy.deepcopy(base)
        if name == "sync":
            model = phalanx.SyncBatchNorm.convert_sync_batchnorm(model)
        ddp, which = _wrap(model)
        variants[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 3, args.size, args.size, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    for model, opt in variants.values():
        _time_steps(model, opt, x, y, args.warmup)
    times = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, (model, opt) in variants.items():
            times[name].append(_time_steps(model, opt, x, y, args.steps))
    return times, n_bn, which


def _report(times, n_bn, which, args, world) -> None:
    plain, sync = (statistics.median(times[k]) for k in ("plain", "sync"))
    samples = args.batch * world
    print(f"SyncBatchNorm vs BatchNorm: world size {world}, Gloo/CPU, {which} DDP, "
          f"{n_bn} BatchNorm2d layers, batch {args.batch}/rank of 3x{args.size}x{args.size}, "
          f"{args.repeats} interleaved repeats x {args.steps} steps, medians")
    print("| variant | median step (ms) | fastest turn (ms) | samples/s |\n|---|---|---|---|")
    for name, key, t in (("BatchNorm (per rank)", "plain", plain),
                         ("phalanx SyncBatchNorm", "sync", sync)):
        print(f"| {name} | {t * 1e3:.2f} | {min(times[key]) * 1e3:.2f} | {samples / t:.0f} |")
    print(f"ratio sync/plain: {sync / plain:.3f}; overhead {1e3 * (sync - plain):.2f} ms/step, "
          f"{1e3 * (sync - plain) / n_bn:.3f} ms per BatchNorm layer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2, help="ranks to start (default 2)")
    parser.add_argument("--batch", type=int, default=32, help="images per rank (default 32)")
    parser.add_argument("--size", type=int, default=32, help="image side (default 32)")
    parser.add_argument("--width", type=int, default=32, help="channels of the first convs (32)")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed turn (default 10)")
    parser.add_argument("--repeats", type=int, default=7, help="turns per variant (default 7)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    parser.add_argument(RESULT_FLAG, dest="rank_result", help="(set by the script for its ranks)")
    args = parser.parse_args()
    if args.rank_result:  # one of the ranks
        serve(_worker, args.rank_result, args, threads=args.threads)
        return
    times, n_bn, which = launch_ranks(__file__, args.world_size, sys.argv[1:])
    _report(times, n_bn, which, args, args.world_size)


if __name__ == "__main__":
    main()
