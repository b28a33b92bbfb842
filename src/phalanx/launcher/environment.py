"""What the machine offers the workers, and a worker's whole environment.

:func:`usable_cpus` counts the cores this process may use (CPU affinity, capped by a cgroup v2
quota); it answers ``--nproc-per-node cpu`` and sizes the ``OMP_NUM_THREADS`` default.
:func:`worker_environ` is the contract of :mod:`phalanx.env` plus the launcher's defaults,
which fill only what the user left unset.
"""

from __future__ import annotations

import math
import os
import re
from typing import Mapping

from ..env import (
    JOB_SECRET_VAR,
    RANK_PREFIX_VAR,
    WATCHDOG_VAR,
    DistEnv,
    launcher_environ,
)
from ..errors import LaunchConfigError
from .events import STOP_SIGNALS

# cgroup v2 (the kernel's Documentation/admin-guide/cgroup-v2.rst): where the hierarchy is
# mounted, and the file whose "0::/path" line names this process's cgroup in it. Each cgroup's
# cpu.max holds "$QUOTA $PERIOD" in microseconds, "max $PERIOD" for no limit.
_CGROUP_ROOT = "/sys/fs/cgroup"
_CGROUP_MEMBERSHIP = "/proc/self/cgroup"


def cgroup_cpu_limit(root: str = _CGROUP_ROOT, membership: str = _CGROUP_MEMBERSHIP) -> int | None:
    """The cores this process's cgroup v2 CPU quota allows, rounded up: the smallest
    ``ceil(quota / period)`` of ``cpu.max`` along its cgroup and every ancestor under ``root``.
    ``None`` when no quota is set (``max``) or there is no cgroup v2 (cgroup v1's
    ``cpu.cfs_quota_us`` is not read).

    Args:
        root: where the cgroup v2 hierarchy is mounted. Default ``/sys/fs/cgroup``.
        membership: the file naming this process's cgroup (its ``0::/path`` line).
            Default ``/proc/self/cgroup``.
    """
    try:
        with open(membership) as f:
            path = next((line[3:].strip() for line in f if line.startswith("0::")), "/")
    except OSError:
        path = "/"
    limits = []
    parts = [p for p in path.split("/") if p and p != ".."]
    for depth in range(len(parts), -1, -1):  # the cgroup itself, then each ancestor to the root
        try:
            with open(os.path.join(root, *parts[:depth], "cpu.max")) as f:
                quota, period = f.read().split()
            if quota != "max":
                limits.append(max(1, math.ceil(int(quota) / int(period))))
        except (OSError, ValueError, ZeroDivisionError):  # none here (the root has none), or
            continue  # not "QUOTA PERIOD": no limit read from this level
    return min(limits, default=None)


def usable_cpus() -> int:
    """Cores this process may run on: its CPU affinity (taskset, cpusets), capped by its
    cgroup v2 CPU quota (docker ``--cpus``, Kubernetes CPU limits, systemd ``CPUQuota``)."""
    cpus = len(os.sched_getaffinity(0))
    limit = cgroup_cpu_limit()
    return cpus if limit is None else min(cpus, limit)


