"""The ``phalanx`` command: ``phalanx run`` (below) and ``phalanx bench`` (``phalanx bench -h``).

``phalanx run`` starts a training script on several processes, like ``torchrun``::

    phalanx run [options] script.py [script args...]
    phalanx run [options] -m package.module [module args...]
    python -m phalanx run ...                      # the same

**One node.** ``phalanx run --standalone --nproc-per-node 4 train.py`` (a free port on
loopback), or ``--master-port P`` to choose the port.

**Several nodes.** On every node, with the same options except ``--node-rank``::

    phalanx run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 \\
                --nproc-per-node 8 train.py                     # on 10.0.0.1
    phalanx run --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 \\
                --nproc-per-node 8 train.py                     # on the other node

Node 0's launcher hosts the rendezvous store (torch's ``TCPStore``) at the master address and
port, listening on that interface only. The other nodes wait for it up to ``--rdzv-timeout``
seconds, then fail naming the address, the port and the timeout. The launchers agree on the
world size and on each node's first rank; nodes may run different numbers of workers.

Every option also has torchrun's underscored spelling (``--nproc_per_node``...).

**Definitions.** A *node* is one machine (one launcher); a *worker* is one process running
the script; a *round* is one attempt of the whole group, so restart *k* is round *k*.

**Worker environment** (the names torchrun uses, so scripts move freely between the two):
``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (node rank),
``GROUP_WORLD_SIZE`` (nodes), ``ROLE_RANK``, ``ROLE_WORLD_SIZE``, ``ROLE_NAME``,
``MASTER_ADDR``/``MASTER_PORT`` (the workers' store, hosted by node 0's launcher, fresh every
round: ``TORCHELASTIC_USE_AGENT_STORE=True``), ``TORCHELASTIC_RESTART_COUNT`` (the round),
``TORCHELASTIC_MAX_RESTARTS``, ``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_ERROR_FILE``,
``TORCHELASTIC_SIGNALS_TO_HANDLE``, ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``. When unset:
``OMP_NUM_THREADS`` = usable cores / local workers (at least 1; torchrun sets 1) and
``PYTHONUNBUFFERED=1`` (output reaches the console as it is printed).

**Output.** Every line a worker prints appears prefixed ``[rankN]: ``; progress bars redrawn
with ``\\r`` stay on one line. ``--log-dir D`` also writes ``D/attempt_K/rankN.stdout.log`` and
``.stderr.log``; then ``--tee S`` chooses the streams still shown on the console (0 none,
1 stdout, 2 stderr, 3 both, or per local rank ``0:3,1:0``) and ``--redirects S`` the ones
kept off it.

**Failures.** When a worker exits non-zero or dies of a signal, on any node, the workers of
every node get SIGTERM, then SIGKILL after ``--shutdown-timeout`` seconds, and the group is
started again, up to ``--max-restarts`` times. After the last attempt the launcher prints the
node, rank, exit code or signal of the first worker seen to fail, and the traceback that ended
it, cut at its exception line (from its stderr: no decorator needed; a torch elastic
``@record`` error file is preferred when the script wrote one), and exits with that worker's
status (128 + N for signal N). A worker exiting with 75 (``phalanx.errors.PREEMPTED_EXIT_CODE``)
was preempted after saving its checkpoint: not a failure, no restart; the launcher exits 75.

**Signals.** SIGINT, SIGTERM, SIGHUP and SIGQUIT sent to the launcher are forwarded to every
worker's main process (as torchrun does: its DataLoader workers and other children are left to
it); after ``--shutdown-timeout`` the rest are killed, with every process they started, and the
launcher exits 75 if the workers reported preemption, else 128 + N. SIGUSR1 and SIGUSR2 are
only forwarded. No worker outlives its launcher, even one killed with SIGKILL: workers get a
parent-death signal, and a small guardian process kills each worker's whole process tree when
the launcher is gone.

**Exit status.** 0 success; a worker's status; 75 preempted; 128 + N after signal N;
1 the nodes could not meet; 2 bad input (unknown option, missing script or module,
``--nproc-per-node 0``, ``--node-rank`` >= ``--nnodes``, master port in use).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

from .errors import LaunchConfigError, RendezvousError
from .launcher import LaunchConfig, StreamChoice, launch, resolve_nproc
from .launcher.config import (
    DEFAULT_MASTER_ADDR,
    DEFAULT_MASTER_PORT,
    DEFAULT_MONITOR_INTERVAL,
    DEFAULT_RDZV_TIMEOUT,
    DEFAULT_SHUTDOWN_TIMEOUT,
)


def _add_run(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "run", help="start a script on several processes (torchrun-compatible)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add = parser.add_argument
    add("--nproc-per-node", "--nproc_per_node", default="1", metavar="N|auto|cpu|gpu",
        help="workers on this node (default 1)")
    add("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    add("--node-rank", "--node_rank", type=int, default=0, help="this node's rank (default 0)")
    add("--master-addr", "--master_addr", default=None,
        help=f"node 0's address (default {DEFAULT_MASTER_ADDR})")
    add("--master-port", "--master_port", type=int, default=None,
        help=f"node 0's rendezvous port (default {DEFAULT_MASTER_PORT})")
    add("--standalone", action="store_true", help="one node on loopback, on a free port")
    add("--max-restarts", "--max_restarts", type=int, default=0,
        help="restarts of the whole group after a failure (default 0)")
    add("--monitor-interval", "--monitor_interval", type=float,
        default=DEFAULT_MONITOR_INTERVAL, help="seconds between health checks (default %(default)s)")
    add("--shutdown-timeout", "--shutdown_timeout", type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT, help="seconds from SIGTERM to SIGKILL (default %(default)s)")
    add("--rdzv-timeout", "--rdzv_timeout", type=float, default=DEFAULT_RDZV_TIMEOUT,
        help="seconds to wait for the master and the other nodes (default %(default)s)")
    add("--rdzv-id", "--rdzv_id", "--run-id", "--run_id", default="",
        help="the job's id, TORCHELASTIC_RUN_ID (default: drawn at random)")
    add("--log-dir", "--log_dir", default=None, help="write each worker's output to files here")
    add("-t", "--tee", default=None, help="with --log-dir: streams also shown on the console")
    add("-r", "--redirects", default=None, help="with --log-dir: streams kept off the console")
    add("-m", "--module", action="store_true", help="run the entry point as a module (python -m)")
    add("script", help="the training script (or module, with -m)")
    add("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    parser.set_defaults(handler=_run)


def _add_bench(commands: argparse._SubParsersAction) -> None:
    from .bench.options import add_comm_hook_option  # no torch

    parser = commands.add_parser(
        "bench", help="phalanx DDP vs torch DDP vs one process, side by side",
        description=_BENCH_DOC, formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add = parser.add_argument
    add("--model", nargs="+", default=["mlp"], choices=("cnn", "mlp"),
        help="mlp: 10.5M parameters; cnn: 0.29M with BatchNorm (default mlp)")
    add("--nproc", type=int, default=2, help="processes for the DDP runs (default 2)")
    add("--bucket-mb", "--bucket_mb", type=float, default=None,
        help="bucket cap in MiB for both DDPs (default: theirs, 25 MiB with a 1 MiB first bucket)")
    add_comm_hook_option(add)
    add("--steps", type=int, default=10, help="timed steps per repeat (default 10)")
    add("--repeats", type=int, default=3, help="fresh models per implementation (default 3)")
    add("--warmup", type=int, default=3, help="untimed steps per repeat (default 3)")
    add("--batch-size", "--batch_size", type=int, default=64, help="per process (default 64)")
    add("--threads", type=int, default=1, help="torch threads per process (default 1)")
    add("--out", default="runs/bench", help="bench.png and bench.json go here (default runs/bench)")
    add("--no-plot", action="store_true", help="skip the PNG chart (no matplotlib needed)")
    parser.set_defaults(handler=_bench)


_BENCH_DOC = """Benchmark phalanx's DDP against torch's DDP and a single process on one machine.

