"""``phalanx bench``: phalanx's DDP against torch's DDP and a single process on one machine.

Runs ``python -m phalanx.bench`` with phalanx's launcher twice: alone (the bare model and
phalanx DDP at world size 1), then on ``--nproc-per-node`` processes (phalanx DDP and torch
DDP, taking turns step by step on fresh models from the same seed, same data and buckets,
Gloo). Prints a table of the median step time, the phalanx/torch step-time ratio (lower is
better), samples/s, scaling efficiency against the single process and exposed communication
(step time minus the step time under no_sync), warns when the machine was busy, notes what
the numbers cannot be trusted for (no warm-up, fewer than 3 timed steps, a negative exposed
communication), and writes bench.png and bench.json under ``--out``. Counts are checked
before anything runs (``--steps``, ``--repeats``, ``--batch-size``, ``--threads`` at least 1,
``--warmup`` at least 0). ``--comm-hook`` registers a compression hook on
both DDPs (phalanx's own on phalanx's, torch's of that name on torch's).

``--shared-memory`` puts the default group on phalanx's shared-memory backend
(``init_process_group(shared_memory=True)``): phalanx's DDP runs there, torch's DDP on a Gloo
group of its own as before, and a third implementation, torch's DDP over phalanx's backend
(``torch-shm``: what the transport alone gives), is timed beside them; its ratio column is
torch-shm over torch. Under the table, each model's DDP overhead over the single process.

``--fully-shard`` times the model sharded instead: phalanx's ``fully_shard`` against torch's
``fully_shard`` (each GPT block, or each layer of the other models, a unit, then the root;
their defaults), phalanx's also alone on one process beside the bare model, and adds the bytes
each step sent (in parameter bytes) to the table. Exposed communication is not measured there
(a sharded model has no ``no_sync()``); ``--bucket-mb`` and ``--comm-hook`` are DDP's and
refused with it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..bench.options import add_comm_hook_option, at_least, positive_float  # no torch
from .text import add_manual_parser


def add_bench(commands: argparse._SubParsersAction) -> None:
    parser = add_manual_parser(
        commands, "bench", "phalanx DDP vs torch DDP vs one process, side by side", __doc__)
    add = parser.add_argument
    add("--model", nargs="+", default=["mlp"], choices=("cnn", "deep-mlp", "gpt", "mlp"),
        help="mlp: 10.5M parameters in 8 tensors; cnn: 0.36M with BatchNorm; many small "
             "tensors: deep-mlp (200 layers of width 32, 402 tensors), gpt (24 blocks of width "
             "64, 293 tensors) (default mlp)")
    add("--nproc-per-node", "--nproc_per_node", "--nproc", type=at_least(1), default=2, metavar="N",
        help="processes for the DDP runs, as in phalanx run (default 2)")
    add("--bucket-mb", "--bucket_mb", type=positive_float, default=None,
        help="bucket cap in MiB for both DDPs (default: theirs, 25 MiB with a 1 MiB first bucket)")
    add_comm_hook_option(add)
    add("--steps", type=at_least(1), default=10, help="timed steps per repeat (default 10)")
    add("--repeats", type=at_least(1), default=3, help="fresh models per implementation (default 3)")
    add("--warmup", type=at_least(0), default=3, help="untimed steps per repeat (default 3)")
    add("--min-seconds", "--min_seconds", type=positive_float, default=None, metavar="S",
        help="time more than --steps steps where they would take less than S seconds per "
             "implementation and repeat (a step's time estimated from the warm-up steps: give "
             "--warmup 2 or more, the first pays one-time costs); default: --steps exactly")
    add("--batch-size", "--batch_size", type=at_least(1), default=64,
        help="per process (default 64)")
    add("--threads", type=at_least(1), default=1, help="torch threads per process (default 1)")
    add("--out", default="runs/bench", help="bench.png and bench.json go here (default runs/bench)")
    add("--no-plot", action="store_true", help="skip the PNG chart (no matplotlib needed)")
    add("--shared-memory", "--shared_memory", action=argparse.BooleanOptionalAction, default=False,
        help="the default group on phalanx's shared-memory backend: phalanx's DDP there, torch's "
             "DDP on Gloo, and torch's DDP over the backend as a third (default off)")
    add("--fully-shard", "--fully_shard", action="store_true",
        help="phalanx's fully_shard against torch's fully_shard (each block or layer a unit, then "
             "the root) instead of the DDPs, with the bytes sent per step")
    parser.set_defaults(handler=_bench)


def _bench(args: argparse.Namespace) -> int:
    # no torch here: the timing runs in the launched processes
    from ..bench import report as bench_report
    from ..bench.ranks import RanksFailed, launch_ranks
    from ..launcher.environment import usable_cpus

    nproc = args.nproc_per_node  # every count was checked by the parser (exit 2)
    if args.fully_shard and (args.bucket_mb is not None or args.comm_hook != "none"):
        print("phalanx bench: error: --bucket-mb and --comm-hook are DDP's: a sharded model has "
              f"neither buckets nor hooks (got --fully-shard with --bucket-mb {args.bucket_mb}, "
              f"--comm-hook {args.comm_hook})", file=sys.stderr)
        return 2
    if args.min_seconds is not None and args.warmup == 0:
        print(f"phalanx bench: error: --min-seconds {args.min_seconds:g} estimates a step's time "
              "from the warm-up steps, and --warmup 0 takes none: give --warmup 1 or more",
              file=sys.stderr)
        return 2
    if args.fully_shard and args.shared_memory:
        print("phalanx bench: error: --shared-memory compares the DDPs; --fully-shard runs both "
              "fully_shards on the default group, so they cannot be given together",
              file=sys.stderr)
        return 2
    sharded = args.fully_shard
    alone = ("bare", "phalanx-fsdp" if sharded else "phalanx")
    together = ("phalanx-fsdp", "torch-fsdp") if sharded else ("phalanx", "torch")
    if args.shared_memory:
        together += ("torch-shm",)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = ["--models", *args.model, "--repeats", str(args.repeats), "--steps", str(args.steps),
              "--warmup", str(args.warmup), "--batch-size", str(args.batch_size),
              "--threads", str(args.threads)]
    if args.min_seconds is not None:
        common += ["--min-seconds", str(args.min_seconds)]
    if args.bucket_mb is not None:
        common += ["--bucket-cap-mb", str(args.bucket_mb)]
    common += ["--comm-hook", args.comm_hook]
    if args.shared_memory:
        common += ["--shared-memory"]
    results = {}
    # the 1-minute load average at the end of each run (no sampling thread: the launcher
    # forks its guardian and workers, which wants a process without threads)
    loads = [os.getloadavg()[0]]
    for name, n, impls in (("alone", 1, alone), ("ddp", nproc, together)):
        print(f"phalanx bench: {'/'.join(impls)} on {n} process(es)...", file=sys.stderr, flush=True)
        try:
            results[name] = launch_ranks("phalanx.bench", n, (*common, "--impls", *impls), module=True)
        except RanksFailed as e:
            print(f"phalanx bench: the {name} run failed (exit status {e.status})", file=sys.stderr)
            return e.status
        loads.append(os.getloadavg()[0])
    rows = bench_report.ddp_rows(results["alone"], results["ddp"], sent=sharded)
    busy = bench_report.busy_warning(max(loads), usable_cpus())
    steps = bench_report.steps_per_repeat(results["ddp"], args.repeats)
    notes = bench_report.caveats(rows, steps=min(steps.values()), repeats=args.repeats, warmup=args.warmup)
    settings = {k: v for k, v in vars(args).items() if k != "handler"}
    (out / "bench.json").write_text(json.dumps(
        {"rows": rows, "settings": settings, "peak_load": max(loads), "notes": notes}, indent=2))
    how = ("fully_shard (each block or layer a unit, then the root)" if sharded else
           f"bucket cap {args.bucket_mb or 'default'}, comm hook {args.comm_hook}")
    transport = ("phalanx on shared memory, torch on Gloo" if args.shared_memory else "Gloo")
    print(f"\n{nproc} processes, {transport}, {args.threads} thread(s) and batch {args.batch_size} "
          f"per process, {how}\n")
    if args.min_seconds is not None:
        said = ", ".join(f"{model} {n}" for model, n in steps.items())
        print(f"timed steps per repeat (at least --steps {args.steps}, or --min-seconds "
              f"{args.min_seconds:g} s): {said}\n")
    print(bench_report.format_table(rows))
    print(f"\n{bench_report.LEGEND}")
    if args.shared_memory:
        print("torch DDP over phalanx_shm: its ratio is over torch DDP on Gloo.")
    for line in bench_report.overheads(rows):
        print(line)
    for note in notes:
        print(f"\nnote: {note}")
    if busy:
        print(f"\nwarning: {busy}")
    if not args.no_plot:
        print(f"\nchart: {bench_report.plot(rows, out / 'bench.png')}")
    return 0
