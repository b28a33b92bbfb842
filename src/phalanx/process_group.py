"""Joining and leaving the job: the default process group, the backend, the device.

``init_process_group`` takes the same arguments as ``torch.distributed.init_process_group``
so a torch script switches by changing its import. What it adds:

* rank, world size and master address come from ``phalanx run``/torchrun's variables or from
  Slurm's, and with neither it runs as a single process (world size 1), so one script runs
  alone, under a launcher and under ``srun``;
* ``backend=None`` picks NCCL when this process has a GPU, else Gloo, and pins the process to
  ``cuda:LOCAL_RANK``: one GPU per local rank (:func:`phalanx.env.local_gpu`), refused with a
  clear error on a node with GPUs but fewer than its local ranks, unless ``device_id`` names
  the device;
* errors that say what went wrong: an unknown backend, a rank out of range, a master that
  cannot be reached (naming the address, the port and the timeout), a second initialisation.

Every collective is torch.distributed's (c10d); the rendezvous store is its ``TCPStore``.
"""

from __future__ import annotations

import atexit
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import env as _env
from . import unfinished
from ._logging import get_logger
from . import diagnostics as _diagnostics
from .diagnostics.attach import attach, detach, look_back, no_error_under_way
from .diagnostics.straggler import DEFAULT_EVERY
from .ledger import syncpoint
from .ledger.log import call_site
from .errors import (
    AlreadyInitializedError,
    EnvironmentConfigError,
    NotInitializedError,
    RendezvousError,
    UsageError,
    ranks_text,
)
from .gate import ranks
from .gate.handshake import Refused
from .gate.secret import check_secret

_log = get_logger(__name__)

# torch's backend names; anything else is refused before c10d sees it.
_KNOWN_BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl", "fake")


# Seconds the store's host outwaits the other ranks when some rank never joins.
_HOST_GRACE_S = 3.0


