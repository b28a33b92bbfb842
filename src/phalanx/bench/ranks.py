"""How a benchmark starts its ranks: through the launcher, as ``phalanx bench`` does.

One script (or module) plays both parts. Started by hand, it calls :func:`launch_ranks`,
which runs it again on ``nproc`` workers with ``phalanx run``'s machinery
(:func:`phalanx.launcher.launch`, standalone on loopback) and an extra
``--rank-result PATH``; on each worker, :func:`serve` initialises the process group, runs
the measurement, and rank 0 writes its result to ``PATH`` as JSON, which
:func:`launch_ranks` returns::

    def measure(args) -> dict: ...               # on every rank, inside a process group

    args = parser.parse_args()                   # the parser declares --rank-result
    if args.rank_result:                         # a worker
        serve(measure, args.rank_result, args, threads=args.threads)
    else:
        result = launch_ranks(__file__, args.world_size, sys.argv[1:])

A rank that fails makes the launcher print the root cause (rank, traceback) and stop the
others; :func:`launch_ranks` then raises :class:`RanksFailed` with the exit status.
Nothing here imports torch until a worker needs it.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Callable, Sequence

from ..launcher import LaunchConfig, launch

RESULT_FLAG = "--rank-result"


class RanksFailed(RuntimeError):
    """A benchmark's ranks did not all succeed; ``status`` is the launcher's exit status."""

    def __init__(self, what: str, status: int) -> None:
        super().__init__(f"{what} failed on its ranks (exit status {status}); the launcher "
                         "named the rank that failed first, with its traceback, above")
        self.status = status


def launch_ranks(entrypoint: str, nproc: int, args: Sequence[str] = (), module: bool = False) -> Any:
    """Run ``entrypoint args --rank-result PATH`` on ``nproc`` local workers; return the
    JSON rank 0 wrote to ``PATH`` (see :func:`serve`).

    Raises:
        RanksFailed: a worker failed (the launcher has printed which, and why).
    """
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-") as scratch:
        path = os.path.join(scratch, "result.json")
        config = LaunchConfig(entrypoint=entrypoint, module=module, nproc_per_node=nproc,
                              standalone=True, args=(*args, RESULT_FLAG, path))
        status = launch(config)
        if status != 0:
            raise RanksFailed(entrypoint, status)
        with open(path) as f:
            return json.load(f)


def serve(measure: Callable[..., Any], result_path: str, *args: Any, threads: int = 1,
          backend: str | None = "gloo", shared_memory: bool = False) -> None:
    """On one worker: join the process group (``backend``, default Gloo; with
    ``shared_memory``, phalanx's shared-memory backend where it applies), run
    ``measure(*args)``, and on rank 0 write what it returned (JSON-serialisable) to
    ``result_path``; leave the group."""
    import torch

    from .. import process_group

    torch.set_num_threads(threads)
    process_group.init_process_group(backend=backend, shared_memory=shared_memory)
    try:
        result = measure(*args)
        if process_group.get_rank() == 0:
            with open(result_path, "w") as f:
                json.dump(result, f)
    finally:
        process_group.destroy_process_group()


def run_script(entrypoint: str, argv: Sequence[str] | None, parse: Callable[..., Any],
               measure: Callable[..., Any], report: Callable[..., Any],
               launch: Callable[[Any, Sequence[str]], Any] | None = None) -> None:
    """A benchmark script's ``main``: ``args = parse(argv)``; on a worker (``--rank-result``
    given) :func:`serve` ``measure(args)``; else start ``args.world_size`` workers on
    ``entrypoint`` (or ``launch(args, argv)``: another way of starting them, returning rank
    0's result), print ``report(args, result)``'s table and write the rows it returns to
    ``args.json`` (when given, with the arguments)."""
    import sys

    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    if args.rank_result:  # one of the ranks
        # scripts with --gloo (add_gloo_option) run phalanx at its defaults unless it is given
        serve(measure, args.rank_result, args, threads=args.threads,
              shared_memory=False if getattr(args, "gloo", True) else None)
        return
    result = launch(args, argv) if launch else launch_ranks(entrypoint, args.world_size, argv)
    rows = report(args, result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": rows}, f, indent=2)


def add_gloo_option(add_argument: Callable[..., Any]) -> None:
    """``--gloo`` for a script whose ranks :func:`run_script` starts: without it, the default
    group is phalanx's default (on one host, its shared-memory backend) and torch's variants
    run on a Gloo group of their own (:func:`torch_group`), each side as its users run it;
    with it, everything runs on Gloo (the transport alike: what the code alone does)."""
    add_argument("--gloo", action="store_true",
                 help="everything on Gloo; default: phalanx at its defaults (one host: shared "
                      "memory), torch's variants on Gloo")


_TORCH_GROUP: list = []


def torch_group() -> Any:
    """The group torch's own variants run on, as torch runs them on CPU: ``None`` (the default
    group) when that is Gloo, else a Gloo group of the same ranks, made once (a collective:
    every rank calls it, the first time together)."""
    import torch.distributed as dist

    from .. import shm

    if not _TORCH_GROUP:
        _TORCH_GROUP.append(dist.new_group(backend="gloo") if shm.uses_shared_memory() else None)
    return _TORCH_GROUP[0]


def transport() -> str:
    """The transports in words, for a table's title: ``"Gloo"`` or ``"phalanx over shared
    memory, torch over Gloo"``."""
    return "Gloo" if torch_group() is None else "phalanx over shared memory, torch over Gloo"


def slowest(seconds: float) -> float:
    """The longest of every rank's ``seconds`` (a step is done when every rank's is)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()
