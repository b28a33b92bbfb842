"""``phalanx.fully_shard`` against torch's ``fully_shard``, side by side, with torch's and phalanx's
DDP as the replicated reference: step time, bytes sent and state held per rank.

Usage::

    python benchmarks/bench_fsdp.py                         # 2 processes, GPT 8 x 128
    python benchmarks/bench_fsdp.py --gloo                  # everything on Gloo
    python benchmarks/bench_fsdp.py --world-size 3 --steps 30 --json fsdp.json
    python benchmarks/bench_fsdp.py --rate 1gbit            # 2 ranks over a 1 Gbit/s link (root)

Each rank builds the GPT of ``phalanx bench --model gpt`` (``--depth`` blocks of width
``--dim``) four times from the same seed: sharded by ``phalanx.fully_shard`` and by torch's
``torch.distributed.fsdp.fully_shard`` (each block a unit, then the root; torch's defaults:
every unit but the root resharded after its forward), and wrapped whole by torch's DDP and by
phalanx's. Each trains with AdamW; after ``--warmup`` untimed steps the four take turns step by
step (A B C D, D C B A, ...) for ``--steps`` timed steps (``zero_grad``, forward, cross-entropy, backward,
``step``). Each side runs as its users run it: phalanx at its defaults (on one host its
shared-memory backend), torch's variants on Gloo (a group of their own); ``--gloo`` puts
phalanx on Gloo too. A step's time is the slowest rank's. Bytes sent are what the process wrote during
the step (``/proc/self/io``'s ``wchar``: its sockets, so its collectives; over shared memory
nothing goes through a socket, so phalanx's show as "-"), in units of the
model's parameter bytes; state held is the bytes of this rank's parameters, gradients and
optimizer state (a DTensor's local shard). The table shows medians and the paired ratios'
median and quartiles.

``--rate RATE`` runs the two ranks (world size 2) in two network namespaces joined by a veth
pair whose ends ``tc`` limits to ``RATE`` each way, started by ``phalanx run --nnodes 2`` as on
two machines (``benchmarks/bench_slow_link.py``'s link; needs root). Peak memory and a
per-rank memory limit: ``benchmarks/bench_fsdp_memory.py``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch
import torch.distributed as dist

from phalanx.bench.engine import GPT, make_batch
from phalanx.bench.fsdp import build, held_bytes, parameter_bytes, sent_bytes
from phalanx.bench.nodes import NodesFailed, launch_on_namespaces, raise_on_signals
from phalanx.bench.ranks import (RESULT_FLAG, add_gloo_option, launch_ranks, run_script, slowest,
                                 torch_group, transport)

VARIANTS = ("phalanx fully_shard", "torch fully_shard", "torch DDP", "phalanx DDP")
RATIOS = {"phalanx / torch fully_shard step": ("phalanx fully_shard", "torch fully_shard"),
          "phalanx fully_shard / phalanx DDP step": ("phalanx fully_shard", "phalanx DDP")}
# The two namespaces' names and addresses of --rate (bench_slow_link.py's are phxlink, 10.214.0).
PREFIX, SUBNET = "phxfsdp", "10.215.0"


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", "--world_size", type=int, default=2)
    p.add_argument("--depth", type=int, default=8, help="transformer blocks (default 8)")
    p.add_argument("--dim", type=int, default=128, help="their width (default 128)")
    p.add_argument("--batch", type=int, default=8, help="sequences of 32 tokens per rank (default 8)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps each (default 3)")
    p.add_argument("--steps", type=int, default=20, help="timed steps each (default 20)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--rate", help="two ranks in two network namespaces, their link limited to this "
                                  "tc rate each way (e.g. 1gbit; needs root); default: loopback")
    add_gloo_option(p.add_argument)
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument(RESULT_FLAG, dest="rank_result", help="(set by the script for its ranks)")
    args = p.parse_args(argv)
    if args.rate and args.world_size != 2:
        p.error(f"--rate runs one rank in each of two namespaces: --world-size must be 2, got {args.world_size}")
    return args


def _step(model, opt, batch) -> tuple[float, int]:
    x, y = batch
    sent, start = sent_bytes(), time.perf_counter()
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    return time.perf_counter() - start, sent_bytes() - sent


def _rank(args: argparse.Namespace) -> dict:
    batch = make_batch("gpt", args.batch, seed=1 + dist.get_rank())
    make = partial(GPT, dim=args.dim, depth=args.depth)
    built = {}
    for v in VARIANTS:
        model = build(v, make, torch_group=torch_group())
        built[v] = model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    param_bytes = parameter_bytes(make)
    for model, opt in built.values():
        for _ in range(args.warmup):
            _step(model, opt, batch)
    out = {v: {"s": [], "sent": []} for v in VARIANTS}
    for i in range(args.steps):
        for v in VARIANTS if i % 2 == 0 else reversed(VARIANTS):
            seconds, sent = _step(*built[v], batch)
            out[v]["s"].append(slowest(seconds))
            out[v]["sent"].append(sent / param_bytes)
    for v, (model, opt) in built.items():
        out[v]["held"] = held_bytes(model, opt) / param_bytes
    return {"param_bytes": param_bytes, "variants": out, "transport": transport()}


def _report(args: argparse.Namespace, result: dict) -> dict:
    out = result["variants"]
    link = f"Gloo over two namespaces, {args.rate} each way" if args.rate else result["transport"]
    shm = result["transport"] != "Gloo"
    print(f"world size {args.world_size}, {link}, GPT {args.depth} blocks of width {args.dim} "
          f"({result['param_bytes'] / 2**20:.1f} MiB of fp32 parameters), {args.batch} sequences per "
          f"rank, AdamW, {args.steps} timed steps each; bytes in parameter bytes, on rank 0")
    print(f"{'variant':<22}{'step ms (median)':>18}{'sent per step':>15}{'held per rank':>15}")
    rows = {}
    for v in VARIANTS:
        ms = statistics.median(out[v]["s"]) * 1e3
        sent = statistics.median(out[v]["sent"])
        on_shm = shm and v.startswith("phalanx")
        rows[v] = {"step_ms_median": ms, "sent_per_step": None if on_shm else sent, "held_per_rank": out[v]["held"]}
        print(f"{v:<22}{ms:>18.1f}{'-' if on_shm else f'{sent:.2f}':>15}{out[v]['held']:>15.2f}")
    print()
    for name, (a, b) in RATIOS.items():
        q1, q2, q3 = statistics.quantiles([x / y for x, y in zip(out[a]["s"], out[b]["s"])], n=4)
        rows[name] = {"median": q2, "q1": q1, "q3": q3}
        print(f"{a} / {b}, paired step ratio: median {q2:.3f} (25%: {q1:.3f}, 75%: {q3:.3f})")
    return rows


def _launch(args: argparse.Namespace, argv: list[str]) -> dict:
    if not args.rate:
        return launch_ranks(__file__, args.world_size, argv)
    raise_on_signals()  # the namespaces go on SIGTERM too
    try:
        return launch_on_namespaces(__file__, argv, args.rate, PREFIX, SUBNET)
    except NodesFailed as e:
        raise SystemExit(f"bench_fsdp: {e}") from None


def main(argv=None) -> None:
    run_script(__file__, argv, _parse, _rank, _report, launch=_launch)


if __name__ == "__main__":
    main()