def _gpus() -> int:
    """The GPUs this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _cuda_index(device_id: torch.device | int | str) -> int | None:
    """The GPU ``init_process_group(device_id=...)`` names, ``None`` for another device."""
    if isinstance(device_id, int) and not isinstance(device_id, bool):
        return device_id if torch.cuda.is_available() else None
    device = torch.device(device_id)
    return device.index if device.type == "cuda" else None


def _resolve_backend(backend: str | None, env: _env.DistEnv,
                     device_id: torch.device | int | None = None) -> str:
    if backend is None:
        if device_id is not None:  # as torch: the backend of the device named
            has_gpu = _cuda_index(device_id) is not None
        else:  # phalanx's rule, one GPU per local rank (raises when the node has too few)
            has_gpu = _env.local_gpu(env, _gpus()) is not None
        return "nccl" if has_gpu and dist.is_nccl_available() else "gloo"
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string or None, got {type(backend).__name__}")
    name = backend.lower()
    # torch also accepts a device map such as "cpu:gloo,cuda:nccl".
    names = [part.split(":")[-1] for part in name.split(",")]
    unknown = [n for n in names if n not in _KNOWN_BACKENDS and n not in dist.Backend.backend_list]
    if unknown:
        raise ValueError(
            f"Unknown backend {backend!r}: expected one of {', '.join(_KNOWN_BACKENDS[:4])}, "
            "or a device map such as 'cpu:gloo,cuda:nccl'"
        )
    if "nccl" in names and not (dist.is_nccl_available() and torch.cuda.is_available()):
        raise ValueError(
            f"Backend {backend!r} needs CUDA and a torch build with NCCL; this process has "
            f"CUDA available={torch.cuda.is_available()}, NCCL available={dist.is_nccl_available()}. "
            "Use backend='gloo' on CPU (or backend=None to choose automatically)"
        )
    return name


# What shared_memory=None means without the variable (env.SHARED_MEMORY_ENV): on, where it
# applies (Gloo, several ranks; each group decides whether its members share a host).
SHARED_MEMORY_DEFAULT = True


def _shared_memory_wanted(shared_memory: bool | None, backend: str, world_size: int) -> bool:
    """``init_process_group``'s choice: ``shared_memory`` when given (True needs Gloo: see
    :func:`_shared_memory_backend`); for ``None``, :data:`~phalanx.env.SHARED_MEMORY_ENV` or else
    :data:`SHARED_MEMORY_DEFAULT`, and only where it applies: Gloo, more than one rank."""
    if shared_memory is not None:
        return shared_memory
    chosen = _env.shared_memory_choice()
    wanted = SHARED_MEMORY_DEFAULT if chosen is None else chosen
    return wanted and backend == "gloo" and world_size > 1


def _shared_memory_backend(backend: str) -> str:
    """``init_process_group(shared_memory=True)``'s backend: the shared-memory one in Gloo's place."""
    if backend != "gloo":
        raise ValueError(
            f"shared_memory=True serves CPU tensors: it needs backend='gloo' (or None on a "
            f"process without a GPU), got backend={backend!r}"
        )
    from . import shm  # registers the backend with torch (only where it is used)

    return shm.BACKEND_NAME


def _uses_cuda(backend: str) -> bool:
    return "nccl" in backend or backend == "xccl"


def _pinned_gpu(backend: str, env: _env.DistEnv, device_id: torch.device | int | None) -> int | None:
    """The GPU ``init_process_group`` makes current: ``device_id``'s when it names one, else
    with NCCL under a launcher (or Slurm) the rule's, ``cuda:LOCAL_RANK``
    (:func:`phalanx.env.local_gpu`); ``None``: leave the current device alone."""
    if not torch.cuda.is_available():
        return None
    if device_id is not None:
        index = _cuda_index(device_id)
        if index is not None and not 0 <= index < _gpus():
            raise ValueError(
                f"device_id {device_id} is out of range. Please use a device index less than the "
                f"number of accelerators available: {_gpus()}."
            )
        return index
    # Without a launcher there is no local rank to pin: a script passing rank= itself picks its
    # device itself (torch's mp.spawn tutorial calls torch.cuda.set_device(rank)), as with torch.
    if not _uses_cuda(backend) or env.source == "arguments":
        return None
    return _env.local_gpu(env, _gpus())


# The watchdog limit: how long a collective may wait before every rank reports where it is
# (phalanx.diagnostics.hang). torch waits 30 minutes (10 with NCCL) before saying anything;
# 5 minutes is long against any step or checkpoint write a rank may wait for, and short
# against a job's hours.
DEFAULT_TIMEOUT = timedelta(minutes=5)


def _make_store(env: _env.DistEnv, timeout: timedelta) -> dist.Store:
    """A store all ranks share: in-process for one rank alone, else torch's TCPStore."""
    if env.world_size == 1 and env.master_addr is None:
        return dist.HashStore()
    # Rank 0 listens unless the launcher already hosts the store (torchrun's agent store).
    is_master = env.rank == 0 and not env.use_agent_store
    where = f"{env.master_addr}:{env.master_port}"
    try:
        store = _open_store(env, timeout, is_master)
    except Refused as e:
        raise EnvironmentConfigError(
            f"Rank {env.rank}: rank 0's store at {where} refused this process's "
            f"PHALANX_JOB_SECRET ({e}); give every rank the same secret"
        ) from None
    except (RuntimeError, OSError) as e:  # DistNetworkError/DistStoreError; TimeoutError, bind
        if is_master:
            raise RendezvousError(
                f"Rank 0 could not listen on {where} (MASTER_ADDR:MASTER_PORT): {e}. "
                "Is the port already in use, or the address not one of this host's?"
            ) from e
        raise RendezvousError(
            f"Rank {env.rank} could not reach the master at {where} within "
            f"{timeout.total_seconds():g} s (timeout). Check that MASTER_ADDR and MASTER_PORT "
            "name rank 0's host and a port it listens on, and that rank 0 is running"
        ) from e
    _wait_for_all(dist.PrefixStore(f"phalanx/join/{env.restart_count}", store), env, timeout, where)
    # As torch does for env://: keep the group's keys apart from other users of the store.
    return dist.PrefixStore("default_pg", store)


def _open_store(env: _env.DistEnv, timeout: timedelta, is_master: bool) -> dist.Store:
    """torch's TCPStore: rank 0's bound to MASTER_ADDR's interface only; behind the gate
    when the job has a secret and no launcher hosts the store (see :mod:`phalanx.gate.ranks`)."""
    host, port = env.master_addr, env.master_port
    secret = None if env.use_agent_store else _env.job_secret()
    if secret is not None:
        key = check_secret(secret, _env.JOB_SECRET_VAR, EnvironmentConfigError)
        meet = ranks.host_gated if is_master else ranks.reach_gated
        return meet(host, port, key, timeout, _log.warning)
    if is_master:
        return ranks.host_bound(host, port, env.world_size, timeout)
    # wait_for_workers=False: _wait_for_all names the ranks that never came, where TCPStore
    # would only count them.
    return dist.TCPStore(host, port, env.world_size, is_master=False, timeout=timeout,
                         wait_for_workers=False, multi_tenant=True)


