"""What ``phalanx run`` is asked to do, validated: :class:`LaunchConfig`.

Parsing the command line (``phalanx.cli``), checking the request (here) and running it
(:mod:`phalanx.launcher.agent`) are three separate steps, so a program can build a
:class:`LaunchConfig` itself and call :func:`phalanx.launcher.launch`.
"""

from __future__ import annotations

import importlib.machinery
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field

from .. import env
from ..errors import LaunchConfigError
from ..gate.secret import HOW_TO_MAKE, ON_KUBERNETES, check_secret, read_secret_file

# torchrun's defaults for a node started without --standalone
# (torch/distributed/run.py: --master-addr 127.0.0.1; MASTER_PORT 29500 is torch's own default).
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
# torchrun's --monitor-interval default (seconds between health checks of the workers).
DEFAULT_MONITOR_INTERVAL = 0.1
# torchrun's --shutdown-timeout default (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s): SIGTERM, then
# this long before SIGKILL.
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
# torchrun's static rendezvous waits 600 s for the other nodes (static_tcp_rendezvous.py).
DEFAULT_RDZV_TIMEOUT = 600.0
# Elastic: once MIN nodes are there for the first round, wait this much longer for more, up
# to MAX (torchrun's last_call_timeout is 30 s; nodes of one job start within seconds, and a
# node that comes later is let in at the next round anyway).
DEFAULT_LAST_CALL_TIMEOUT = 3.0

# The streams of a worker, as bits, in torchrun's --redirects/--tee numbering.
STDOUT, STDERR = 1, 2
BOTH = STDOUT | STDERR


@dataclass(frozen=True)
class StreamChoice:
    """A choice of a worker's streams, by local rank, in torchrun's ``--redirects``/``--tee``
    format: ``"3"`` for every rank, or ``"0:3,1:0"`` per local rank (1 stdout, 2 stderr,
    3 both, 0 none; ranks a map leaves out get none, as in torchrun).

    Args:
        default: streams of the local ranks not listed. Default ``0`` (none).
        per_rank: ``(local_rank, streams)`` pairs. Default none.

    Example::

        >>> choice = StreamChoice.parse("0:3,1:2", "--tee")
        >>> [choice.for_rank(r) for r in (0, 1, 2)]
        [3, 2, 0]
    """

    default: int = 0
    per_rank: tuple[tuple[int, int], ...] = ()

    @classmethod
    def parse(cls, spec: str, option: str) -> "StreamChoice":
        """Read ``"3"`` or ``"0:3,1:0"``; ``option`` names the flag in error messages."""
        spec = spec.strip()
        if re.fullmatch(r"[0-3]", spec):
            return cls(default=int(spec))
        pairs = []
        for part in spec.split(","):
            match = re.fullmatch(r"\s*(\d+)\s*:\s*([0-3])\s*", part)
            if not match:
                raise LaunchConfigError(
                    f"Invalid {option} {spec!r}: expected 0 (none), 1 (stdout), 2 (stderr), "
                    "3 (both), or per local rank such as '0:3,1:0'"
                )
            pairs.append((int(match.group(1)), int(match.group(2))))
        return cls(default=0, per_rank=tuple(pairs))

    def for_rank(self, local_rank: int) -> int:
        """The stream bits for ``local_rank``."""
        return dict(self.per_rank).get(local_rank, self.default)


