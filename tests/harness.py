"""Run a function on N real ranks (separate processes, Gloo over loopback) and collect results.

    results = run_ranks(check_something, 3, arg1, arg2)   # -> [result of rank 0, 1, 2]

``fn(rank, world_size, *args, **kwargs)`` must be a module-level function (it is pickled).
Each rank gets the launcher's variables (RANK, WORLD_SIZE, LOCAL_RANK, ..., MASTER_PORT on a
free loopback port) and, with ``init=True``, an initialised phalanx process group on Gloo.

* A rank that raises: its traceback is piped back and the call fails naming the rank.
* A rank that hangs: after ``timeout`` seconds its Python stack is dumped (faulthandler on
  SIGUSR1), every rank is killed, and the failure names the hung rank with its stack.
* ``return_exceptions=True`` returns a :class:`RankError` in place of a failing rank's result,
  for tests that expect errors; :func:`error_of` catches an expected error inside a rank.

Processes come from a forkserver that has already imported torch, so a rank starts in a
fraction of a second instead of re-importing torch.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any, Callable, Mapping

_CTX = mp.get_context("forkserver")
# torch._dynamo is imported by the first optimizer or torch DDP a rank builds (~3 s of CPU):
# importing it once in the forkserver saves that in every rank.
_CTX.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "phalanx"])

# A rank that fails leaves its peers blocked in a collective until Gloo notices the closed
# connection; this is how long they get to report before they are killed.
_GRACE_AFTER_FAILURE_S = 15.0


@dataclass
class RankError:
    """What a failing rank raised."""

    rank: int
    type: str
    message: str
    traceback: str

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.type}: {self.message}"


def error_of(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[str, str] | None:
    """``(exception type name, message)`` of what ``fn(*args, **kwargs)`` raised, or ``None``.

    For checks run inside a rank: the pair pickles back to the parent, the exception may not.
    """
    try:
        fn(*args, **kwargs)
    except Exception as e:
        return type(e).__name__, str(e)
    return None


def marked_line(path: str, marker: str) -> str:
    """``name.py:N`` of the line in file ``path`` that ends with ``# marker`` (the call site
    phalanx's messages name)."""
    with open(path) as f:
        for number, text in enumerate(f, 1):
            if text.rstrip().endswith(f"# {marker}"):
                return f"{os.path.basename(path)}:{number}"
    raise LookupError(marker)


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables a launcher sets for one rank of a single-node job."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def _child(fn, rank, world_size, port, env, init, timeout, stack_path, conn, args, kwargs):
    os.environ.update(rank_env(rank, world_size, port))
    for key, value in (env or {}).items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    with open(stack_path, "w") as stack_file:
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
        faulthandler.enable(file=stack_file, all_threads=True)  # a crash leaves its stack
        try:
            import torch

            torch.set_num_threads(1)  # 2 cores shared by every rank: no oversubscription
            import phalanx

            if init:
                phalanx.init_process_group(backend="gloo", timeout=timedelta(seconds=timeout))
            try:
                result = fn(rank, world_size, *args, **kwargs)
            finally:
                if init:
                    phalanx.destroy_process_group()
            conn.send(("ok", result))
        except BaseException as e:  # report everything, including SystemExit
            conn.send(("error", RankError(rank, type(e).__name__, str(e), traceback.format_exc())))
        finally:
            conn.close()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    init: bool = True,
    env: Mapping[str, str | None] | Callable[[int], Mapping[str, str | None]] | None = None,
    return_exceptions: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; return their results.

    Args:
        timeout: seconds for the whole group; a rank still running then is reported as hung.
        init: initialise a phalanx process group (Gloo) around ``fn``. Default ``True``.
        env: extra variables (``None`` removes one), or a function of the rank giving them.
        return_exceptions: return :class:`RankError` for failing ranks instead of raising.
    """
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="phalanx-ranks-")
    procs, readers = [], {}
    for rank in range(world_size):
        reader, writer = _CTX.Pipe(duplex=False)
        rank_extra = env(rank) if callable(env) else env
        stack_path = os.path.join(workdir, f"rank{rank}.stack")
        proc = _CTX.Process(
            target=_child,
            args=(fn, rank, world_size, port, rank_extra, init, timeout, stack_path, writer, args, kwargs),
            name=f"rank{rank}",
        )
        proc.start()
        writer.close()
        procs.append(proc)
        readers[reader] = rank
    try:
        results = _collect(procs, readers, timeout, workdir)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        shutil.rmtree(workdir, ignore_errors=True)
    errors = [r for r in results if isinstance(r, RankError)]
    if errors and not return_exceptions:
        raise AssertionError(
            "\n".join(f"rank {e.rank} failed:\n{e.traceback}" for e in errors)
        )
    return results


def _collect(procs, readers, timeout, workdir) -> list[Any]:
    results: list[Any] = [None] * len(procs)
    pending = dict(readers)
    deadline = time.monotonic() + timeout
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        for reader in wait(list(pending), timeout=remaining):
            rank = pending.pop(reader)
            try:
                status, value = reader.recv()
            except EOFError:
                procs[rank].join(5)
                try:
                    with open(os.path.join(workdir, f"rank{rank}.stack")) as f:
                        stack = f.read()
                except FileNotFoundError:  # died before it started
                    stack = ""
                status, value = "error", RankError(
                    rank, "ProcessDied", f"exit code {procs[rank].exitcode}, no report",
                    f"died with exit code {procs[rank].exitcode}, no report\n{stack}",
                )
            results[rank] = value
            if status == "error" and pending:
                deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE_S)
    if pending:
        hung = sorted(pending.values())
        stacks = _dump_stacks(procs, hung, workdir)
        failed = [r for r in results if isinstance(r, RankError)]
        raise AssertionError(
            f"rank(s) {hung} did not finish within {timeout:g} s"
            + "".join(f"\n{e.traceback or e}" for e in failed)
            + stacks
        )
    return results


def _dump_stacks(procs, ranks, workdir) -> str:
    for rank in ranks:
        if procs[rank].is_alive():
            os.kill(procs[rank].pid, signal.SIGUSR1)
    time.sleep(1.0)
    out = []
    for rank in ranks:
        with open(os.path.join(workdir, f"rank{rank}.stack")) as f:
            out.append(f"\n--- stack of hung rank {rank} ---\n{f.read()}")
    return "".join(out)
