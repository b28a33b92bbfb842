"""torch's DDP tutorial series (``multinode.py``'s training loop) at batch 1: phalanx against
torch, whole epochs, each under its own launcher.

Usage::

    python benchmarks/bench_tutorial.py                     # 5 rounds, 3 epochs each
    python benchmarks/bench_tutorial.py --rounds 7 --batch-size 1 --nproc 2

The tutorial trains ``nn.Linear(20, 1)`` with SGD on 2048 random samples, its
``DistributedSampler`` giving each of 2 ranks 1024 samples: at batch 1 an epoch is 1024 tiny
steps, so each step is latency: a forward, one gradient all-reduce of 21 floats, an optimizer
step, plus whatever the data-parallel system adds per step. It is the worst case for per-step
overheads such as phalanx's forward sync point (the check that every rank issues the same
collectives, :mod:`phalanx.ledger`).

Four implementations take turns, round by round (rotating the order), each a fresh launch:

* ``torch``: ``torchrun`` and torch's own DDP and sampler (the tutorial as written);
* ``phalanx``: ``phalanx run`` and phalanx's imports (diagnostics on: the default);
* ``phalanx-nodiag``: the same with ``init_process_group(diagnostics=False)``;
* ``phalanx-shm``: diagnostics on, ``init_process_group(shared_memory=True)``: the gradient's
  all-reduce and the sync point over same-host shared memory (:mod:`phalanx.shm`) instead of
  Gloo's loopback.

Each launch trains ``--epochs`` epochs; rank 0 reports each epoch's wall time, the first epoch
left out (start-up: the first all-reduces, page faults). The table gives the median epoch of
every round, the ratio of medians to torch's, and the spread (lowest and highest per-round
median ratio, rounds paired by index).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

IMPLS = ("torch", "phalanx", "phalanx-nodiag", "phalanx-shm")


def _worker(impl: str, epochs: int, batch_size: int, result: str) -> None:
    """One rank of the tutorial's training loop (``Trainer._run_epoch``), timing each epoch."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    if impl == "torch":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torch.utils.data.distributed import DistributedSampler
        dist.init_process_group(backend="gloo")
    else:
        import phalanx as dist
        from phalanx import DistributedDataParallel as DDP
        from phalanx import DistributedSampler
        dist.init_process_group(backend="gloo", diagnostics=impl != "phalanx-nodiag",
                                shared_memory=impl == "phalanx-shm")
    torch.manual_seed(0)  # the tutorial's MyTrainDataset(2048): random inputs and targets
    data = [(torch.rand(20), torch.rand(1)) for _ in range(2048)]
    model = DDP(torch.nn.Linear(20, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(data, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(data))
    times = []
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        start = time.perf_counter()
        for source, targets in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(source), targets)
            loss.backward()
            optimizer.step()
        times.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        with open(result, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def _launch(impl: str, args: argparse.Namespace, scratch: str) -> list[float]:
    result = os.path.join(scratch, f"{impl}.json")
    bindir = os.path.dirname(sys.executable)
    launcher = ([os.path.join(bindir, "torchrun"), "--standalone"] if impl == "torch"
                else [os.path.join(bindir, "phalanx"), "run", "--standalone"])
    command = [*launcher, "--nproc-per-node", str(args.nproc), os.path.abspath(__file__),
               "--worker", impl, "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
               "--result", result]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # torchrun's default for several workers
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    with open(result) as f:
        return json.load(f)[1:]  # the first epoch is start-up


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="processes (default 2)")
    p.add_argument("--rounds", type=int, default=5, help="launches per implementation (default 5)")
    p.add_argument("--epochs", type=int, default=3, help="epochs per launch, the first untimed (default 3)")
    p.add_argument("--batch-size", type=int, default=1, help="the tutorial's --batch_size (default 1)")
    p.add_argument("--json", help="also write the table's rows to this file")
    p.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.epochs < 2:
        p.error(f"--epochs should be at least 2 (the first is not timed), got {args.epochs}")
    if args.worker:
        _worker(args.worker, args.epochs, args.batch_size, args.result)
        return
    medians: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    scratch = tempfile.mkdtemp(prefix="phalanx-bench-tutorial-")
    try:
        for r in range(args.rounds):
            order = IMPLS[r % len(IMPLS):] + IMPLS[:r % len(IMPLS)]
            for impl in order:
                medians[impl].append(statistics.median(_launch(impl, args, scratch)))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    steps = 2048 // args.nproc // args.batch_size
    print(f"\nDDP tutorial, {args.nproc} processes, Gloo, batch {args.batch_size} ({steps} steps "
          f"per epoch), {args.rounds} launches x {args.epochs - 1} timed epochs each\n")
    print("| implementation | epoch s (median) | per-launch medians | /torch | spread |")
    print("|---|---|---|---|---|")
    base, rows = medians["torch"], {}
    for impl in IMPLS:
        ratios = [a / b for a, b in zip(medians[impl], base)]
        rows[impl] = {"epoch_s": statistics.median(medians[impl]), "per_launch": medians[impl],
                      "ratio": statistics.median(medians[impl]) / statistics.median(base),
                      "spread": [min(ratios), max(ratios)]}
        print(f"| {impl} | {rows[impl]['epoch_s']:.2f} | {', '.join(f'{m:.2f}' for m in medians[impl])} "
              f"| {rows[impl]['ratio']:.3f} | {min(ratios):.3f}-{max(ratios):.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
