"""torch's DDP tutorial series (``multinode.py``'s training loop) at batch 1: phalanx against
torch, whole epochs, each under its own launcher.

Usage::

    python benchmarks/bench_tutorial.py                     # 5 rounds, 3 epochs each, one host
    python benchmarks/bench_tutorial.py --rounds 7 --batch-size 1 --nproc 2
    python benchmarks/bench_tutorial.py --netns             # two "hosts": network namespaces (root)
    python benchmarks/bench_tutorial.py --netns --rate 1gbit
    python benchmarks/bench_tutorial.py --netns --threads   # and each thread's wake-ups

The tutorial trains ``nn.Linear(20, 1)`` with SGD on 2048 random samples, its
``DistributedSampler`` giving each of 2 ranks 1024 samples: at batch 1 an epoch is 1024 tiny
steps, so each step is latency: a forward, one gradient all-reduce of 21 floats, an optimizer
step, plus whatever the data-parallel system adds per step. It is the worst case for per-step
overheads such as phalanx's forward sync point (the check that every rank issues the same
collectives, :mod:`phalanx.ledger`), which here rides the gradient's all-reduce.

The implementations take turns, round by round (rotating the order), each a fresh launch:

* ``torch``: ``torchrun`` and torch's own DDP and sampler (the tutorial as written);
* ``phalanx``: ``phalanx run`` and phalanx's imports, its defaults: diagnostics on, and on
  one host the collectives over same-host shared memory (:mod:`phalanx.shm`); across
  namespaces (two "hosts") Gloo;
* ``phalanx-nodiag``: the same with ``init_process_group(diagnostics=False)``;
* ``phalanx-gloo`` (one host only): diagnostics on, ``init_process_group(shared_memory=False)``:
  the gradient's all-reduce over Gloo's loopback, as torch's.

With ``--netns`` the two ranks run as two nodes of one job, one in each of two network
namespaces joined by a veth pair (:mod:`phalanx.bench.netns`; ``--rate``: ``tc`` limits each
end), Gloo between them over the veth as between two hosts; each launcher (``torchrun`` or
``phalanx run``, ``--nnodes 2``) in its namespace. Needs root.

Each launch trains ``--epochs`` epochs; rank 0 reports each epoch's wall time, the first epoch
left out (start-up: the first all-reduces, page faults). The table gives the median epoch of
every round, the ratio of medians to torch's, and the spread (lowest and highest per-round
median ratio, rounds paired by index). With ``--threads`` a second table gives, per rank, each
thread's wake-ups (voluntary context switches), involuntary switches and CPU ticks per 1000
steps over the timed epochs, from ``/proc``: the rank's own threads (Python's names, else the
kernel's: Gloo's ``gloo_tcp_loop`` and ``pt_gloo_runloop``, phalanx's ``phalanx-watchdog``) and
its launcher's (``launcher: NAME``).
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
from contextlib import nullcontext
from pathlib import Path

IMPLS = ("torch", "phalanx", "phalanx-nodiag", "phalanx-gloo")
# across namespaces phalanx's default is Gloo already (the shared-memory backend serves no
# group across hosts)
NETNS_IMPLS = ("torch", "phalanx", "phalanx-nodiag")
# The namespaces' names and /24 (phalanx.bench.netns), apart from the other benchmarks'
PREFIX, SUBNET = "phxtut", "10.216.0"
SRC = str(Path(__file__).resolve().parents[1] / "src")


def _threads() -> dict[tuple[str, int], tuple[str, int, int, int]]:
    """This process's threads and its launcher's (its parent: ``torchrun``'s agent or ``phalanx
    run``) now: ``{(process, thread id): (name, voluntary context switches, involuntary ones,
    CPU ticks)}`` from ``/proc/PID/task``. A voluntary switch is a wake-up: the thread slept (a
    wait, a poll, a timer) and was woken. The name is Python's for a Python thread of this
    process, else the kernel's (``gloo_tcp_loop``...); the launcher's are ``launcher: NAME``."""
    import threading

    named = {t.native_id: t.name for t in threading.enumerate()}
    seen = {}
    for process, prefix in ((str(os.getpid()), ""), (str(os.getppid()), "launcher: ")):
        for tid in os.listdir(f"/proc/{process}/task"):
            try:
                with open(f"/proc/{process}/task/{tid}/status") as f:
                    status = dict(line.split(":", 1) for line in f if ":" in line)
                with open(f"/proc/{process}/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after the name, which may hold spaces
            except FileNotFoundError:  # ended meanwhile
                continue
            name = prefix + (named.get(int(tid)) if not prefix and int(tid) in named else status["Name"].strip())
            seen[(process, int(tid))] = (name, int(status["voluntary_ctxt_switches"]),
                                         int(status["nonvoluntary_ctxt_switches"]), int(fields[11]) + int(fields[12]))
    return seen


def _thread_counts(before: dict, after: dict, steps: int) -> list[dict]:
    """Per thread alive at the end: wake-ups, involuntary switches and CPU ticks per 1000
    steps between ``before`` and ``after`` (:func:`_threads`); a thread started meanwhile counts
    from zero."""
    rows = []
    for tid, (name, vol, nonvol, ticks) in sorted(after.items()):
        _, vol0, nonvol0, ticks0 = before.get(tid, (name, 0, 0, 0))
        rows.append({"thread": name, "wakeups": (vol - vol0) * 1000 / steps,
                     "preempted": (nonvol - nonvol0) * 1000 / steps, "ticks": (ticks - ticks0) * 1000 / steps})
    return rows


def _worker(impl: str, epochs: int, batch_size: int, result: str) -> None:
    """One rank of the tutorial's training loop (``Trainer._run_epoch``), timing each epoch;
    each rank also counts its threads' wake-ups over the timed epochs (``{result}.threads{rank}``)."""
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
                                shared_memory=False if impl == "phalanx-gloo" else None)
    torch.manual_seed(0)  # the tutorial's MyTrainDataset(2048): random inputs and targets
    data = [(torch.rand(20), torch.rand(1)) for _ in range(2048)]
    model = DDP(torch.nn.Linear(20, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(data, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(data))
    times, threads = [], {}
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        if epoch == 1:  # the first epoch is start-up
            threads = _threads()
        start = time.perf_counter()
        for source, targets in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(source), targets)
            loss.backward()
            optimizer.step()
        times.append(time.perf_counter() - start)
    counts = _thread_counts(threads, _threads(), len(loader) * (epochs - 1))
    with open(f"{result}.threads{dist.get_rank()}", "w") as f:
        json.dump(counts, f)
    if dist.get_rank() == 0:
        with open(result, "w") as f:
            json.dump(times, f)
    # leave together: torch's Gloo teardown on a rank whose peer has already left may abort it
    # ("terminate called without an active exception"), as it did twice in a row in CI
    dist.barrier()
    dist.destroy_process_group()


def _launch(impl: str, args: argparse.Namespace, scratch: str,
            nodes: list | None = None) -> tuple[list[float], list[dict[str, list[float]]]]:
    """One launch of ``impl``: on this host (``nodes`` None), or as two nodes, one in each
    namespace of ``nodes``; returns rank 0's timed epochs and each rank's threads
    (:func:`_by_name`)."""
    result = os.path.join(scratch, f"{impl}.json")
    worker = [os.path.abspath(__file__), "--worker", impl, "--epochs", str(args.epochs),
              "--batch-size", str(args.batch_size), "--result", result]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # torchrun's default for several workers
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))
    for attempt in (1, 2):  # a launch that fails is retried once, and said (torchrun's two-node
        # exit barrier has failed after its workers were done: "Failed to recv", exit 1)
        for path in (result, *(f"{result}.threads{rank}" for rank in range(args.nproc))):
            if os.path.exists(path):
                os.remove(path)
        try:
            if nodes is None:
                command = [*_launcher(impl), "--standalone", "--nproc-per-node", str(args.nproc), *worker]
                subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
            else:
                _on_nodes(impl, nodes, worker, env)
            break
        except (RuntimeError, subprocess.CalledProcessError) as e:
            if attempt == 2:
                raise
            print(f"{impl}: launch failed ({e}); launching it again", file=sys.stderr)
    threads = []
    for rank in range(args.nproc):
        with open(f"{result}.threads{rank}") as f:
            threads.append(_by_name(json.load(f)))
    with open(result) as f:
        return json.load(f)[1:], threads  # the first epoch is start-up