def _wait_for_all(store: dist.Store, env: _env.DistEnv, timeout: timedelta, where: str) -> None:
    """Every rank checks in; a rank still missing after ``timeout`` is named on every rank."""
    store.set(str(env.rank), "1")
    keys = [str(r) for r in range(env.world_size)]
    # The rank hosting the store waits a little longer, so the others still find it up when
    # they time out and look for who is missing (the error path only).
    hosting = env.rank == 0 and not env.use_agent_store
    try:
        store.wait(keys, timeout + timedelta(seconds=_HOST_GRACE_S if hosting else 0))
    except RuntimeError as e:  # DistStoreError on timeout, DistNetworkError if the store died
        try:
            missing = [r for r in range(env.world_size) if not store.check([str(r)])]
        except RuntimeError:
            missing = []
        if not missing:
            raise RendezvousError(
                f"Rank {env.rank} lost the store at {where} while waiting for the other ranks to "
                f"join (rank 0, which hosts it, has probably given up or died): {e}"
            ) from e
        raise RendezvousError(
            f"{ranks_text(missing).capitalize()} of {env.world_size} did not join at {where} "
            f"within {timeout.total_seconds():g} s (timeout); rank {env.rank} gave up waiting. "
            "Did those processes start, and do they see the same MASTER_ADDR and MASTER_PORT?"
        ) from e


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: dist.Store | None = None,
    group_name: str = "",
    pg_options: Any | None = None,
    device_id: torch.device | int | None = None,
    *,
    diagnostics: bool = True,
    straggler_every: int = DEFAULT_EVERY,
    shared_memory: bool | None = None,
) -> _env.DistEnv:
    """Join the job: create the default process group and pin this process's device.

    Arguments are those of ``torch.distributed.init_process_group``. Rank and world size,
    when left at ``-1``, come from the environment (see :mod:`phalanx.env`); with nothing
    there the process runs alone (world size 1).

    Notes:
        Rank 0 hosts the rendezvous store at ``MASTER_ADDR:MASTER_PORT`` unless the launcher
        does; every other rank connects to it and waits up to ``timeout`` for it to appear.
        The other ranks may therefore start before or after rank 0 without a race.

    Args:
        backend: ``"gloo"``, ``"nccl"``, ``"mpi"``, ``"ucc"`` or a device map such as
            ``"cpu:gloo,cuda:nccl"``. Default ``None``: NCCL if this process has a GPU, else Gloo.
        init_method: a torch URL (``"tcp://..."``, ``"file://..."``); default ``None``, which
            like ``"env://"`` reads the environment: the launcher's variables, or with
            ``rank``/``world_size`` given, ``MASTER_ADDR`` and ``MASTER_PORT`` alone.
        timeout: how long to wait for the other ranks and for collectives, after which every
            rank reports where it is (the hang report). Default: ``phalanx run --watchdog``'s
            seconds, else 5 minutes (``DEFAULT_TIMEOUT``; torch's are 10 minutes for NCCL and
            30 for the rest).
        world_size, rank: override the environment's values. Default ``-1`` (use it). Given
            without a launcher, the process is not pinned to a GPU (as with torch).
        store: a ready c10d store to meet in (then ``init_method`` must be ``None``).
        group_name, pg_options, device_id: passed to torch unchanged; ``device_id`` defaults
            to ``cuda:LOCAL_RANK`` with NCCL (a node with GPUs but fewer than its local ranks is
            refused: :func:`phalanx.env.local_gpu`), and a GPU it names becomes this process's
            current device: the way to share a GPU between ranks (with Gloo), or to use the one
            GPU each process is shown (``device_id=0``).
        diagnostics (bool, keyword-only): check that the ranks issue the same collectives,
            report hangs and stragglers (:mod:`phalanx.diagnostics`). Default ``True``.
        straggler_every (int, keyword-only): synchronising DDP steps between straggler
            reports; ``0`` for none. Default ``200``.
        shared_memory (bool, keyword-only): on CPU, run the collectives over same-host shared
            memory (the ``"phalanx_shm"`` backend, :mod:`phalanx.shm`) where every rank is on
            this host; a group that spans hosts stays on Gloo. ``True`` needs ``backend``
            ``None`` or ``"gloo"`` on a process without a GPU; ``False``: Gloo. Default
            ``None``: on where it applies (the backend is Gloo, more than one rank), unless the
            variable ``PHALANX_SHARED_MEMORY`` says ``0`` (see docs/shared_memory.md). On it,
            ``dist.get_backend()`` is ``"phalanx_shm"``.

    Returns:
        The :class:`~phalanx.env.DistEnv` this process joined with.

    Raises:
        AlreadyInitializedError: a default group exists already.
        ValueError: unknown backend, rank outside ``[0, world_size)``, bad environment, a
            node with GPUs but fewer than its local ranks (``EnvironmentConfigError``).
        RendezvousError: the master could not be reached within ``timeout``, or rank 0 could
            not listen on the master port.

    Example::

        >>> import phalanx
        >>> phalanx.init_process_group()          # under phalanx run, torchrun, srun or alone
        >>> model = phalanx.DistributedDataParallel(model)
        >>> ...
        >>> phalanx.destroy_process_group()
    """
    if dist.is_initialized():
        raise AlreadyInitializedError(
            f"init_process_group() was called twice: this process is already rank "
            f"{dist.get_rank()} of {dist.get_world_size()}. Call destroy_process_group() first"
        )
    found = _env.for_arguments(rank, world_size)
    backend = _resolve_backend(backend, found, device_id)
    if _shared_memory_wanted(shared_memory, backend, found.world_size):
        backend = _shared_memory_backend(backend)
    if timeout is None:
        seconds = _env.watchdog_seconds()
        timeout = DEFAULT_TIMEOUT if seconds is None else timedelta(seconds=seconds)
    gpu = _pinned_gpu(backend, found, device_id)
    if gpu is not None:
        torch.cuda.set_device(gpu)
        if device_id is None:
            device_id = torch.device("cuda", gpu)
    if store is None and init_method in (None, "env://"):
        if found.world_size > 1 and (found.master_addr is None or found.master_port is None):
            raise ValueError(
                f"world_size={found.world_size} needs a rendezvous: set MASTER_ADDR and "
                "MASTER_PORT (a launcher does), or pass init_method= or store="
            )
        store = _make_store(found, timeout)
        init_method = None
    leave_at_exit()
    dist.init_process_group(
        backend,
        init_method=init_method,
        timeout=timeout,
        world_size=found.world_size,
        rank=found.rank,
        store=store,
        group_name=group_name,
        pg_options=pg_options,
        device_id=device_id,
    )
    if found.world_size > 1:
        attach(dist.group.WORLD, diagnostics, straggler_every,
               store if store is not None else dist.distributed_c10d._get_default_store(),
               timeout.total_seconds())
    return found


