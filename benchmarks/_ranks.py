"""Start a benchmark's ranks on this machine: spawned processes, Gloo over loopback.

    result = run_on_ranks(worker, world_size, *args, threads=1)

Each rank gets the variables a launcher sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT`` a free port), ``threads``
torch threads and an initialised phalanx process group on Gloo; it runs ``worker(*args)``
(a module-level function: it is pickled) and destroys the group. The call returns what rank
0's worker returned; when a rank fails it raises, with the traceback of the first rank that
raised (its peers' errors, usually a closed Gloo connection, are consequences).
"""

from __future__ import annotations

import os
import pickle
import queue as queue_module
import socket
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

import phalanx

# How often the parent alternates between rank 0's result and the ranks' exits.
_POLL_S = 0.1
# After a rank fails, how long its peers get to leave on their own (Gloo notices the closed
# connection within a second or two) before they are terminated.
_GRACE_AFTER_FAILURE_S = 5.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, threads: int, results, errors,
               worker: Callable[..., Any], args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    try:
        phalanx.init_process_group(backend="gloo")
        result = worker(*args)
    except Exception:
        # Sent (synchronously) before the group goes: the peers fail only once this rank's
        # connections close, so the first traceback in the queue is the cause.
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        phalanx.destroy_process_group()
    if rank == 0:
        # Pickled here, by value: through the queue, tensors would travel as shared memory
        # whose descriptor must be fetched from this process, which may have exited by then.
        results.put(pickle.dumps(result))


def run_on_ranks(worker: Callable[..., Any], world_size: int, *args: Any, threads: int = 1) -> Any:
    """Run ``worker(*args)`` on ``world_size`` ranks; return rank 0's result."""
    ctx = mp.get_context("spawn")
    results, errors = ctx.Queue(), ctx.SimpleQueue()
    ranks = mp.start_processes(
        _rank_main, args=(world_size, _free_port(), threads, results, errors, worker, args),
        nprocs=world_size, join=False, start_method="spawn",
    )
    # Rank 0 cannot exit before its result is read (a large one fills the pipe), so read it
    # between polls of the exits; join() raises once a rank has failed, the others ended.
    payload = None
    try:
        while not ranks.join(timeout=_POLL_S, grace_period=_GRACE_AFTER_FAILURE_S):
            if payload is None:
                try:
                    payload = results.get(timeout=_POLL_S)
                except queue_module.Empty:
                    pass
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        # join() names the first rank it saw exit, often a peer hit by the closed connection.
        rank, trace = (None, "") if errors.empty() else errors.get()
        if rank is None or rank == e.error_index:
            raise
        raise RuntimeError(f"rank {rank} raised first:\n{trace}") from e
    if payload is None:  # rank 0 put it, then exited before the last poll read it
        payload = results.get(timeout=_POLL_S)
    return pickle.loads(payload)
