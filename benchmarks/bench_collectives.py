"""CPU collectives on one host: phalanx's shared-memory backend against Gloo, side by side.

For each world size, one set of ranks times all_reduce, reduce_scatter, all_gather and
broadcast on both backends, alternating backends size by size so a change in load hurts
them alike, and reports the median over repeats (as seen by rank 0, after a barrier), the
bus bandwidth in GB/s and Gloo/shm ratios::

    python benchmarks/bench_collectives.py                           # 4 KB..256 MB, worlds 2, 3, 4
    python benchmarks/bench_collectives.py --worlds 2 --max-size 16MB --ops all_reduce

Sizes are nccl-tests': the bytes of all_reduce's and broadcast's tensor, of all_gather's
output and of reduce_scatter's input (float32). Goals (issue 35): shm at least 2x Gloo's
throughput from 1 MB up, at least 5x lower latency at 64 KB and below.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
# Time per (op, backend, size) aimed at, in seconds: repeats shrink as sizes grow.
_BUDGET_S = 0.3


def _size(text: str) -> int:
    units = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
    for unit, scale in units.items():
        if text.upper().endswith(unit):
            return int(float(text[:-2]) * scale)
    return int(text)


def _label(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def _call(op: str, world: int, numel: int, group: dist.ProcessGroup | None):
    if op == "all_reduce":
        t = torch.ones(numel)
        return lambda: dist.all_reduce(t, group=group)
    if op == "broadcast":
        t = torch.ones(numel)
        return lambda: dist.broadcast(t, 0, group=group)
    part = numel // world
    if op == "all_gather":
        out, inp = torch.empty(part * world), torch.ones(part)
        return lambda: dist.all_gather_into_tensor(out, inp, group=group)
    out, inp = torch.empty(part), torch.ones(part * world)
    return lambda: dist.reduce_scatter_tensor(out, inp, group=group)


def _time(fn, reps: int, group) -> float:
    fn()  # warm-up: first touch of buffers and pages
    times = []
    for _ in range(reps):
        dist.barrier(group=group)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    import phalanx.shm  # noqa: F401  (registers "phalanx_shm")

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    shm = dist.new_group(backend="phalanx_shm")
    rows = []
    for op in args.ops:
        size = args.min_size
        while size <= args.max_size:
            numel = max(world, size // 4 // world * world)
            est = None
            for name, group in (("gloo", None), ("shm", shm)):
                fn = _call(op, world, numel, group)
                reps = args.repeats or max(5, min(200, int(_BUDGET_S / max(est or 1e-4, 1e-5))))
                took = _time(fn, reps, group)
                if est is None:  # rank 0's estimate, so every rank repeats alike
                    agreed = torch.tensor([took], dtype=torch.float64)
                    dist.broadcast(agreed, 0)
                    est = agreed.item()
                rows.append((op, size, name, took))
                del fn
            size *= 4
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def _bus_factor(op: str, world: int) -> float:
    """nccl-tests' bus bandwidth factor: what each rank's link carries per byte of size."""
    return 2 * (world - 1) / world if op == "all_reduce" else (
        1.0 if op == "broadcast" else (world - 1) / world)


def _report(world: int, rows: list) -> None:
    print(f"\nworld {world}: median time per call (bus bandwidth), Gloo / shm")
    print(f"{'op':15} {'size':>7} {'gloo':>16} {'shm':>16} {'ratio':>7}")
    by = {(op, size, name): t for op, size, name, t in rows}
    for op, size, name, _ in rows:
        if name != "gloo":
            continue
        g, s = by[(op, size, "gloo")], by[(op, size, "shm")]
        fmt = lambda t: f"{t * 1e6:9.0f} us {size * _bus_factor(op, world) / t / 1e9:4.1f}"
        print(f"{op:15} {_label(size):>7} {fmt(g):>16} {fmt(s):>16} {g / s:6.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    parser.add_argument("--min-size", type=_size, default=_size("4KB"))
    parser.add_argument("--max-size", type=_size, default=_size("256MB"))
    parser.add_argument("--repeats", type=int, default=0,
                        help="calls timed per point (default: as many as ~0.3 s allows, 5..200)")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    for world in args.worlds:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        queue = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, world, port, args, queue)) for r in range(world)]
        [p.start() for p in procs]
        rows = queue.get()
        [p.join() for p in procs]
        _report(world, rows)
        print(flush=True)


if __name__ == "__main__":
    main()