# torch 2.13's Gloo threads may still owe a finished collective its clean-up, which takes the
# GIL; if the interpreter is already shutting down then, the process aborts ("terminate called
# without an active exception", seen in ~1 of 15 two-rank runs with torch's own DDP). Leaving
# them this long without the GIL at the end lets them finish first.
_GLOO_SETTLE_S = 0.05


def destroy_process_group(group: dist.ProcessGroup | None = None) -> None:
    """Leave the job (or destroy ``group``). A no-op when nothing is initialised.

    A checkpoint still being written in the background (``Checkpointer.save(blocking=False)``)
    is finished first, every rank agreeing whether it was committed; if it was not, its
    :class:`~phalanx.errors.CheckpointError` is raised once the group is gone.

    Collectives still under way raise :class:`~phalanx.errors.UsageError` (their results would
    never land), unless this is called while an exception is on its way out of the caller (a
    ``finally`` of a failing script): that exception is the story, and the collectives it cut
    short are logged as a warning instead of replacing it."""
    if not dist.is_initialized():
        return
    failing = sys.exc_info()[1]  # (a finally during an exception sees it here)
    owed = None
    try:
        owed = unfinished.finish(group)  # a checkpoint still being written: committed first
        if owed is not None and failing is not None:
            _log.warning("%s (not raised: the %s on its way out came first)", owed, type(failing).__name__)
            owed = None
        if group is None:
            look_back()  # a straggler in the steps since the last report, named by rank 0
            try:
                detach()  # raises when collectives are still under way, once the group is gone
            except UsageError as e:
                if failing is None:
                    raise
                _log.warning("%s (not raised: the %s on its way out came first)", e, type(failing).__name__)
    finally:
        time.sleep(_GLOO_SETTLE_S)  # releases the GIL: see _GLOO_SETTLE_S
        dist.destroy_process_group(group)
    if owed is not None:
        raise owed


