"""Per-step cost of DDP's own Python on torch's DDP tutorial at batch 1, as instructions:
phalanx against torch, stable on a loaded machine where wall times are not.

Usage::

    python benchmarks/bench_step_cost.py                          # torch, phalanx, phalanx-nodiag
    python benchmarks/bench_step_cost.py --steps 400 --impls phalanx

The tutorial's loop (``bench_tutorial.py``: ``nn.Linear(20, 1)``, SGD, batch 1) runs on two
ranks over Gloo, started here without a launcher (torch's environment variables). Rank 0 runs
under valgrind's callgrind with instrumentation off; after 50 warm-up steps it is switched on
(``callgrind_control -i on``) for ``--steps`` steps, then off. The table gives the
instructions rank 0's main thread executed per step (the training loop: data, forward,
backward, optimizer, and DDP's own work) and those of its other threads (Gloo's), each
implementation against torch's. Counts differ by about 0.1% between runs, load or not;
a wall-clock ratio on two busy cores varies by tens of percent (``bench_tutorial.py`` measures
time, on a quiet machine). Needs valgrind (``callgrind_control`` on the PATH).
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

IMPLS = ("torch", "phalanx", "phalanx-nodiag")
SRC = str(Path(__file__).resolve().parents[1] / "src")
WARM_UP = 50


def _worker(impl: str, steps: int, counted: bool) -> None:
    """One rank of the tutorial's loop; rank 0 (``counted``) switches callgrind on around it."""
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
        # Gloo, as torch's: this counts DDP's own Python, not the transport (phalanx's
        # default on one host, shared memory, runs its collectives on a thread of its own)
        dist.init_process_group(backend="gloo", diagnostics=impl != "phalanx-nodiag",
                                shared_memory=False)
    torch.manual_seed(0)
    data = [(torch.rand(20), torch.rand(1)) for _ in range(2048)]
    model = DDP(torch.nn.Linear(20, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(data, batch_size=1, shuffle=False, sampler=DistributedSampler(data))
    batches = iter(loader)

    def run(n: int) -> None:
        for _ in range(n):
            source, targets = next(batches)
            optimizer.zero_grad()
            F.cross_entropy(model(source), targets).backward()
            optimizer.step()

    run(WARM_UP)
    dist.barrier()
    if counted:
        subprocess.run(["callgrind_control", "-i", "on", str(os.getpid())], check=True, stdout=subprocess.DEVNULL)
    run(steps)
    if counted:
        subprocess.run(["callgrind_control", "-i", "off", str(os.getpid())], check=True, stdout=subprocess.DEVNULL)
    dist.barrier()
    dist.destroy_process_group()


def _measure(impl: str, steps: int, port: int, scratch: str) -> tuple[float, float]:
    """Instructions per step of rank 0's main thread and of its other threads."""
    out = os.path.join(scratch, f"{impl}.cg")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "PYTHONPATH": os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))}
    worker = [os.path.abspath(__file__), "--worker", impl, "--steps", str(steps)]
    peer = subprocess.Popen([sys.executable, *worker], env={**env, "RANK": "1", "LOCAL_RANK": "1"},
                            stdout=subprocess.DEVNULL)
    try:
        subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes",
                        f"--callgrind-out-file={out}.%p", sys.executable, *worker, "--counted"],
                       env={**env, "RANK": "0", "LOCAL_RANK": "0"}, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if peer.wait(timeout=120):
            raise RuntimeError(f"{impl}: rank 1 exited with {peer.returncode}")
    finally:
        if peer.poll() is None:
            peer.kill()
    totals = {}
    for path in glob.glob(f"{out}.*-*"):  # one file per thread: <pid>-01 is the main thread
        with open(path) as f:
            line = next((line for line in f if line.startswith("totals:")), "totals: 0")
        totals[path.rsplit("-", 1)[1]] = int(line.split()[1])
    if totals.get("01", 0) == 0:
        raise RuntimeError(f"{impl}: callgrind counted nothing on rank 0's main thread (files {sorted(totals)})")
    main = totals.pop("01")
    return main / steps, sum(totals.values()) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="counted steps (default 200)")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--port", type=int, default=29731, help="the ranks' rendezvous port")
    parser.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--counted", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.steps, args.counted)
        return
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        sys.exit("bench_step_cost needs valgrind and callgrind_control on the PATH")
    with tempfile.TemporaryDirectory() as scratch:
        counts = {impl: _measure(impl, args.steps, args.port + i, scratch) for i, impl in enumerate(args.impls)}
    print(f"\nDDP tutorial at batch 1, 2 processes, Gloo: instructions per step, rank 0, "
          f"{args.steps} steps after {WARM_UP}\n")
    print("| implementation | main thread | /torch | other threads |")
    print("|---|---|---|---|")
    base = counts.get("torch", (None,))[0]
    for impl, (main_ir, other_ir) in counts.items():
        ratio = f"{main_ir / base:.3f}" if base else "-"
        print(f"| {impl} | {main_ir / 1e3:,.0f}k | {ratio} | {other_ir / 1e3:,.0f}k |")


if __name__ == "__main__":
    main()