@dataclass(frozen=True)
class LaunchConfig:
    r"""A validated request to run a script on ``nproc_per_node`` workers on each of ``nnodes`` nodes.

    One launcher runs on every node. Node 0's launcher hosts the rendezvous store (torch's
    ``TCPStore``) behind a gate at ``master_addr:master_port``, bound to that address's
    interface only, which lets in only launchers that prove ``job_secret``; the other nodes'
    launchers register there and node 0 decides each round's nodes, world size and rank
    offsets. With ``min_nnodes`` below ``nnodes`` the membership is elastic: the job starts
    with ``min_nnodes`` nodes and meets again, at the new world size, whenever a node leaves
    or joins. Each worker gets torchrun's environment variables (see
    :func:`phalanx.launcher.environment.worker_environ`).

    .. note::
        Every restart is a new round with a fresh store, so a group restarted after a failure
        never reads the keys of the attempt before it.

    Args:
        entrypoint (str): the script's path, or the module name when ``module=True``.
        args (tuple of str): the script's own arguments. Default ``()``.
        module (bool): run ``python -m entrypoint``. Default ``False``.
        nproc_per_node (int): workers on this node. Default ``1``.
        nnodes (int): number of nodes; with ``min_nnodes``, the most. Default ``1``.
        min_nnodes (int, optional): the fewest nodes the job runs on (torchrun's ``--nnodes
            MIN:MAX``). Default ``None``: ``nnodes``, a fixed membership.
        node_rank (int, optional): this node's index, in ``[0, nnodes)``; ``None``: numbered
            by arrival, node 0 being the launcher that can listen at the master's address.
            Default ``0``.
        master_addr (str): node 0's address. Default ``"127.0.0.1"``.
        master_port (int): node 0's rendezvous port. Default ``29500``.
        rdzv_endpoints (tuple of (str, int)): where a launcher started while its job runs
            looks for it first (``--rdzv-endpoint A:P,B:P,...``): once node 0 was lost, the
            store is at another node's address. Looked at when two or more are given.
            Default ``()``.
        standalone (bool): one node on loopback, on a free port. Default ``False``.
        max_restarts (int): restarts of the whole group after a failure. Default ``0``.
        monitor_interval (float): seconds between health checks. Default ``0.1``.
        shutdown_timeout (float): seconds between SIGTERM and SIGKILL. Default ``30``.
        watchdog (float, optional): seconds a collective may wait before every rank reports
            where it is: the default ``timeout`` of the groups the workers make with
            ``phalanx.init_process_group`` (a group torch's ``init_process_group`` makes keeps
            torch's default; :func:`launch` says so at start). Default ``None``: phalanx's
            5 minutes.
        rdzv_timeout (float): seconds to wait for the master and the other nodes (the first
            meeting: from ``started``; a later one: from its start). Default ``600``.
        last_call_timeout (float): elastic: once ``min_nnodes`` are there for the first round,
            seconds to wait for more. Default ``3``.
        job_secret (str, optional): the secret every launcher of several nodes proves to node
            0's gate (see :func:`resolve_secret`); at least 16 characters. Default ``None``.
        run_id (str): the job's id (``TORCHELASTIC_RUN_ID``); ``""`` draws one. Default ``""``.
        log_dir (str, optional): write each worker's stdout and stderr to files in a new
            folder here, named after the run id. Default ``None``.
        redirects (StreamChoice): streams kept off the console (in the log files only), per
            local rank, as torchrun's ``--redirects``; needs ``log_dir``. Default none.
        tee (StreamChoice): streams shown on the console *and* written to the log files, as
            torchrun's ``--tee``: it overrides ``redirects``; needs ``log_dir``. Default none.
        local_ranks_filter (tuple of int, optional): the local ranks whose output reaches the
            console at all (torchrun's ``--local-ranks-filter``). Default ``None``: every rank.
        rank_prefix (bool): start each console line with ``[rankN]: ``. Default ``True``.
        tune_malloc (bool): give the workers glibc malloc thresholds that keep a step's freed
            memory for the next (:data:`~phalanx.launcher.environment.MALLOC_TUNING`), unless
            the environment tunes malloc already. Default ``True``.
        no_python (bool): run ``entrypoint`` as a command, not a Python script. Default ``False``.
        role (str): the workers' ``ROLE_NAME``. Default ``"default"``.
        started (float): when the launcher started, on :func:`time.monotonic`'s clock: the
            first meeting of the nodes ends ``rdzv_timeout`` after it, however long the
            launcher took to start (importing torch on a loaded machine). Default: when the
            config is made (``phalanx run``: when its process started).

    .. warning::
        ``node_rank`` 0 must run on the host that owns ``master_addr``: it listens there.

    Example::

        >>> from phalanx.launcher import LaunchConfig, launch
        >>> config = LaunchConfig("train.py", args=("--epochs", "3"), nproc_per_node=2, standalone=True)
        >>> exit_code = launch(config)
    """

    entrypoint: str
    args: tuple[str, ...] = ()
    module: bool = False
    nproc_per_node: int = 1
    nnodes: int = 1
    min_nnodes: int | None = None
    node_rank: int | None = 0
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = DEFAULT_MASTER_PORT
    rdzv_endpoints: tuple[tuple[str, int], ...] = ()
    standalone: bool = False
    max_restarts: int = 0
    monitor_interval: float = DEFAULT_MONITOR_INTERVAL
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT
    watchdog: float | None = None
    tune_malloc: bool = True
    rdzv_timeout: float = DEFAULT_RDZV_TIMEOUT
    last_call_timeout: float = DEFAULT_LAST_CALL_TIMEOUT
    job_secret: str | None = field(default=None, repr=False)
    run_id: str = ""
    log_dir: str | None = None
    redirects: StreamChoice = field(default_factory=StreamChoice)
    tee: StreamChoice = field(default_factory=StreamChoice)
    local_ranks_filter: tuple[int, ...] | None = None
    rank_prefix: bool = True
    no_python: bool = False
    role: str = "default"
    started: float = field(default_factory=time.monotonic, compare=False)

    def __post_init__(self) -> None:
        _at_least("--nproc-per-node", self.nproc_per_node, 1)
        _at_least("--nnodes", self.nnodes, 1)
        if self.min_nnodes is None:
            object.__setattr__(self, "min_nnodes", self.nnodes)
        _at_least("--nnodes MIN", self.min_nnodes, 1)
        if self.min_nnodes > self.nnodes:
            raise LaunchConfigError(
                f"Invalid --nnodes {self.min_nnodes}:{self.nnodes}: MIN ({self.min_nnodes}) is "
                f"above MAX ({self.nnodes}); expected MIN:MAX with 1 <= MIN <= MAX"
            )
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise LaunchConfigError(
                f"Invalid --node-rank {self.node_rank}: with --nnodes {self.nnodes} it must be "
                f"in [0, {self.nnodes - 1}]"
            )
        if self.standalone and self.multi_node:
            raise LaunchConfigError(
                f"--standalone runs one node, but --nnodes is {self._nnodes_spec}; drop one of them"
            )
        if self.multi_node:
            if self.job_secret is None:
                raise LaunchConfigError(
                    f"--nnodes {self._nnodes_spec}: several nodes need a job secret, the same on "
                    "every node, so that no one else can join or write the job's store: set "
                    f"PHALANX_JOB_SECRET or pass --job-secret-file PATH (mode 0600); "
                    f"{HOW_TO_MAKE}; {ON_KUBERNETES}"
                )
            check_secret(self.job_secret, "PHALANX_JOB_SECRET/--job-secret-file", LaunchConfigError)
        _positive("--rdzv-conf last_call_timeout", self.last_call_timeout, zero=True)
        low = 0 if self.standalone else 1
        if not low <= self.master_port <= 65535:
            raise LaunchConfigError(
                f"Invalid --master-port {self.master_port}: expected a port in [1, 65535]"
            )
        for host, port in self.rdzv_endpoints:
            if not 1 <= port <= 65535:
                raise LaunchConfigError(
                    f"Invalid --rdzv-endpoint {host}:{port}: expected a port in [1, 65535]")
        _at_least("--max-restarts", self.max_restarts, 0)
        _positive("--monitor-interval", self.monitor_interval)
        _positive("--rdzv-timeout", self.rdzv_timeout)
        if self.watchdog is not None:
            _positive("--watchdog", self.watchdog)
        if self.shutdown_timeout < 0:
            raise LaunchConfigError(
                f"Invalid --shutdown-timeout {self.shutdown_timeout}: expected seconds >= 0"
            )
        for option, choice in (("--redirects", self.redirects), ("--tee", self.tee)):
            if self.log_dir is None and choice != StreamChoice():
                raise LaunchConfigError(
                    f"{option} chooses what goes to the log files, so it needs --log-dir D "
                    "(without it every stream goes to the console)"
                )
        if self.log_dir is not None and os.path.exists(self.log_dir) and not os.path.isdir(self.log_dir):
            raise LaunchConfigError(f"--log-dir {self.log_dir!r} exists and is not a directory")
        if not self.role.strip():
            raise LaunchConfigError("Invalid --role '': expected a name for the workers' role")
        if self.no_python and self.module:
            raise LaunchConfigError("--no-python runs a command, -m a Python module: give one of them")
        _check_entrypoint(self.entrypoint, self.module, self.no_python)

    @property
    def rdzv_deadline(self) -> float:
        """When the first meeting of the nodes gives up (:func:`time.monotonic`'s clock)."""
        return self.started + self.rdzv_timeout

    @property
    def multi_node(self) -> bool:
        """Several nodes may take part (``nnodes > 1``, or an elastic range)."""
        return self.nnodes > 1

    @property
    def _nnodes_spec(self) -> str:
        return str(self.nnodes) if self.min_nnodes == self.nnodes else f"{self.min_nnodes}:{self.nnodes}"

    @property
    def command(self) -> list[str]:
        """The worker's command line."""
        if self.no_python:
            return [self.entrypoint, *self.args]
        head = ["-m", self.entrypoint] if self.module else [self.entrypoint]
        return [sys.executable, *head, *self.args]

    def console_streams(self, local_rank: int) -> int:
        """The streams of ``local_rank`` shown on the console: as torchrun, those not
        redirected, plus those teed, of the ranks the filter lets through."""
        if self.local_ranks_filter is not None and local_rank not in self.local_ranks_filter:
            return 0
        return (BOTH & ~self.redirects.for_rank(local_rank)) | self.tee.for_rank(local_rank)


