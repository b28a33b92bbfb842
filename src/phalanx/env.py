"""Where this process stands in the job: rank, world size, local rank, master address.

This is the only module that reads environment variables; everything else receives a
:class:`DistEnv`. Three sources are understood, tried in this order:

``launcher``
    ``phalanx run`` and ``torchrun`` set ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` and
    ``TORCHELASTIC_RESTART_COUNT``. Any process with ``RANK`` and ``WORLD_SIZE`` set is read
    this way, so a script started by hand with those variables works too.
``slurm``
    ``srun`` without a launcher: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``,
    ``SLURM_NODEID``, ``SLURM_TASKS_PER_NODE`` and the first host of ``SLURM_JOB_NODELIST``.
    ``MASTER_ADDR``/``MASTER_PORT`` override the derived address and port.
``single``
    Nothing set: one process, world size 1.

The other direction, for the launcher: :func:`launcher_environ` gives the variables a launcher
sets for one worker, under the names torchrun uses, so :func:`detect` reads them back. This
module is the contract between the two sides and nothing else: what else a launcher puts in a
worker's environment, and how it counts the machine's cores, is :mod:`phalanx.launcher.environment`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Iterable, Mapping

from .errors import EnvironmentConfigError

# Slurm gives no port: derive one from the job id so every task of a job agrees on it and
# concurrent jobs on one node rarely collide. 15000..34999 stays clear of the well-known
# ports below 1024, the common 8000/8080 services, and Linux's ephemeral range (32768+) mostly.
_SLURM_PORT_BASE = 15000
_SLURM_PORT_SPAN = 20000

# What torchrun 2.13 puts in every worker's environment besides the rank variables
# (torch/distributed/elastic/agent/server/local_elastic_agent.py, launcher/api.py).
_TORCHRUN_ROLE = "default"


@dataclass(frozen=True)
class DistEnv:
    """One process's place in a distributed job, as read from its environment.

    Args:
        rank: global rank, in ``[0, world_size)``. Default ``0``.
        world_size: number of processes in the job. Default ``1``.
        local_rank: rank among the processes of this node; picks the device. Default ``0``.
        local_world_size: processes on this node. Default ``1``.
        node_rank: index of this node (torchrun's ``GROUP_RANK``). Default ``0``.
        master_addr: host of rank 0's store, ``None`` for a single process.
        master_port: port of rank 0's store, ``None`` for a single process.
        restart_count: how many times the launcher restarted the group. Default ``0``.
        use_agent_store: the launcher hosts the store (torchrun's ``TORCHELASTIC_USE_AGENT_STORE``),
            so rank 0 connects to it instead of listening itself. Default ``False``.
        source: ``"launcher"``, ``"slurm"``, ``"single"``, or ``"arguments"`` (rank and world
            size given to ``init_process_group`` with no launcher's variables set).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    restart_count: int = 0
    use_agent_store: bool = False
    source: str = "single"

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise EnvironmentConfigError(
                f"Invalid world size {self.world_size}, expected a positive integer"
            )
        _check_index("rank", self.rank, self.world_size)
        if self.local_world_size < 1:
            raise EnvironmentConfigError(
                f"Invalid local world size {self.local_world_size}, expected a positive integer"
            )
        _check_index("local rank", self.local_rank, self.local_world_size)
        if self.master_port is not None and not 0 <= self.master_port < 2**16:
            raise EnvironmentConfigError(
                f"Invalid master port {self.master_port}, expected an integer in [0, 65535]"
            )

    @property
    def is_distributed(self) -> bool:
        """More than one process."""
        return self.world_size > 1


def _check_index(what: str, value: int, size: int) -> None:
    if not 0 <= value < size:
        raise EnvironmentConfigError(
            f"Invalid {what} {value}, {what} should be in the interval [0, {size - 1}]"
        )


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise EnvironmentConfigError(f"Environment variable {name} is required but not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise EnvironmentConfigError(
            f"Environment variable {name}={raw!r} is not an integer"
        ) from None


def _from_launcher(environ: Mapping[str, str]) -> DistEnv:
    world = _int(environ, "WORLD_SIZE")
    local_world = _int(environ, "LOCAL_WORLD_SIZE", world)
    addr = environ.get("MASTER_ADDR") or None
    port = environ.get("MASTER_PORT")
    if world > 1 and (addr is None or not port):
        missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if not environ.get(n)]
        raise EnvironmentConfigError(
            f"WORLD_SIZE={world} needs the rendezvous address, but {' and '.join(missing)} "
            "not set; start the script with `phalanx run` or torchrun, or set them"
        )
    return DistEnv(
        rank=_int(environ, "RANK"),
        world_size=world,
        local_rank=_int(environ, "LOCAL_RANK", 0),
        local_world_size=local_world,
        node_rank=_int(environ, "GROUP_RANK", 0),
        master_addr=addr,
        master_port=_int(environ, "MASTER_PORT") if port else None,
        restart_count=_int(environ, "TORCHELASTIC_RESTART_COUNT", 0),
        use_agent_store=agent_store(environ),
        source="launcher",
    )


def _from_slurm(environ: Mapping[str, str]) -> DistEnv:
    node = _int(environ, "SLURM_NODEID", 0)
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    addr = environ.get("MASTER_ADDR") or (first_host(nodelist) if nodelist else "127.0.0.1")
    if environ.get("MASTER_PORT"):
        port = _int(environ, "MASTER_PORT")
    else:
        port = _SLURM_PORT_BASE + _int(environ, "SLURM_JOB_ID", 0) % _SLURM_PORT_SPAN
    world = _int(environ, "SLURM_NTASKS")
    tasks_per_node = environ.get("SLURM_TASKS_PER_NODE")
    local_world = tasks_on_node(tasks_per_node, node) if tasks_per_node else world
    return DistEnv(
        rank=_int(environ, "SLURM_PROCID"),
        world_size=world,
        local_rank=_int(environ, "SLURM_LOCALID", 0),
        local_world_size=local_world,
        node_rank=node,
        master_addr=addr,
        master_port=port,
        restart_count=_int(environ, "SLURM_RESTART_COUNT", 0),
        source="slurm",
    )


def detect(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read a :class:`DistEnv` from ``environ`` (default: this process's environment).

    Raises:
        EnvironmentConfigError: a variable is malformed, or rank/local rank are out of range.
    """
    environ = os.environ if environ is None else environ
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return _from_launcher(environ)
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        return _from_slurm(environ)
    return DistEnv()


def for_arguments(rank: int, world_size: int, environ: Mapping[str, str] | None = None) -> DistEnv:
    """What ``init_process_group(rank=..., world_size=...)`` joins with, read as torch's
    ``env://`` reads it: an argument left at ``-1`` comes from the environment, and the master
    from ``MASTER_ADDR``/``MASTER_PORT`` even when no launcher set the other variables (torch's
    ``mp.spawn`` tutorial sets only those two). ``None`` for an address or port not set.

    Raises:
        EnvironmentConfigError: one of rank and world size is given and the other is neither
            given nor in the environment, or a variable is malformed.
    """
    environ = os.environ if environ is None else environ
    found = detect(environ)
    if rank == -1 and world_size == -1:
        return found
    if found.source == "single" and -1 in (rank, world_size):
        given, missing = ("rank", "world_size") if world_size == -1 else ("world_size", "rank")
        raise EnvironmentConfigError(
            f"init_process_group() got {given}= but no {missing}=, and {missing.upper()} is not "
            f"set in the environment; pass both rank= and world_size="
        )
    fields = dict(found.__dict__)
    fields["rank"] = found.rank if rank == -1 else rank
    fields["world_size"] = found.world_size if world_size == -1 else world_size
    if found.source == "single":
        port = environ.get("MASTER_PORT")
        fields.update(master_addr=environ.get("MASTER_ADDR") or None,
                      master_port=_int(environ, "MASTER_PORT") if port else None,
                      source="arguments")
    return DistEnv(**fields)


def local_gpu(env: DistEnv, gpus: int) -> int | None:
    """The GPU a process owns under phalanx's rule, one GPU per local rank: ``cuda:LOCAL_RANK``.

    The rule holds when this process sees at least as many GPUs as its node has local ranks
    (``gpus >= env.local_world_size``); then every rank of the node owns a GPU of its own, as
    NCCL needs. A process that sees no GPU runs on the CPU. Anything between is refused,
    rather than pinned to a GPU that does not exist (CUDA's "invalid device ordinal") or to
    one another rank also uses (NCCL's "Duplicate GPU detected"): a script that means to share
    GPUs, or whose processes are each shown their own (Slurm's ``--gpus-per-task``, a
    ``CUDA_VISIBLE_DEVICES`` per process), names its device with ``init_process_group(device_id=...)``.

    Args:
        env: this process's place in the job.
        gpus: the GPUs this process sees (``torch.cuda.device_count()``; 0 without CUDA).

    Returns:
        The GPU's index, or ``None`` for the CPU (no GPU seen).

    Raises:
        EnvironmentConfigError: the process sees GPUs, but fewer than its node's local ranks.
    """
    if gpus <= 0:
        return None
    if env.local_world_size <= gpus:
        return env.local_rank
    raise EnvironmentConfigError(
        f"LOCAL_RANK={env.local_rank} of LOCAL_WORLD_SIZE={env.local_world_size} on this node, but "
        f"this process sees {gpus} GPU{'s' if gpus > 1 else ''}: phalanx pins each local rank to a "
        "GPU of its own (cuda:LOCAL_RANK) and NCCL refuses two ranks on one GPU. Start at most "
        f"{gpus} process{'es' if gpus > 1 else ''} per node (phalanx run --nproc-per-node gpu); if each "
        "process is shown its own GPU (Slurm --gpus-per-task, CUDA_VISIBLE_DEVICES per process), "
        "pass init_process_group(device_id=0); to share GPUs between ranks, use backend='gloo' with "
        "device_id=torch.device('cuda', i); to train on the CPU, backend='gloo'"
    )


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: ``"gpu[007-009,012],cpu1"`` -> ``"gpu007"``."""
    match = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?([^,]*)", nodelist.strip())
    if not match or not (match.group(1) or match.group(2)):
        raise EnvironmentConfigError(f"Cannot parse Slurm node list {nodelist!r}")
    prefix, ranges, suffix = match.groups()
    if ranges is None:
        return prefix + suffix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first + suffix


def tasks_on_node(tasks_per_node: str, node: int) -> int:
    """Tasks on node ``node`` from ``SLURM_TASKS_PER_NODE`` (``"4(x2),3"`` -> 4, 4, 3)."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise EnvironmentConfigError(f"Cannot parse SLURM_TASKS_PER_NODE={tasks_per_node!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if not 0 <= node < len(counts):
        raise EnvironmentConfigError(
            f"SLURM_NODEID={node} but SLURM_TASKS_PER_NODE={tasks_per_node!r} "
            f"describes {len(counts)} node(s)"
        )
    return counts[node]


def launcher_environ(
    env: DistEnv, *, group_world_size: int, max_restarts: int, run_id: str, error_file: str,
    role: str = _TORCHRUN_ROLE,
) -> dict[str, str]:
    """The variables a launcher sets for one worker, named as torchrun names them.

    The inverse of :func:`detect`: ``detect(launcher_environ(e, ...)) == e`` for any
    launcher-made ``e``. ``group_world_size`` is the number of nodes; ``role`` is torchrun's
    ``--role`` (every worker has the one role, so role rank and size are rank and world size).
    """
    return {
        "RANK": str(env.rank),
        "LOCAL_RANK": str(env.local_rank),
        "WORLD_SIZE": str(env.world_size),
        "LOCAL_WORLD_SIZE": str(env.local_world_size),
        "GROUP_RANK": str(env.node_rank),
        "GROUP_WORLD_SIZE": str(group_world_size),
        "ROLE_NAME": role,
        "ROLE_RANK": str(env.rank),
        "ROLE_WORLD_SIZE": str(env.world_size),
        "MASTER_ADDR": str(env.master_addr),
        "MASTER_PORT": str(env.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(env.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": str(env.use_agent_store),
        "TORCHELASTIC_ERROR_FILE": error_file,
    }


# Set by `phalanx run` in every worker: the launcher prefixes each line of their console
# output with "[rankN]: " itself, so phalanx's log lines leave the rank out.
RANK_PREFIX_VAR = "PHALANX_RANK_PREFIX"
# The job secret the launchers of several nodes share, and that processes started without a
# launcher (srun) prove to rank 0's store (see phalanx.gate). Workers under `phalanx run` do
# not get it: they reach the store through their launcher's door.
JOB_SECRET_VAR = "PHALANX_JOB_SECRET"


def job_secret(environ: Mapping[str, str] | None = None) -> str | None:
    """``PHALANX_JOB_SECRET``, or ``None`` when it is unset or empty."""
    environ = os.environ if environ is None else environ
    return environ.get(JOB_SECRET_VAR) or None


def launcher_prefixes_output(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``phalanx run`` prefixes this process's output lines with its rank."""
    environ = os.environ if environ is None else environ
    return environ.get(RANK_PREFIX_VAR) == "1"


# The hang report's file name, beside a worker's TORCHELASTIC_ERROR_FILE.
DIAGNOSIS_NAME = "diagnosis.json"


def agent_store(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the launcher hosts the job's store (``phalanx run``, torchrun:
    ``TORCHELASTIC_USE_AGENT_STORE=True``): it outlives every worker, rank 0 included."""
    environ = os.environ if environ is None else environ
    return environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def diagnosis_file(environ: Mapping[str, str] | None = None) -> str | None:
    """Where a worker writes a hang report for its launcher: beside torch elastic's error file
    (``TORCHELASTIC_ERROR_FILE``, which ``phalanx run`` and torchrun set per worker), or
    ``None`` without a launcher."""
    environ = os.environ if environ is None else environ
    error_file = environ.get("TORCHELASTIC_ERROR_FILE")
    return os.path.join(os.path.dirname(error_file), DIAGNOSIS_NAME) if error_file else None


# Set by `phalanx run --watchdog S`: the seconds a collective may wait before the hang report,
# the default of init_process_group(timeout=...).
WATCHDOG_VAR = "PHALANX_WATCHDOG"


def watchdog_seconds(environ: Mapping[str, str] | None = None) -> float | None:
    """The watchdog limit ``phalanx run --watchdog`` gave this worker, or ``None``."""
    environ = os.environ if environ is None else environ
    raw = environ.get(WATCHDOG_VAR)
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise EnvironmentConfigError(f"{WATCHDOG_VAR}={raw!r} must be a number of seconds > 0")
    return seconds


# The variable that turns the shared-memory backend off ("0") or on ("1", the default) where
# init_process_group's shared_memory is left at None.
SHARED_MEMORY_ENV = "PHALANX_SHARED_MEMORY"
_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def shared_memory_choice(environ: Mapping[str, str] | None = None) -> bool | None:
    """What :data:`SHARED_MEMORY_ENV` asks for: ``True`` (on), ``False`` (off), ``None`` (unset)."""
    environ = os.environ if environ is None else environ
    raw = environ.get(SHARED_MEMORY_ENV, "")
    text = raw.strip().lower()
    if not text:
        return None
    if text not in _ON + _OFF:
        raise EnvironmentConfigError(f"{SHARED_MEMORY_ENV} must be 1 (on) or 0 (off), got {raw!r}")
    return text in _ON


# torchrun takes each option its command line does not give from PET_<DEST>: "PET_" and the
# option's argparse dest upper-cased, PET_NPROC_PER_NODE for --nproc-per-node
# (torch/distributed/argparse_util.py, its `env` and `check_env` actions). Kubernetes'
# training operator (PyTorchJob, TrainJob) configures torchrun's pods that way.
TORCHRUN_PREFIX = "PET_"


def torchrun_variable(dest: str) -> str:
    """The variable torchrun reads option ``dest`` from: ``"nproc_per_node"`` ->
    ``"PET_NPROC_PER_NODE"``."""
    return TORCHRUN_PREFIX + dest.upper()


def torchrun_options(dests: Iterable[str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``{dest: value}`` for each of torchrun's options ``dests`` set in the environment as
    :func:`torchrun_variable` names it (an empty value included: the caller says what it means)."""
    environ = os.environ if environ is None else environ
    return {dest: environ[torchrun_variable(dest)] for dest in dests
            if torchrun_variable(dest) in environ}
