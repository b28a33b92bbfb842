"""Memory per rank: ``phalanx.fully_shard`` against torch's ``fully_shard`` and the two DDPs, and
a model that does not fit a per-rank memory limit under DDP but trains under ``fully_shard``.

Usage::

    python benchmarks/bench_fsdp_memory.py                      # world 2 and 4, GPT 8 x 512
    python benchmarks/bench_fsdp_memory.py --world-size 2 --json memory.json
    python benchmarks/bench_fsdp_memory.py --limit-mib 400      # the limit: DDP fails, fully_shard trains

Every variant runs in processes of its own (one ``phalanx run``-style launch each, so no
variant's peak is another's): each rank joins the group (torch, Gloo), then resets its peak
resident memory (``/proc/self/status``'s ``VmHWM``, reset through ``/proc/self/clear_refs``)
and builds the GPT of ``phalanx bench --model gpt`` (``--depth`` blocks of width ``--dim``):
the sharded variants on the meta device, each block a unit, then the root, initialised per
shard (``phalanx.fsdp.initialize``; torch's: ``reset_parameters`` on its DTensors), so no rank
ever holds the whole model; the DDPs whole, as they must be. Each trains ``--steps`` AdamW
steps on one fixed batch. The table shows, per variant and world size, the largest over the
ranks of the peak resident memory above the rank's memory before the model (torch, Gloo, the
group: shown as "before") and of the bytes of parameters, gradients and optimizer state the
rank holds at the end (a DTensor's local shard), also in units of the model's parameter bytes.

``--limit-mib M`` runs ``--limit-variants`` (torch's DDP and phalanx's ``fully_shard`` by
default) at ``--world-size`` (one value) with every rank allowed ``M`` MiB of private memory
above its memory before the model (``RLIMIT_DATA``: an allocation past it fails in the rank
with torch's "DefaultCPUAllocator: can't allocate memory"). It reports, per variant, either
the losses of its steps or where each rank ran out of memory; the launcher stops the ranks
of a variant that failed (none is left behind). Exit status 0 when every DDP listed ran out of
memory and every sharded variant trained, its loss going down: the demonstration held.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from phalanx.bench.engine import GPT, make_batch
from phalanx.bench.fsdp import (
    REPLICATED,
    VARIANTS,
    Memory,
    build,
    held_bytes,
    limit_data,
    out_of_memory,
    parameter_bytes,
)
from phalanx.bench.ranks import RESULT_FLAG, RanksFailed, launch_ranks, serve

MIB = 2**20


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", "--world_size", type=int, nargs="+", default=[2, 4])
    p.add_argument("--depth", type=int, default=8, help="transformer blocks (default 8)")
    p.add_argument("--dim", type=int, default=512, help="their width (default 512: 25.6M parameters)")
    p.add_argument("--batch", type=int, default=4, help="sequences of 32 tokens per rank (default 4)")
    p.add_argument("--steps", type=int, default=3, help="AdamW steps (default 3)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--limit-mib", type=float, help="run --limit-variants under this per-rank limit")
    p.add_argument("--limit-variants", nargs="+", choices=VARIANTS, default=["torch DDP", "phalanx fully_shard"])
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # a worker's
    p.add_argument("--oom-dir", help=argparse.SUPPRESS)  # where a worker out of memory says so
    p.add_argument(RESULT_FLAG, dest="rank_result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.limit_mib is not None and len(args.world_size) != 1:
        p.error(f"--limit-mib runs at one world size: give --world-size one value, got {args.world_size}")
    return args


# ---------------------------------------------------------------------------- on each rank ----
def _train(model, x, y, steps: int, losses: list[float]):
    """``steps`` AdamW steps on the batch ``(x, y)``, each step's loss appended to ``losses``
    as it ends; the optimizer."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return opt


