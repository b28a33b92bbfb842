"""phalanx DDP against torch DDP, side by side, and phalanx's world-size-1 overhead.

Usage::

    python benchmarks/bench_ddp.py                         # mlp and cnn, world size 2, Gloo
    python benchmarks/bench_ddp.py --models mlp --repeats 9 --json ddp.json

World size 2 (``--world-size``), one thread per rank: for each model, phalanx and torch take
turns (A B A B ..., ``--repeats`` times), each on a fresh model from the same seed with the same
data and bucket size, ``--warmup`` untimed steps then ``--steps`` timed ones, then as many
under ``no_sync()``. A step's time is the slowest rank's. The table gives medians over all
timed steps; exposed communication is the step time minus the ``no_sync`` step time.
Then one process alone compares the bare model with phalanx DDP at world size 1.
The measurement code is ``phalanx.bench``; this script only starts the processes.
"""

from __future__ import annotations

import argparse
import json
import os
import socket

import torch
import torch.multiprocessing as mp

import phalanx
from phalanx import bench


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["mlp", "cnn"], choices=sorted(bench.MODELS))
    p.add_argument("--world-size", "--world_size", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5, help="turns per implementation (default 5)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per turn (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per turn (default 3)")
    p.add_argument("--batch-size", "--batch_size", type=int, default=64, help="per rank (default 64)")
    p.add_argument("--bucket-cap-mb", "--bucket_cap_mb", type=float, default=None,
                   help="default: both libraries' default (25 MiB with a 1 MiB first bucket)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--json", help="also write the rows to this file")
    return p.parse_args(argv)


def _rank(rank: int, world_size: int, port: int, args: argparse.Namespace, impls, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    phalanx.init_process_group(backend="gloo")
    try:
        rows = []
        for model in args.models:
            times = bench.compare(model, impls, args.repeats, args.steps, args.warmup,
                                  args.batch_size, args.bucket_cap_mb, with_no_sync=world_size > 1)
            rows += bench.summarize(model, times, args.batch_size * world_size)
        if rank == 0:
            queue.put(rows)
    finally:
        phalanx.destroy_process_group()


def _run(world_size: int, args: argparse.Namespace, impls) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world_size, port, args, impls, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    rows = queue.get()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"a rank exited with {p.exitcode}")
    return rows


def main(argv=None) -> None:
    args = _parse(argv)
    rows = _run(args.world_size, args, ("phalanx", "torch"))
    print(f"world size {args.world_size}, Gloo, {args.threads} thread(s) per rank, "
          f"batch {args.batch_size} per rank, bucket_cap_mb {args.bucket_cap_mb or 'default'}")
    print(bench.format_table(rows))
    alone = _run(1, args, ("bare", "phalanx"))
    print("\nworld size 1: phalanx DDP against the bare model")
    print(bench.format_table(alone))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world": rows, "alone": alone}, f, indent=2)


if __name__ == "__main__":
    main()
