"""``phalanx run`` starts a training script on several processes, like ``torchrun``::

    phalanx run [options] script.py [script args...]
    phalanx run [options] -m package.module [module args...]
    phalanx run [options] --no-python program [args...]
    python -m phalanx run ...                      # the same

**One node.** ``phalanx run --standalone --nproc-per-node 4 train.py`` (a free port on
loopback), or ``--master-port P`` to choose the port.

**Several nodes.** On every node, with the same options except ``--node-rank``, and the
same job secret (``PHALANX_JOB_SECRET``, or ``--job-secret-file PATH``, a file of mode 0600)::

    export PHALANX_JOB_SECRET=...                               # the same on every node
    phalanx run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 \\
                --nproc-per-node 8 train.py                     # on 10.0.0.1
    phalanx run --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 \\
                --nproc-per-node 8 train.py                     # on the other node

Node 0's launcher hosts the rendezvous store (torch's ``TCPStore``) behind a gate at the
master address and port, listening on that interface only: a connection gets through only
once it has proved the job secret. The other nodes wait for it up to ``--rdzv-timeout``
seconds, then fail naming the address, the port and the timeout; a node with another secret
is refused (exit 2). Node 0 decides each round's nodes, world size and each node's first
rank; nodes may run different numbers of workers. Workers need no secret: each launcher lets
its own workers (and no other process) reach the store, at ``MASTER_ADDR=127.0.0.1`` and a
port of its own.

**Elastic** (``--nnodes MIN:MAX``): the job starts once MIN nodes have joined (the first round
waits ``--rdzv-conf last_call_timeout=S``, 3 s by default, for up to MAX); when a node is lost
(its launcher exits or is killed; a dead machine is noticed within ~11 s) or a new node joins
while fewer than MAX run, every worker is stopped (SIGTERM: a script with
``phalanx.PreemptionHandler`` checkpoints first) and the nodes meet again, at least MIN, and
start the workers at the new ``WORLD_SIZE``. A membership change uses no ``--max-restarts``.
Nodes may omit ``--node-rank``: they are numbered as they join, node 0 being the one that
can listen at the master address (torchrun's c10d host). A node beyond MAX waits for a place.
The script resumes from its last checkpoint (``phalanx.Checkpointer``; the sampler's global
cursor serves every remaining sample once at any world size; ``phalanx.accumulation_steps``
keeps the global batch).

**Replacing a node.** A launcher started again with the same command (and ``--node-rank``, or
none under elastic) takes the place of one that is gone, at the next round; with a fixed
``--nnodes N`` node 0 waits up to ``--rdzv-timeout`` for it. A launcher claiming the rank of a
node that still runs, or whose loss is not noticed yet, is refused. Node 0 may be lost too:
the store it hosts moves to a survivor (the last round's next node in order, at its own
address), which opens the next round with the nodes still there, more than half of the last
round's (a side cut off without that majority stops). A launcher started again to replace a
lost node is given the survivors' addresses with ``--rdzv-endpoint A:P,B:P,...`` and joins
where the store is now.

**End of the job.** When every worker of every node has exited 0, every launcher exits 0:
node 0's store stays up after its launcher has exited (at most 30 s) until each node has
learned it.

**torchrun's options.** Every option also has torchrun's underscored spelling
(``--nproc_per_node``...), and torchrun's other options are understood:
``--rdzv-backend static|c10d`` with ``--rdzv-endpoint HOST:PORT`` (node 0's address, as
``--master-addr``/``--master-port``; with c10d, nodes without ``--node-rank`` are numbered as
they join), ``--rdzv-id``, ``--rdzv-conf join_timeout=S,last_call_timeout=S``,
``--nnodes MIN:MAX``, ``--role``, ``--no-python``, ``--run-path``, ``--start-method``,
``--local-ranks-filter``, ``--redirects``/``--tee``. The rest (etcd, ``--local-addr``,
``--numa-binding``...) are refused with what to do instead.

**torchrun's environment variables.** As torchrun, every torchrun option not given on the
command line is read from ``PET_`` and its name upper-cased (``PET_NPROC_PER_NODE``,
``PET_NNODES``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``, ``PET_RDZV_*``,
``PET_MAX_RESTARTS``...; flags: an integer, 0 for off): Kubernetes' training operator
configures pods that way. With an endpoint, ``PET_MASTER_ADDR``/``PET_MASTER_PORT`` go
unused, as in torchrun. A bad value is refused naming the variable; the variables of the
options phalanx refuses are refused too. Give several nodes' job secret as
``PHALANX_JOB_SECRET`` from a Kubernetes Secret.

**Definitions.** A *node* is one machine (one launcher); a *worker* is one process running
the script; a *round* is one attempt of the whole group: the first, each restart after a
failure, and each new meeting after a membership change.

**Worker environment** (the names torchrun uses, so scripts move freely between the two):
``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (node rank),
``GROUP_WORLD_SIZE`` (nodes), ``ROLE_RANK``, ``ROLE_WORLD_SIZE``, ``ROLE_NAME`` (``--role``),
``MASTER_ADDR``/``MASTER_PORT`` (the workers' store, hosted by node 0's launcher, fresh every
round, reached through this launcher: the master address and port on one node, loopback on
several; ``TORCHELASTIC_USE_AGENT_STORE=True``), ``TORCHELASTIC_RESTART_COUNT`` (the round,
membership changes included; torchrun counts failures only),
``TORCHELASTIC_MAX_RESTARTS``, ``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_ERROR_FILE``,
``TORCHELASTIC_SIGNALS_TO_HANDLE``, ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``. When unset:
``OMP_NUM_THREADS`` = usable cores / local workers (at least 1; torchrun sets 1),
``PYTHONUNBUFFERED=1`` (output reaches the console as it is printed), and, where no glibc malloc
threshold is set, ``MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824``: glibc
otherwise gives a step's freed memory back to the kernel and faults it in again the next step
(a quarter of a small CNN's step); ``--no-malloc-tuning`` leaves them out.

**Output.** Every line a worker prints appears prefixed ``[rankN]: `` (``--no-rank-prefix``:
as printed); ``--local-ranks-filter 0`` shows local rank 0's lines only. A progress bar
redrawn with ``\\r`` stays on one line in a terminal; when the console is a file or a pipe,
only its last state is written, and at most one state every few seconds meanwhile.
``--log-dir D`` also writes every worker's streams, unchanged, to
``D/<run id>_XXXX/attempt_K/rankN.stdout.log`` and ``.stderr.log``: a new folder per run, so
a second run keeps the first one's logs. With it, torchrun's ``--redirects S`` keeps streams
off the console (``S``: 0 none, 1 stdout, 2 stderr, 3 both, or per local rank ``0:3,1:0``),
and ``--tee S`` shows streams although redirected; without ``--log-dir`` both are refused.

**Failures.** When a worker exits non-zero or dies of a signal, on any node, the workers of
every node get SIGTERM, then SIGKILL after ``--shutdown-timeout`` seconds, and the group is
started again, up to ``--max-restarts`` times. After the last attempt the launcher prints the
node, rank, exit code or signal of the first worker seen to fail, and the traceback that ended
it, cut at its exception line (from its stderr: no decorator needed; a torch elastic
``@record`` error file is preferred when the script wrote one): once, either as the worker
printed it or in the summary. What the other workers print after that failure (their
secondary errors) is held back and shown after the summary. The launcher exits with that
worker's status (128 + N for signal N). A worker exiting with 75
(``phalanx.errors.PREEMPTED_EXIT_CODE``) was preempted after saving its checkpoint: not a
failure, no restart; the launcher exits 75.

**Hangs.** A collective that waits longer than ``--watchdog`` seconds (default 300; a
script's ``init_process_group(timeout=...)`` overrides it) ends in a hang report on every
rank: which ranks never arrived, and where each rank is. ``--watchdog`` is the default
timeout of the groups ``phalanx.init_process_group`` makes: a script that keeps
``torch.distributed.init_process_group`` keeps torch's timeout (30 min, 10 with NCCL; torch
reads it from no variable), so give it ``timeout=`` there; the launcher says so at start. The summary then names the late rank
as the root cause (not the rank that gave up waiting first) and shows the report.

**Signals.** SIGINT, SIGTERM, SIGHUP and SIGQUIT sent to the launcher are forwarded to every
worker's main process (as torchrun does: its DataLoader workers and other children are left to
it); after ``--shutdown-timeout`` the rest are killed, with every process they started, and the
launcher exits 75 if the workers reported preemption, else 128 + N. SIGUSR1 and SIGUSR2 are
only forwarded. No worker outlives its launcher, even one killed with SIGKILL: workers get a
parent-death signal, and a small guardian process kills each worker's whole process tree when
the launcher is gone.

**Exit status.** 0 success; a worker's status; 75 preempted; 128 + N after signal N (130
after Ctrl-C); 1 the nodes could not meet (or node 0 was lost, or refused this node's rank);
2 bad input (unknown option, missing script or module, ``--nproc-per-node 0``,
``--node-rank`` >= ``--nnodes``, ``--nnodes`` MIN above MAX, several nodes without a job
secret or with another one than node 0's, master port in use).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..errors import LaunchConfigError, RendezvousError
from ..launcher import LaunchConfig, StreamChoice, launch, resolve_nproc
from ..launcher.config import (
    DEFAULT_MASTER_ADDR,
    DEFAULT_MASTER_PORT,
    DEFAULT_MONITOR_INTERVAL,
    DEFAULT_RDZV_TIMEOUT,
    DEFAULT_SHUTDOWN_TIMEOUT,
    resolve_secret,
)
from . import torchrun, torchrun_env
from .text import add_manual_parser

USAGE = "phalanx run [options] script.py [script args...]"


def add_run(commands: argparse._SubParsersAction) -> None:
    parser = add_manual_parser(
        commands, "run", "start a script on several processes (torchrun-compatible)", __doc__,
        unknown_note="not an option of phalanx run's, nor of torchrun's")
    add = parser.add_argument
    add("--nproc-per-node", "--nproc_per_node", "--nproc", default="1", metavar="N|auto|cpu|gpu",
        help="workers on this node (default 1)")
    add("--nnodes", default="1", metavar="N|MIN:MAX",
        help="number of nodes (default 1); MIN:MAX: elastic, from MIN to MAX nodes")
    add("--node-rank", "--node_rank", type=int, default=None,
        help="this node's rank (default 0; elastic or c10d: numbered as the nodes join)")
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
    add("--watchdog", type=float, default=None, metavar="S",
        help="seconds a collective may wait before every rank reports where it is and the run "
             "fails naming the late rank (default 300): the timeout of groups made by "
             "phalanx.init_process_group; torch.distributed.init_process_group needs timeout=")
    add("--rdzv-timeout", "--rdzv_timeout", type=float, default=None,
        help="seconds to wait for the master and the other nodes, counted from the launcher's "
             f"start (default {DEFAULT_RDZV_TIMEOUT:g})")
    add("--job-secret-file", default=None, metavar="PATH",
        help="several nodes: the job secret, in a file only you may read (mode 0600); "
             "default: PHALANX_JOB_SECRET")
    add("--rdzv-id", "--rdzv_id", "--run-id", "--run_id", default="",
        help="the job's id, TORCHELASTIC_RUN_ID (default: drawn at random)")
    add("--log-dir", "--log_dir", default=None,
        help="write each worker's output to files in a new folder here")
    add("-r", "--redirects", default=None, metavar="S", help="with --log-dir: streams kept off the console")
    add("-t", "--tee", default=None, metavar="S",
        help="with --log-dir: streams shown on the console although redirected")
    add("--no-rank-prefix", action="store_true", help="show workers' lines without '[rankN]: '")
    add("--no-malloc-tuning", action="store_true",
        help="leave glibc's malloc at its defaults (phalanx run otherwise sets "
             "MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ where you set neither)")
    add("-m", "--module", action="store_true", help="run the entry point as a module (python -m)")
    torchrun.add_options(parser)
    add("script", nargs="?", help="the training script (or module, with -m)")
    add("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    torchrun_env.add_defaults(parser)  # torchrun's PET_<OPTION> variables
    parser.set_defaults(handler=_run, started=None)  # main(): when the process started


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
    """``phalanx run``'s parsed options -> a validated :class:`LaunchConfig`."""
    args = torchrun_env.resolve(args)
    if args.script is None:
        raise LaunchConfigError(f"script is required: {USAGE}")
    if args.standalone and (args.master_addr is not None or args.master_port is not None):
        raise LaunchConfigError(
            "--standalone picks a free port on loopback itself; drop --master-addr/--master-port"
        )
    torchrun.check_accepted(args)
    min_nnodes, nnodes = torchrun.parse_nnodes(args.nnodes)
    settings = {
        "master_addr": args.master_addr or DEFAULT_MASTER_ADDR,
        "master_port": DEFAULT_MASTER_PORT if args.master_port is None else args.master_port,
        "standalone": args.standalone,
        "rdzv_timeout": DEFAULT_RDZV_TIMEOUT if args.rdzv_timeout is None else args.rdzv_timeout,
        **torchrun.rendezvous(args),
    }
    return LaunchConfig(
        entrypoint=args.script,
        args=tuple(args.script_args),
        module=args.module,
        nproc_per_node=resolve_nproc(args.nproc_per_node),
        nnodes=nnodes,
        min_nnodes=min_nnodes,
        node_rank=torchrun.node_rank(args, (min_nnodes, nnodes)),
        job_secret=resolve_secret(args.job_secret_file),
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        shutdown_timeout=args.shutdown_timeout,
        watchdog=args.watchdog,
        run_id=args.rdzv_id,
        log_dir=args.log_dir,
        redirects=_streams(args.redirects, "--redirects"),
        tee=_streams(args.tee, "--tee"),
        local_ranks_filter=torchrun.local_ranks(args.local_ranks_filter),
        rank_prefix=not args.no_rank_prefix,
        tune_malloc=not args.no_malloc_tuning,
        no_python=args.no_python and not args.run_path,  # torchrun: --run-path wins
        role=args.role,
        **settings,
        **({} if args.started is None else {"started": args.started}),
    )


def _streams(spec: str | None, option: str) -> StreamChoice:
    return StreamChoice() if spec is None else StreamChoice.parse(spec, option)


def _run(args: argparse.Namespace) -> int:
    status = _launch(args)
    if args.started is not None and "torch" in sys.modules:  # the program, of several nodes
        # Everything is cleaned up by now (workers, store helper, scratch). What is left is
        # the interpreter's teardown of torch's modules: 1.3 s on a loaded machine (0.3 s
        # idle), after --rdzv-timeout has run out: the launcher's store client imported torch.
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(status)
    return status


def _launch(args: argparse.Namespace) -> int:
    try:
        return launch(config_from_args(args))
    except LaunchConfigError as e:
        print(f"phalanx run: error: {torchrun_env.blame(str(e), args)}", file=sys.stderr)
        return 2
    except RendezvousError as e:
        print(f"phalanx run: error: {e}", file=sys.stderr)
        return 1