def _leave_at_exit() -> None:
    """The interpreter is exiting and the script never destroyed its group: destroy it now,
    while Python can still serve Gloo's threads (if the group went with the interpreter, a
    Gloo thread finishing a collective's clean-up could abort the process: ~1 in 15 two-rank
    runs under load with torch alone, ~4 in 5 when a collective ran on another thread, as a
    background checkpoint's do). Not while an exception is ending the script: a collective
    it cut short could hold the destruction up; the interpreter ends that one as it would."""
    if not dist.is_initialized():
        return
    if not no_error_under_way():
        time.sleep(_GLOO_SETTLE_S)
        return
    try:
        destroy_process_group()
    except Exception as e:  # noqa: BLE001 (nobody is left to catch it: said, not raised)
        _log.error("%s", e)


def leave_at_exit() -> None:
    """Destroy the default group at interpreter exit if the script has not (idempotent).
    ``init_process_group`` calls it; so does anything of phalanx that runs collectives on a
    thread of its own in a group torch's ``init_process_group`` made."""
    global _leaving_at_exit
    if not _leaving_at_exit:
        _leaving_at_exit = True
        atexit.register(_leave_at_exit)


_leaving_at_exit = False  # whether _leave_at_exit is registered


def is_initialized() -> bool:
    """Whether this process has a default process group."""
    return dist.is_initialized()


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (default: the world); the environment's before init."""
    return dist.get_rank(group) if dist.is_initialized() else _env.detect().rank


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    """Processes in ``group`` (default: the world); the environment's before init."""
    return dist.get_world_size(group) if dist.is_initialized() else _env.detect().world_size


def get_local_rank() -> int:
    """This process's rank on its node (``LOCAL_RANK``, ``SLURM_LOCALID``; 0 alone)."""
    return _env.detect().local_rank


def get_local_world_size() -> int:
    """Processes on this node (``LOCAL_WORLD_SIZE``, from ``SLURM_TASKS_PER_NODE``; 1 alone)."""
    return _env.detect().local_world_size


def get_device() -> torch.device:
    """The device this process owns: the ``device_id`` its process group was given (by
    ``init_process_group``, which gives ``cuda:LOCAL_RANK`` with NCCL), else ``cuda:LOCAL_RANK``
    when this node shows a GPU for each of its local ranks, else the CPU. On a node with GPUs
    but fewer than its local ranks, before a process group or with NCCL, it raises
    ``EnvironmentConfigError`` (see :func:`phalanx.env.local_gpu`); in a Gloo group that named
    no device it is the CPU."""
    if dist.is_initialized() and dist.group.WORLD.bound_device_id is not None:
        return dist.group.WORLD.bound_device_id
    try:
        gpu = _env.local_gpu(_env.detect(), _gpus())
    except EnvironmentConfigError:
        if dist.is_initialized() and not _uses_cuda(dist.get_backend()):
            return torch.device("cpu")
        raise
    return torch.device("cpu") if gpu is None else torch.device("cuda", gpu)


def barrier(
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    device_ids: list[int] | None = None,
) -> Any:
    """Wait until every rank of ``group`` (default: the world) has reached this call.

    Arguments as ``torch.distributed.barrier``; with NCCL, ``device_ids`` defaults to this
    process's GPU, so torch does not have to guess it. Returns a work handle with ``async_op``.
    """
    if not dist.is_initialized():
        raise NotInitializedError("barrier() needs init_process_group() to have been called")
    if device_ids is None and dist.get_backend(group) == "nccl":
        device_ids = [torch.cuda.current_device()]
    ledger = _diagnostics.ledger()
    if not ledger.enabled or dist.get_world_size(group) == 1:
        return dist.barrier(group, async_op=async_op, device_ids=device_ids)
    with ledger.collective("barrier", (), group, check=True, shadow=(syncpoint.BARRIER,),
                           site=call_site(2)):
        return dist.barrier(group, async_op=async_op, device_ids=device_ids)
