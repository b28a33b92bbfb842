"""``phalanx.fully_shard`` against torch's ``fully_shard``, side by side, with torch's DDP as the
replicated reference: step time, bytes sent and state held per rank.

Usage::

    python benchmarks/bench_fsdp.py                         # 2 processes, Gloo, GPT 8 x 128
    python benchmarks/bench_fsdp.py --world-size 3 --steps 30 --json fsdp.json

Each rank builds the GPT of ``phalanx bench --model gpt`` (``--depth`` blocks of width
``--dim``) three times from the same seed: sharded by ``phalanx.fully_shard`` and by torch's
``torch.distributed.fsdp.fully_shard`` (each block a unit, then the root; torch's defaults:
every unit but the root resharded after its forward), and wrapped whole by torch's DDP. Each
trains with AdamW; after ``--warmup`` untimed steps the three take turns step by step (A B C,
C B A, ...) for ``--steps`` timed steps (``zero_grad``, forward, cross-entropy, backward,
``step``). A step's time is the slowest rank's. Bytes sent are what the process wrote during
the step (``/proc/self/io``'s ``wchar``: its sockets, so its collectives), in units of the
model's parameter bytes; state held is the bytes of this rank's parameters, gradients and
optimizer state (a DTensor's local shard). The table shows medians and the paired ratios'
median and quartiles.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import phalanx
from phalanx.bench.engine import GPT, make_batch
from phalanx.bench.ranks import RESULT_FLAG, run_script, slowest

VARIANTS = ("phalanx fully_shard", "torch fully_shard", "torch DDP")


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", "--world_size", type=int, default=2)
    p.add_argument("--depth", type=int, default=8, help="transformer blocks (default 8)")
    p.add_argument("--dim", type=int, default=128, help="their width (default 128)")
    p.add_argument("--batch", type=int, default=8, help="sequences of 32 tokens per rank (default 8)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps each (default 3)")
    p.add_argument("--steps", type=int, default=20, help="timed steps each (default 20)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument(RESULT_FLAG, dest="rank_result", help="(set by the script for its ranks)")
    return p.parse_args(argv)


def _build(variant: str, args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(dim=args.dim, depth=args.depth)
    if variant == "torch DDP":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        shard = phalanx.fully_shard if variant.startswith("phalanx") else torch_fully_shard
        for block in model.blocks:
            shard(block)
        shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if isinstance(t, DTensor) else t
            total += local.numel() * local.element_size()
    return total


def _held(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    params = list(model.parameters())
    state = [v for s in opt.state.values() for v in s.values()]
    return _local_bytes(params) + _local_bytes(p.grad for p in params) + _local_bytes(state)


def _written() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def _step(model, opt, batch) -> tuple[float, int]:
    x, y = batch
    sent, start = _written(), time.perf_counter()
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    return time.perf_counter() - start, _written() - sent



def _rank(args: argparse.Namespace) -> dict:
    batch = make_batch("gpt", args.batch, seed=1 + dist.get_rank())
    built = {v: _build(v, args) for v in VARIANTS}
    param_bytes = sum(p.numel() * p.element_size() for p in GPT(dim=args.dim, depth=args.depth).parameters())
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
        out[v]["held"] = _held(model, opt) / param_bytes
    return {"param_bytes": param_bytes, "variants": out}


def _report(args: argparse.Namespace, result: dict) -> dict:
    out = result["variants"]
    print(f"world size {args.world_size}, Gloo, GPT {args.depth} blocks of width {args.dim} "
          f"({result['param_bytes'] / 2**20:.1f} MiB of fp32 parameters), {args.batch} sequences per "
          f"rank, AdamW, {args.steps} timed steps each; bytes in parameter bytes, on rank 0")
    print(f"{'variant':<22}{'step ms (median)':>18}{'sent per step':>15}{'held per rank':>15}")
    rows = {}
    for v in VARIANTS:
        ms = statistics.median(out[v]["s"]) * 1e3
        sent = statistics.median(out[v]["sent"])
        rows[v] = {"step_ms_median": ms, "sent_per_step": sent, "held_per_rank": out[v]["held"]}
        print(f"{v:<22}{ms:>18.1f}{sent:>15.2f}{out[v]['held']:>15.2f}")
    ratios = [a / b for a, b in zip(out[VARIANTS[0]]["s"], out[VARIANTS[1]]["s"])]
    q1, q2, q3 = statistics.quantiles(ratios, n=4)
    rows["phalanx / torch fully_shard step"] = {"median": q2, "q1": q1, "q3": q3}
    print(f"\nphalanx / torch fully_shard, paired step ratio: median {q2:.3f} (25%: {q1:.3f}, 75%: {q3:.3f})")
    return rows


def main(argv=None) -> None:
    run_script(__file__, argv, _parse, _rank, _report)


if __name__ == "__main__":
    main()