Runs ``python -m phalanx.bench`` with this launcher twice: alone (the bare model and phalanx
DDP at world size 1), then on --nproc processes (phalanx DDP and torch DDP, taking turns step
by step on fresh models from the same seed, same data and buckets, Gloo). Prints a table of
median step time, samples/s, scaling efficiency against the single process, exposed
communication (step time minus the step time under no_sync) and the phalanx/torch ratio,
and writes bench.png and bench.json under --out.
"""


# Subcommands: each adds its parser and sets `handler(namespace) -> exit status`.
COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (_add_run, _add_bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="phalanx", description="phalanx: data-parallel training for PyTorch",
        allow_abbrev=False,
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    for add_command in COMMANDS:
        add_command(commands)
    return parser


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
    """``phalanx run``'s parsed options -> a validated :class:`LaunchConfig`."""
    if args.standalone and (args.master_addr is not None or args.master_port is not None):
        raise LaunchConfigError(
            "--standalone picks a free port on loopback itself; drop --master-addr/--master-port"
        )
    if args.tee is not None and args.redirects is not None:
        raise LaunchConfigError("give --tee (streams shown) or --redirects (streams hidden), not both")
    console = StreamChoice()
    if args.tee is not None:
        console = StreamChoice.parse(args.tee, "--tee")
    elif args.redirects is not None:
        console = StreamChoice.parse(args.redirects, "--redirects").inverted()
    return LaunchConfig(
        entrypoint=args.script,
        args=tuple(args.script_args),
        module=args.module,
        nproc_per_node=resolve_nproc(args.nproc_per_node),
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr or DEFAULT_MASTER_ADDR,
        master_port=DEFAULT_MASTER_PORT if args.master_port is None else args.master_port,
        standalone=args.standalone,
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        shutdown_timeout=args.shutdown_timeout,
        rdzv_timeout=args.rdzv_timeout,
        run_id=args.rdzv_id,
        log_dir=args.log_dir,
        console=console,
    )