def default_omp_threads(local_world_size: int, cpus: int | None = None) -> int:
    """``OMP_NUM_THREADS`` for a worker when the user set none: ``cpus`` (default
    :func:`usable_cpus`) shared among the local workers, at least 1. torchrun sets 1 whatever
    the machine, starving intra-op parallelism."""
    if cpus is None:
        cpus = usable_cpus()
    return max(1, cpus // local_world_size)


# glibc's malloc, set for a training loop. By default glibc gives the top of its heap back to the
# kernel once more than twice its mmap threshold (raised as blocks are freed, up to 32 MiB) is
# free there, and a training step frees its activations at its end: the next step takes the
# pages back zero-filled, a page fault every 4 KiB (the benchmark CNN at world 2: 12 000 faults
# and about a quarter of its step). Fixed at the dynamic threshold's ceiling (blocks of 32 MiB
# and more still get mappings of their own, returned when freed), with the trim threshold at
# 1 GiB, the heap keeps what a step frees for the next, as jemalloc and tcmalloc do; a process
# keeps at most its heap's peak.
MALLOC_TUNING = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
# Setting any of these disables glibc's dynamic thresholds: a user who set one has chosen.
_MALLOC_CHOICES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def malloc_tuning(base: Mapping[str, str]) -> dict[str, str]:
    """:data:`MALLOC_TUNING`, unless ``base`` (an environment) tunes glibc's malloc already:
    one of its ``MALLOC_*_`` thresholds, or a ``glibc.malloc.`` entry of ``GLIBC_TUNABLES``
    (where another allocator is preloaded, glibc's variables are read by nobody)."""
    if any(name in base for name in _MALLOC_CHOICES) or "glibc.malloc." in base.get("GLIBC_TUNABLES", ""):
        return {}
    return dict(MALLOC_TUNING)


def worker_environ(
    env: DistEnv,
    *,
    group_world_size: int,
    max_restarts: int,
    run_id: str,
    error_file: str,
    base: Mapping[str, str] | None = None,
    cpus: int | None = None,
    role: str = "default",
    rank_prefix: bool = True,
    watchdog: float | None = None,
    tune_malloc: bool = True,
) -> dict[str, str]:
    """A worker's whole environment: ``base`` (default: this process's), the launcher
    variables of :func:`launcher_environ`, and defaults for what the user left unset.

    Defaults, each applied only when ``base`` lacks the variable:

    * ``OMP_NUM_THREADS``: :func:`default_omp_threads`;
    * ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` and ``TORCHELASTIC_SIGNALS_TO_HANDLE``, as torchrun;
    * ``PYTHONUNBUFFERED=1``: workers write into pipes read by the launcher, where Python
      would otherwise hold ``print`` output back in 8 KiB blocks;
    * with ``tune_malloc`` (``phalanx run``'s default; ``--no-malloc-tuning``), glibc's malloc
      thresholds (:data:`MALLOC_TUNING`) where ``base`` tunes none (:func:`malloc_tuning`).

    And ``PHALANX_RANK_PREFIX=1`` when the launcher prefixes console lines with the rank
    (``rank_prefix``; see :func:`~phalanx.env.launcher_prefixes_output`), and
    ``PHALANX_WATCHDOG`` when ``watchdog`` seconds are given (``phalanx run --watchdog``: the
    default of ``init_process_group(timeout=...)``, see :func:`~phalanx.env.watchdog_seconds`).
    The job secret (``PHALANX_JOB_SECRET``) is left out: workers reach the store through their
    launcher.
    """
    base = os.environ if base is None else base
    out = dict(base)
    out.pop(JOB_SECRET_VAR, None)
    defaults = {
        "OMP_NUM_THREADS": str(default_omp_threads(env.local_world_size, cpus)),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": ",".join(s.name for s in STOP_SIGNALS),
        "PYTHONUNBUFFERED": "1",
        **(malloc_tuning(base) if tune_malloc else {}),
    }
    for name, value in defaults.items():
        out.setdefault(name, value)
    out.update(
        launcher_environ(
            env, group_world_size=group_world_size, max_restarts=max_restarts,
            run_id=run_id, error_file=error_file, role=role,
        )
    )
    if watchdog is not None:
        out[WATCHDOG_VAR] = f"{watchdog:g}"
    if rank_prefix:
        out[RANK_PREFIX_VAR] = "1"
    else:
        out.pop(RANK_PREFIX_VAR, None)
    return out


def watchdog_note(seconds: float) -> str:
    """What the launcher says once, at start, of ``--watchdog``: which workers it reaches.

    It becomes ``PHALANX_WATCHDOG``, the default timeout of the groups
    ``phalanx.init_process_group`` makes. A group made by ``torch.distributed.init_process_group``
    keeps torch's default (``torch.distributed.constants.default_pg_timeout``, 30 minutes;
    10 with NCCL), which torch 2.13 reads from no variable, so no launcher can change it.
    """
    return (f"--watchdog {seconds:g} is the timeout of the process groups that "
            "phalanx.init_process_group makes. A script that calls torch.distributed."
            "init_process_group keeps torch's (30 min; 10 with NCCL), which no launcher can "
            f"change: pass it timeout=datetime.timedelta(seconds={seconds:g}), or call "
            "phalanx.init_process_group")


def resolve_nproc(spec: str) -> int:
    """``--nproc-per-node``: an integer, or ``cpu`` (:func:`usable_cpus`), ``gpu`` (CUDA
    devices), ``auto`` (accelerators if any, else usable cores), as torchrun resolves them,
    except that ``cpu`` counts the cgroup quota too (torchrun: the CPU affinity alone)."""
    spec = str(spec).strip()
    if re.fullmatch(r"-?\d+", spec):
        return int(spec)
    if spec == "cpu":
        return usable_cpus()
    if spec in ("gpu", "auto"):
        import torch  # only these two need it; the usual integer path starts without torch

        if spec == "gpu":
            if not torch.cuda.is_available():
                raise LaunchConfigError("--nproc-per-node gpu needs CUDA GPUs, and none is available")
            return torch.cuda.device_count()
        if torch.accelerator.is_available():
            return torch.accelerator.device_count()
        return usable_cpus()
    raise LaunchConfigError(
        f"Invalid --nproc-per-node {spec!r}: expected a positive integer, 'auto', 'cpu' or 'gpu'"
    )