def _by_name(rows: list[dict]) -> dict[str, list[float]]:
    """One rank's thread counts (:func:`_thread_counts`) summed per thread name (torch's
    Gloo names several threads alike): ``{name: [wake-ups, preempted, ticks] per 1000 steps}``."""
    named: dict[str, list[float]] = {}
    for row in rows:
        total = named.setdefault(row["thread"], [0.0, 0.0, 0.0])
        for i, key in enumerate(("wakeups", "preempted", "ticks")):
            total[i] += row[key]
    return named


def _thread_table(threads: dict[str, list[list[dict[str, list[float]]]]]) -> dict:
    """Print, per implementation and rank, each thread's median over the launches of its
    wake-ups (voluntary context switches), involuntary switches and CPU ticks (1/100 s) per
    1000 steps; return the figures."""
    print("\nThreads over the timed epochs, per 1000 steps (median of the launches; a wake-up is a "
          "voluntary context switch: the thread slept and was woken)\n")
    print("| implementation | rank | thread | wake-ups | preempted | CPU ticks |")
    print("|---|---|---|---|---|---|")
    table: dict = {}
    for impl, launches in threads.items():
        for rank in range(len(launches[0])):
            names = sorted({name for launch in launches for name in launch[rank]})
            for name in names:
                figures = [statistics.median(launch[rank].get(name, [0.0] * 3)[i] for launch in launches)
                           for i in range(3)]
                table.setdefault(impl, {}).setdefault(rank, {})[name] = figures
                print(f"| {impl} | {rank} | {name} | {figures[0]:.1f} | {figures[1]:.1f} | {figures[2]:.1f} |")
    return table