def _run(args: argparse.Namespace) -> int:
    try:
        return launch(config_from_args(args))
    except LaunchConfigError as e:
        print(f"phalanx run: error: {e}", file=sys.stderr)
        return 2
    except RendezvousError as e:
        print(f"phalanx run: error: {e}", file=sys.stderr)
        return 1


def _bench(args: argparse.Namespace) -> int:
    # no torch here: the timing runs in the launched processes
    from .bench import report as bench_report
    from .bench.ranks import RanksFailed, launch_ranks

    if args.nproc < 1:
        print(f"phalanx bench: error: --nproc must be at least 1, got {args.nproc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = ["--models", *args.model, "--repeats", str(args.repeats), "--steps", str(args.steps),
              "--warmup", str(args.warmup), "--batch-size", str(args.batch_size),
              "--threads", str(args.threads)]
    if args.bucket_mb is not None:
        common += ["--bucket-cap-mb", str(args.bucket_mb)]
    common += ["--comm-hook", args.comm_hook]
    results = {}
    for name, nproc, impls in (("alone", 1, ("bare", "phalanx")), ("ddp", args.nproc, ("phalanx", "torch"))):
        print(f"phalanx bench: {'/'.join(impls)} on {nproc} process(es)...", file=sys.stderr, flush=True)
        try:
            results[name] = launch_ranks("phalanx.bench", nproc, (*common, "--impls", *impls), module=True)
        except RanksFailed as e:
            print(f"phalanx bench: the {name} run failed (exit status {e.status})", file=sys.stderr)
            return e.status
    rows = bench_report.ddp_rows(results["alone"], results["ddp"])
    settings = {k: v for k, v in vars(args).items() if k != "handler"}
    (out / "bench.json").write_text(json.dumps({"rows": rows, "settings": settings}, indent=2))
    print(f"\n{args.nproc} processes, Gloo, {args.threads} thread(s) and batch {args.batch_size} "
          f"per process, bucket cap {args.bucket_mb or 'default'}, comm hook {args.comm_hook}\n")
    print(bench_report.format_table(rows))
    if not args.no_plot:
        print(f"\nchart: {bench_report.plot(rows, out / 'bench.png')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``phalanx ...``; returns the exit status (argparse's 2 for bad options)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse has printed the usage and the error (or --help)
        return e.code if isinstance(e.code, int) else 2
    if not hasattr(args, "handler"):
        parser.print_help(sys.stderr)
        return 2
    return args.handler(args)