def _at_least(option: str, value: int, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise LaunchConfigError(f"Invalid {option} {value!r}: expected an integer")
    if value < low:
        kind = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise LaunchConfigError(f"Invalid {option} {value}: expected {kind}")


def _positive(option: str, value: float, zero: bool = False) -> None:
    if not (value >= 0 if zero else value > 0):
        raise LaunchConfigError(
            f"Invalid {option} {value}: expected a number of seconds {'>=' if zero else '>'} 0")


def resolve_secret(secret_file: str | None = None) -> str | None:
    """The job secret a launcher uses: ``secret_file``'s contents (a file of this user's,
    mode 0600), else ``PHALANX_JOB_SECRET``, else ``None``.

    Raises:
        LaunchConfigError: the file cannot be read, or others may read it.
    """
    if secret_file is not None:
        return read_secret_file(secret_file, LaunchConfigError)
    return env.job_secret()


def _check_entrypoint(entrypoint: str, module: bool, no_python: bool = False) -> None:
    if no_python:
        if shutil.which(entrypoint) is None:
            raise LaunchConfigError(
                f"Command {entrypoint!r} not found or not executable (--no-python runs it "
                "directly: give a program on PATH or a path to an executable file)"
            )
        return
    if not module:
        if not os.path.isfile(entrypoint):
            raise LaunchConfigError(
                f"Script {entrypoint!r} not found (looked in {os.getcwd()}); "
                "pass a path to a Python file, or -m for a module"
            )
        return
    top = entrypoint.split(".")[0]
    if not re.fullmatch(r"[A-Za-z_][\w.]*", entrypoint):
        raise LaunchConfigError(f"Invalid module name {entrypoint!r} for -m")
    # Look, without importing anything, where `python -m` will: the current directory first.
    path = [os.getcwd(), *sys.path[1:]]
    if top not in sys.builtin_module_names and importlib.machinery.PathFinder.find_spec(top, path) is None:
        raise LaunchConfigError(
            f"Module {entrypoint!r} not found: no {top!r} in the current directory or on sys.path"
        )