def _rank(args: argparse.Namespace) -> dict:
    rank = dist.get_rank()
    x, y = make_batch("gpt", args.batch, seed=1 + rank)
    _train(build(args.variant, partial(GPT, dim=8, depth=1), meta=True), x, y, 1, [])
    gc.collect()  # the modules it imported and what it initialised once stay: not the model's
    memory = Memory()
    memory.reset_peak()
    if args.limit_mib is not None:
        limit_data(int(args.limit_mib * MIB))
    phase, losses = "building the model", []
    try:
        model = build(args.variant, partial(GPT, dim=args.dim, depth=args.depth), meta=True)
        phase = "training"
        opt = _train(model, x, y, args.steps, losses)
    except (RuntimeError, MemoryError) as e:
        if phase == "training":
            phase = f"step {len(losses) + 1}"
        if args.oom_dir and out_of_memory(e):
            Path(args.oom_dir, f"rank{rank}.txt").write_text(f"{phase}: {str(e).splitlines()[0]}")
        raise
    mine = torch.tensor([memory.peak() - memory.start, memory.start, held_bytes(model, opt)], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    mean_losses = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(mean_losses)
    return {"peak": [t[0].item() for t in every], "before": [t[1].item() for t in every],
            "held": [t[2].item() for t in every], "loss": (mean_losses / dist.get_world_size()).tolist()}


# --------------------------------------------------------------------------- orchestration ----
def _param_bytes(args: argparse.Namespace) -> int:
    return parameter_bytes(partial(GPT, dim=args.dim, depth=args.depth))


def _launch(argv: list[str], variant: str, world: int, oom_dir: str | None = None) -> dict:
    """One variant at one world size, in processes of its own; rank 0's result (the
    ``--world-size`` added last is the one argparse keeps)."""
    extra = ["--variant", variant, "--world-size", str(world)] + (["--oom-dir", oom_dir] if oom_dir else [])
    return launch_ranks(__file__, world, [*argv, *extra])


def memory_table(args: argparse.Namespace, argv: list[str]) -> list[dict]:
    psi = _param_bytes(args)
    print(f"GPT {args.depth} blocks of width {args.dim}: {psi / MIB:.1f} MiB of fp32 parameters (Ψ); "
          f"AdamW, {args.steps} steps of {args.batch} sequences per rank; MiB, the largest over the ranks")
    print(f"{'variant':<22}{'world':>6}{'peak above before':>19}{'before':>9}{'held':>9}{'held / Ψ':>10}")
    rows = []
    for world in args.world_size:
        for variant in args.variants:
            r = _launch(argv, variant, world)
            row = {"variant": variant, "world_size": world, "peak_mib": max(r["peak"]) / MIB,
                   "before_mib": max(r["before"]) / MIB, "held_mib": max(r["held"]) / MIB,
                   "held_per_param_bytes": max(r["held"]) / psi, "loss": r["loss"]}
            rows.append(row)
            print(f"{variant:<22}{world:>6}{row['peak_mib']:>19.1f}{row['before_mib']:>9.1f}"
                  f"{row['held_mib']:>9.1f}{row['held_per_param_bytes']:>10.2f}", flush=True)
    return rows


def limit_demo(args: argparse.Namespace, argv: list[str]) -> list[dict]:
    world, psi = args.world_size[0], _param_bytes(args)
    print(f"GPT {args.depth} blocks of width {args.dim}: Ψ = {psi / MIB:.1f} MiB of fp32 parameters; "
          f"world {world}; each rank may allocate {args.limit_mib:g} MiB above its memory before the model "
          f"(DDP holds 4Ψ = {4 * psi / MIB:.0f} MiB of state per rank, fully_shard 4Ψ/{world} = "
          f"{4 * psi / world / MIB:.0f} MiB plus a unit)", flush=True)
    rows = []
    for variant in args.limit_variants:
        with tempfile.TemporaryDirectory(prefix="phalanx-oom-") as oom_dir:
            try:
                r = _launch(argv, variant, world, oom_dir)
                row = {"variant": variant, "trained": True, "loss": r["loss"], "peak_mib": max(r["peak"]) / MIB}
            except RanksFailed as e:
                said = {int(p.stem.removeprefix("rank")): p.read_text()  # by the ranks out of memory
                        for p in Path(oom_dir).glob("rank*.txt")}
                row = {"variant": variant, "trained": False, "exit_status": e.status,
                       "out_of_memory": {str(rank): said[rank] for rank in sorted(said)}}
        rows.append(row)
        print(f"\n{variant}: " + _verdict(row), flush=True)
    return rows


def _verdict(row: dict) -> str:
    if row["trained"]:
        losses = ", ".join(f"{v:.4f}" for v in row["loss"])
        return f"trained; loss per step {losses}; peak {row['peak_mib']:.1f} MiB above before"
    if not row["out_of_memory"]:
        return f"FAILED (exit status {row['exit_status']}), not out of memory: see the traceback above"
    ranks = "\n".join(f"  rank {rank}: {what}" for rank, what in row["out_of_memory"].items())
    return f"out of memory (exit status {row['exit_status']}; every rank has ended):\n{ranks}"


def _verdict_of_the_limit(rows: list[dict]) -> tuple[bool, str]:
    """Whether every DDP ran out of memory and every sharded variant trained with its loss
    going down; and what each did."""
    held, said = True, []
    for r in rows:
        if r["variant"] in REPLICATED:
            oom = not r["trained"] and bool(r["out_of_memory"])
            held, did = held and oom, f"{'ran' if oom else 'did not run'} out of memory"
        else:
            fine = r["trained"] and r["loss"][-1] < r["loss"][0]
            held = held and fine
            did = "did not train" if not r["trained"] else "trained" + ("" if fine else ", its loss not going down")
        said.append(f"{r['variant']} {did}")
    return held, "; ".join(said)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parse(argv)
    if args.rank_result:  # one of the ranks
        serve(_rank, args.rank_result, args, threads=args.threads)
        return 0
    # glibc's default first mmap threshold (128 KiB, mallopt(3)), pinned for the ranks: every
    # tensor above it is a mapping of its own, given back to the system when freed. Left
    # dynamic, glibc raises it to the largest block freed (up to 32 MiB) and keeps freed
    # tensors in its heap, still resident: the peak would count memory no tensor holds.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    rows = limit_demo(args, argv) if args.limit_mib is not None else memory_table(args, argv)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": rows}, f, indent=2)
    if args.limit_mib is None:
        return 0
    held, why = _verdict_of_the_limit(rows)
    print(f"\nthe limit {'held' if held else 'did NOT hold'}: {why}")
    return 0 if held else 1


if __name__ == "__main__":
    raise SystemExit(main())
