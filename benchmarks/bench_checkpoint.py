"""Checkpoint save/load time against plain torch.save/torch.load, and the preemption check.

Usage::

    python benchmarks/bench_checkpoint.py                 # ~105 MB model, 7 rounds
    python benchmarks/bench_checkpoint.py --layers 50 --rounds 11 --dir /scratch --json ckpt.json

The state is an MLP of ``--layers`` x Linear(``--width``, ``--width``) (default 25 x 1024:
26.2 M float32 parameters, 105 MB). One process. Each round runs every variant once, the order
rotating (A B C ..., B C ... A), and the table shows medians over rounds:

``torch.save``               ``torch.save(model.state_dict(), path)``: no fsync, no checksum.
``torch.save + fsync``       the same, then fsync of the file: what durability costs alone.
``write_checkpoint``         :func:`phalanx.checkpoint.file.write_checkpoint`: temporary file,
                             streamed CRC-32, fsync, rename, directory fsync.
``Checkpointer.save``        :meth:`phalanx.Checkpointer.save`: the above plus RNG capture,
                             the loadability check, stale-temporary cleanup, keep-last-K.

Loading: ``torch.load(path, weights_only=True)`` against ``read_checkpoint`` (header and
CRC-32 check, then ``torch.load(weights_only=True)`` from the same mapped bytes) and against
``Checkpointer.load`` (which also checks the shapes, copies into the model and restores RNG
states; its baseline adds ``model.load_state_dict`` to ``torch.load``). Twice: with the files
in the page cache (a resume right after a save), and with them dropped from it first
(``posix_fadvise(DONTNEED)`` on these files only: a resume after a reboot or on another node).

``--check-ranks N`` (default 2, 0 to skip) also times ``PreemptionHandler.should_stop()`` on N
Gloo ranks over loopback: microseconds per call with ``check_every=1`` and ``10``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

import phalanx
from phalanx.bench.ranks import RESULT_FLAG, launch_ranks, serve
from phalanx.checkpoint import Checkpointer, PreemptionHandler
from phalanx.checkpoint.file import fsync_path, read_checkpoint, write_checkpoint

COLD = "load (from disk)"


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=25)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--check-ranks", type=int, default=2)
    p.add_argument("--check-calls", type=int, default=2000)
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument(RESULT_FLAG, dest="rank_result", help="(set by the script for its ranks)")
    return p.parse_args(argv)


def _jobs(model: torch.nn.Module, directory: str) -> dict[str, dict]:
    """{"save": {name: fn}, "load": {name: fn}}; each save overwrites its own file."""
    plain = os.path.join(directory, "plain.pt")
    synced = os.path.join(directory, "synced.pt")
    ours = os.path.join(directory, "file.ckpt")
    ckpt = Checkpointer(os.path.join(directory, "run"), model, keep=1)
    step = iter(range(1, 10**9))

    def save_and_fsync():
        torch.save(model.state_dict(), synced)
        fsync_path(synced)

    loads = {
        "torch.load": lambda: torch.load(plain, weights_only=True, map_location="cpu"),
        "phalanx read_checkpoint": lambda: read_checkpoint(ours),
        "torch.load + load_state_dict": lambda: model.load_state_dict(
            torch.load(plain, weights_only=True, map_location="cpu")),
        "phalanx Checkpointer.load": lambda: ckpt.load(),
    }
    return {
        "save": {
            "torch.save": lambda: torch.save(model.state_dict(), plain),
            "torch.save + fsync": save_and_fsync,
            "phalanx write_checkpoint": lambda: write_checkpoint(ours, model.state_dict()),
            "phalanx Checkpointer.save": lambda: ckpt.save(0, next(step)),
        },
        "load (page cache)": loads,
        COLD: loads,
    }


def _evict(directory: str) -> None:
    """Drop this benchmark's files (only them) from the page cache, as after a reboot."""
    for root, _, names in os.walk(directory):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages cannot be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _time_rounds(jobs: dict[str, dict], rounds: int, directory: str) -> dict[str, dict]:
    times: dict[str, dict[str, list[float]]] = {kind: {} for kind in jobs}
    for kind in jobs:  # saves first: the loads read their files
        for fn in jobs[kind].values():
            fn()  # warm-up: files exist, pages allocated, code paths imported
    for r in range(rounds):
        for kind, named in jobs.items():
            order = list(named.items())
            for name, fn in order[r % len(order):] + order[: r % len(order)]:
                if kind == COLD:
                    _evict(directory)
                start = time.perf_counter()
                fn()
                times[kind].setdefault(name, []).append(time.perf_counter() - start)
    return times


def _check_rank(calls: int) -> dict[int, float]:
    result = {}
    for every in (1, 10):
        with PreemptionHandler(check_every=every) as preemption:
            phalanx.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                preemption.should_stop()
            result[every] = (time.perf_counter() - start) / calls * 1e6
    return result


def _report(args, model_bytes: int, times: dict) -> dict:
    print(f"state: {args.layers} x Linear({args.width}, {args.width}) = {model_bytes / 1e6:.0f} MB "
          f"float32, {args.rounds} rounds; median and best round")
    rows = {}
    for kind, named in times.items():
        medians = {name: statistics.median(t) * 1e3 for name, t in named.items()}
        bests = {name: min(t) * 1e3 for name, t in named.items()}
        base = next(iter(medians))
        print(f"\n{kind:<30}{'median ms':>10}{'ratio':>7}{'best ms':>9}{'ratio':>7}   (vs {base})")
        for name, ms in medians.items():
            rows[f"{kind}: {name}"] = {"ms_median": ms, "ms_best": bests[name],
                                       "ms_all": [t * 1e3 for t in named[name]]}
            print(f"{name:<30}{ms:>10.1f}{ms / medians[base]:>6.2f}x"
                  f"{bests[name]:>9.1f}{bests[name] / bests[base]:>6.2f}x")
        if kind != "save":
            fair = medians["phalanx Checkpointer.load"] / medians["torch.load + load_state_dict"]
            print(f"Checkpointer.load vs torch.load + load_state_dict (medians): {fair:.2f}x")
    return rows


def main(argv=None) -> None:
    args = _parse(argv)
    if args.rank_result:  # one of the --check-ranks ranks
        serve(_check_rank, args.rank_result, args.check_calls)
        return
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width)
                                  for _ in range(args.layers)])
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    directory = tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir)
    try:
        times = _time_rounds(_jobs(model, directory), args.rounds, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    rows = _report(args, model_bytes, times)
    checks = {}
    if args.check_ranks > 1:
        checks = launch_ranks(__file__, args.check_ranks, sys.argv[1:] if argv is None else argv)
        print(f"\nPreemptionHandler.should_stop() on {args.check_ranks} Gloo ranks (loopback): "
              + ", ".join(f"check_every={k}: {v:.1f} us/call" for k, v in checks.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": rows, "should_stop_us": checks}, f, indent=2)


if __name__ == "__main__":
    main()