def _launcher(impl: str) -> list[str]:
    bindir = os.path.dirname(sys.executable)
    return ([os.path.join(bindir, "torchrun")] if impl == "torch"
            else [sys.executable, "-m", "phalanx", "run"])


def _on_nodes(impl: str, nodes: list, worker: list[str], env: dict) -> None:
    """Node 0 and node 1 of a two-node job, one rank each, one per namespace (as on two hosts)."""
    from phalanx.bench.nodes import run_nodes

    codes = run_nodes(nodes, _launcher(impl), worker, stdout=subprocess.DEVNULL, environ=env)
    if any(codes):
        raise RuntimeError(f"{impl} across the namespaces failed: exit statuses {codes} "
                           "(the launchers' output is above)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="processes (default 2)")
    p.add_argument("--rounds", type=int, default=5, help="launches per implementation (default 5)")
    p.add_argument("--epochs", type=int, default=3, help="epochs per launch, the first untimed (default 3)")
    p.add_argument("--batch-size", type=int, default=1, help="the tutorial's --batch_size (default 1)")
    p.add_argument("--netns", action="store_true",
                   help="the two ranks as two nodes, one in each of two network namespaces (needs root)")
    p.add_argument("--rate", help="with --netns: tc's rate limit on each end of the link (e.g. 1gbit)")
    p.add_argument("--threads", action="store_true",
                   help="also print each rank's threads: wake-ups and CPU ticks per 1000 steps")
    p.add_argument("--json", help="also write the table's rows to this file")
    p.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.epochs < 2:
        p.error(f"--epochs should be at least 2 (the first is not timed), got {args.epochs}")
    if args.netns and args.nproc != 2:
        p.error(f"--netns runs 2 processes, one per namespace: --nproc should be 2, got {args.nproc}")
    if args.rate and not args.netns:
        p.error("--rate limits the link between the namespaces: it needs --netns")
    if args.worker:
        _worker(args.worker, args.epochs, args.batch_size, args.result)
        return
    impls = NETNS_IMPLS if args.netns else IMPLS
    medians: dict[str, list[float]] = {impl: [] for impl in impls}
    threads: dict[str, list] = {impl: [] for impl in impls}
    scratch = tempfile.mkdtemp(prefix="phalanx-bench-tutorial-")
    if args.netns:
        sys.path.insert(0, SRC)
        from phalanx.bench.netns import veth_namespaces
        from phalanx.bench.nodes import raise_on_signals

        if os.geteuid() != 0:
            p.error("--netns needs root (ip netns, tc)")
        raise_on_signals()  # the namespaces go on SIGTERM and SIGHUP too
        links = veth_namespaces(PREFIX, SUBNET, args.rate)
    else:
        links = nullcontext(None)
    try:
        with links as nodes:
            for r in range(args.rounds):
                order = impls[r % len(impls):] + impls[:r % len(impls)]
                for impl in order:
                    epochs, counts = _launch(impl, args, scratch, nodes)
                    medians[impl].append(statistics.median(epochs))
                    threads[impl].append(counts)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    steps = 2048 // args.nproc // args.batch_size
    where = ("two network namespaces (a veth pair" + (f", {args.rate} each way), everyone on Gloo"
                                                      if args.rate else "), everyone on Gloo")
             if args.netns else "one host (torch on Gloo, phalanx's default: shared memory)")
    print(f"\nDDP tutorial, {args.nproc} processes, {where}, batch {args.batch_size} ({steps} "
          f"steps per epoch), {args.rounds} launches x {args.epochs - 1} timed epochs each\n")
    print("| implementation | epoch s (median) | per-launch medians | /torch | spread |")
    print("|---|---|---|---|---|")
    base, rows = medians["torch"], {}
    for impl in impls:
        ratios = [a / b for a, b in zip(medians[impl], base)]
        rows[impl] = {"epoch_s": statistics.median(medians[impl]), "per_launch": medians[impl],
                      "ratio": statistics.median(medians[impl]) / statistics.median(base),
                      "spread": [min(ratios), max(ratios)]}
        print(f"| {impl} | {rows[impl]['epoch_s']:.2f} | {', '.join(f'{m:.2f}' for m in medians[impl])} "
              f"| {rows[impl]['ratio']:.3f} | {min(ratios):.3f}-{max(ratios):.3f} |")
    table = _thread_table(threads) if args.threads else None
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": rows, "threads": table}, f, indent=2)


if __name__ == "__main__":
    main()
