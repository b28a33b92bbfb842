"""Checkpoint save/load time against plain torch.save/torch.load, the preemption check, and
sharded checkpoints against the single file and torch's DCP at several world sizes.

Usage::

    python benchmarks/bench_checkpoint.py                 # ~105 MB model, 7 rounds; worlds 1 2 4
    python benchmarks/bench_checkpoint.py --layers 50 --rounds 11 --dir /scratch --json ckpt.json
    python benchmarks/bench_checkpoint.py --skip-single --worlds 1 2 3 4 --sharded-rounds 7
    python benchmarks/bench_checkpoint.py --quick         # a smoke run (~30 s: three launches)

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

**Sharded checkpoints** (``--worlds 1 2 4``, the default; ``--worlds`` alone skips them): a GPT
(:class:`phalanx.bench.engine.GPT`, ``--gpt-dim 512 --gpt-depth 11``: 35 M parameters, 140 MB,
420 MB with AdamW's two states) fully sharded by ``phalanx.fully_shard`` (built on the meta
device, each rank initialising its rows), one AdamW step taken, on each world size in turn,
its ranks started as ``phalanx run`` starts them (:mod:`phalanx.bench.ranks`). Each round runs
every save once, the order rotating; medians over ``--sharded-rounds``:

``consolidated``        ``Checkpointer.save``: one file, every tensor through rank 0.
``sharded``             ``Checkpointer(format="sharded").save``: every rank its part (DCP),
                        checksummed, committed atomically.
``sharded async``       ``save(blocking=False)``: returns once staged; ``wait()`` after a gap.
``dcp.save``            torch's ``dcp.save`` of the same state dicts (no checksums, no commit).
``dcp.async_save``      torch's ``dcp.async_save`` (its own Gloo group, its default stager),
                        ``result()`` after a gap.
``disk write+fsync``    each rank writes the bytes its ``sharded`` save wrote, from memory, to
                        one file, and fsyncs it: this disk's own time for those bytes, the floor.

After each save, untimed, the older checkpoints are removed and ``sync()`` is called, so that
the next save starts on a quiet disk (the rotation puts each save after the same one every
round). A save's time is its slowest rank's. For the two asynchronous saves the *stall* is what
training waits for: the call's return, plus what the next ``optimizer.step()`` waits (it is
called ``--step-gap`` seconds after the return, by default one forward and backward of the
model as measured before the saves; it has no gradients, so it changes nothing, but it waits
for a background save's copy of the parameters and optimizer state as any step does), plus
what ``wait()``/``result()`` still waits after a gap (``--async-gap`` seconds after the
return, default twice the warm-up's blocking sharded save: the gap stands for the training
between two checkpoints, which on an accelerator leaves the host's CPU to the writer thread;
here it sleeps). Bytes written per rank are the sizes of the files
each rank wrote (exact). Peak memory: the rise of each rank's peak resident memory over its
resident memory before the save (``VmHWM`` reset through ``/proc/self/clear_refs``; glibc's
``mmap`` threshold fixed at 64 KiB and its trim threshold at its default 128 KiB for the saves,
so that freed memory leaves resident memory at once; the loads run first, with the launcher's
thresholds, as a job under ``phalanx run`` has them),
against one *unit*, the largest tensor shard a rank holds. ``sharded async`` stages into the
copy its previous save made (kept until ``close()``), so its rise is over that copy, whose
size (the resident memory it kept after the first save) is printed too.

Loading at another world size: each world loads the checkpoints the previous world in
``--worlds`` saved (the first loads the last's), after dropping their files from the page
cache: ``Checkpointer.load`` of the consolidated file and of the sharded directory, and
torch's ``dcp.load`` (plus ``set_optimizer_state_dict``) of the ``dcp.save`` directory.

``--quick``: a smoke run (small models, one round, worlds 1 and 2; its time is the ranks'
start-up, three launches).
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

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
    p.add_argument("--skip-single", action="store_true", help="only the sharded checkpoints")
    p.add_argument("--worlds", type=int, nargs="*", default=None,
                   help="world sizes of the sharded checkpoints (default 1 2 4; none: skip them)")
    p.add_argument("--gpt-dim", type=int, default=512)
    p.add_argument("--gpt-depth", type=int, default=11)
    p.add_argument("--sharded-rounds", type=int, default=5)
    p.add_argument("--async-gap", type=float, default=0.0,
                   help="seconds between an async save and its wait (0: twice the blocking save)")
    p.add_argument("--step-gap", type=float, default=-1.0,
                   help="seconds between an async save and the next optimizer step (default: one "
                        "forward and backward of the model, measured)")
    p.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    p.add_argument(RESULT_FLAG, dest="rank_result", help="(set by the script for its ranks)")
    p.add_argument("--sharded-rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--save-here", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--scratch", help=argparse.SUPPRESS)
    p.add_argument("--load-from", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.width, args.layers, args.rounds, args.check_ranks = 128, 2, 1, 0
        args.gpt_dim, args.gpt_depth, args.sharded_rounds = 64, 2, 1
    if args.worlds is None:
        args.worlds = [1, 2] if args.quick else [1, 2, 4]
    return args


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


# ---- sharded checkpoints: a fully sharded GPT on 1, 2, 4 ranks ---------------------------------

SAVES = ("consolidated", "sharded", "sharded async", "dcp.save", "dcp.async_save", "disk write+fsync")
ASYNC = {"sharded async": "sharded", "dcp.async_save": "dcp.save"}  # and their blocking saves
LOADS = ("consolidated", "sharded", "dcp.load")
_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD = -3, -1  # <malloc.h>
_SMALL_FILES = (".metadata", "phalanx-state.ckpt", "phalanx-manifest.json")  # rank 0 writes them


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _peak_rise(fn):
    """``(fn()'s result, bytes by which this process's peak resident memory rose over its
    resident memory before)``."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _status("VmRSS")
    out = fn()
    return out, _status("VmHWM") - before


def _build_gpt(args, seed: int):
    """The fully sharded GPT and its AdamW after one step (its state exists)."""
    import torch.nn.functional as F

    from phalanx.bench import fsdp
    from phalanx.bench.engine import GPT, GPT_TOKENS, GPT_VOCAB

    dim = args.gpt_dim
    model = fsdp.build("phalanx fully_shard", lambda: GPT(dim=dim, depth=args.gpt_depth,
                                                          heads=max(1, dim // 64)), seed, meta=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, GPT_VOCAB, (1, GPT_TOKENS), generator=torch.Generator().manual_seed(seed))
    F.cross_entropy(model(x), x.flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _forward_backward(args, model) -> float:
    """Seconds of one forward and backward of ``model`` (median of 3; gradients dropped)."""
    import torch.nn.functional as F

    from phalanx.bench.engine import GPT_TOKENS, GPT_VOCAB

    x = torch.randint(0, GPT_VOCAB, (1, GPT_TOKENS), generator=torch.Generator().manual_seed(1))
    times = []
    for _ in range(3):
        t = time.perf_counter()
        F.cross_entropy(model(x), x.flatten()).backward()
        times.append(time.perf_counter() - t)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def _local(t) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _held(model, opt) -> tuple[int, int]:
    """``(bytes of this rank's shards of the state, its largest tensor shard)``."""
    tensors = [_local(t) for t in model.state_dict().values() if isinstance(t, torch.Tensor)]
    tensors += [_local(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    sizes = [t.numel() * t.element_size() for t in tensors]
    return sum(sizes), max(sizes)


def _newest(directory: Path) -> Path:
    return max(directory.iterdir(), key=lambda p: int(p.name))


def _keep_newest(directory: Path) -> None:
    """Remove all but the newest checkpoint in ``directory`` (``ckpt-<step>...`` or DCP's
    ``<step>`` directories)."""
    def step(path: Path) -> int:
        return int(path.name.split(".")[0].removeprefix("ckpt-"))

    for old in sorted(directory.iterdir(), key=step)[:-1]:
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def _written(kind: str, directory: Path, world: int) -> list[int]:
    """Bytes each rank wrote in its newest checkpoint of ``kind`` (file sizes: exact)."""
    if kind == "consolidated":
        return [sum(f.stat().st_size for f in directory.glob("ckpt-*.ckpt"))] + [0] * (world - 1)
    path = max(directory.glob("ckpt-*.dcp")) if kind.startswith("sharded") else _newest(directory)
    out = [(path / f"__{r}_0.distcp").stat().st_size if (path / f"__{r}_0.distcp").exists() else 0
           for r in range(world)]
    out[0] += sum((path / n).stat().st_size for n in _SMALL_FILES if (path / n).exists())
    return out


def _all(value):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _save_rank(args) -> dict:
    """One world size's saves (every rank); rank 0's result: per variant, per round, per rank."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = _build_gpt(args, 0)
    held, unit = _held(model, opt)
    base = Path(args.scratch) / f"w{world}"
    dirs = {name: base / name.replace(" ", "-").replace("+", "-") for name in SAVES}
    own_group = dist.new_group(backend="gloo")  # dcp.async_save's, as phalanx's background saves
    # keep=None: the older checkpoints are removed untimed, as dcp.save's (unlinking 400 MB of
    # files takes this disk ~0.1 s, which keep=1 would add to the Checkpointer's saves alone)
    ckpts = {name: Checkpointer(dirs[name], model, opt, keep=None,
                                format="consolidated" if name == "consolidated" else "sharded")
             for name in ("consolidated", "sharded", "sharded async")}
    disk = {"bytes": b""}
    gap = [args.async_gap]
    step_gap = args.step_gap if args.step_gap >= 0 else max(_all(_forward_backward(args, model)))

    def dcp_state():
        return {"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, opt)}

    def run_async(start, finish):
        t = time.perf_counter()
        handle = start()
        returned = time.perf_counter() - t
        time.sleep(step_gap)  # the next step's forward and backward
        t = time.perf_counter()
        opt.step()  # (no gradients: it changes nothing, but waits as a step waits)
        stepped = time.perf_counter() - t
        time.sleep(max(0.0, gap[0] - step_gap))  # training goes on
        t = time.perf_counter()
        finish(handle)
        return returned, stepped, time.perf_counter() - t

    def write_disk(n):
        with open(dirs["disk write+fsync"] / f"rank{rank}", "wb") as f:
            f.write(disk["bytes"])
            f.flush()
            os.fsync(f.fileno())

    jobs = {
        "consolidated": lambda n: ckpts["consolidated"].save(0, n),
        "sharded": lambda n: ckpts["sharded"].save(0, n),
        "sharded async": lambda n: run_async(lambda: ckpts["sharded async"].save(0, n, blocking=False),
                                             lambda _: ckpts["sharded async"].wait()),
        "dcp.save": lambda n: dcp.save(dcp_state(), checkpoint_id=dirs["dcp.save"] / str(n)),
        "dcp.async_save": lambda n: run_async(
            lambda: dcp.async_save(dcp_state(), checkpoint_id=dirs["dcp.async_save"] / str(n),
                                   process_group=own_group),  # (torch's default stager)
            lambda future: future.result()),
        "disk write+fsync": write_disk,
    }
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    step = itertools.count(1)
    small: dict[str, int] = {}
    kept = 0
    times: dict[str, list] = {name: [] for name in SAVES}
    written: dict[str, list[int]] = {}
    for r in range(args.sharded_rounds + 1):  # round 0: warm-up (and the sizes, the gap)
        order = list(SAVES) if r == 0 else list(SAVES[r % len(SAVES):] + SAVES[:r % len(SAVES)])
        for name in order:
            dist.barrier()
            resident = _status("VmRSS")
            t = time.perf_counter()
            out, rise = _peak_rise(lambda: jobs[name](next(step)))
            elapsed = time.perf_counter() - t
            if r == 0 and name == "sharded async":  # its staging copy, kept for the next save
                kept = _status("VmRSS") - resident
            returned, stepped, waited = out if name in ASYNC else (elapsed, 0.0, 0.0)
            per_rank = _all({"s": returned + stepped + waited if name in ASYNC else elapsed,
                             "returned": returned, "stepped": stepped, "waited": waited, "rise": rise})
            if r:
                times[name].append(per_rank)
            if rank == 0:
                if name != "disk write+fsync":  # the older checkpoints, untimed
                    _keep_newest(dirs[name])
                # the disk quiet again (the unlinks' and the writes' journal work done): the
                # rotation puts each save after the same one, which must not leave it its work
                os.sync()
            if r == 0:
                if name != "disk write+fsync":
                    written[name] = _written(name, dirs[name], world) if rank == 0 else []
                if name == "sharded" and rank == 0:  # what rank 0 alone writes, file by file
                    path = max(dirs[name].glob("ckpt-*.dcp"))
                    small = {n: (path / n).stat().st_size for n in _SMALL_FILES}
                if name == "sharded":  # the floor writes the same bytes per rank
                    sizes = _all(_written("sharded", dirs[name], world) if rank == 0 else None)[0]
                    disk["bytes"] = torch.randint(0, 256, (sizes[rank],), dtype=torch.uint8,
                                                  generator=torch.Generator().manual_seed(rank)).numpy().tobytes()
                    written["disk write+fsync"] = sizes
                    if args.async_gap <= 0:
                        gap[0] = 2 * max(p["s"] for p in per_rank)
    ckpts["sharded async"].close()
    dist.barrier()
    if rank == 0:  # what the loads do not read
        for name in ("sharded async", "dcp.async_save", "disk write+fsync"):
            shutil.rmtree(dirs[name], ignore_errors=True)
    held_all = _all((held, unit, kept))
    return {"world": world, "times": times, "written": written, "gap": gap[0], "step_gap": step_gap,
            "rank0_small_files": small if rank == 0 else {},
            "held": [h for h, *_ in held_all], "unit": max(u for _, u, _ in held_all),
            "staging_kept": [k for *_, k in held_all]}


def _evict_tree(directory: Path) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        _evict(str(directory))
    dist.barrier()


def _load_rank(args) -> dict:
    """Load what world ``--load-from`` saved, at this world size (every rank)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    world = dist.get_world_size()
    source = Path(args.scratch) / f"w{args.load_from}"
    model, opt = _build_gpt(args, 1)

    def dcp_load():
        target = {"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, opt)}
        dcp.load(target, checkpoint_id=_newest(source / "dcp.save"))
        model.load_state_dict(target["model"])
        set_optimizer_state_dict(model, opt, target["optimizer"])

    jobs = {
        "consolidated": lambda: Checkpointer(source / "consolidated", model, opt).load(),
        "sharded": lambda: Checkpointer(source / "sharded", model, opt, format="sharded").load(),
        "dcp.load": dcp_load,
    }
    times: dict[str, list] = {name: [] for name in LOADS}
    for r in range(args.sharded_rounds + 1):
        order = list(LOADS[r % len(LOADS):] + LOADS[:r % len(LOADS)])
        for name in order:
            _evict_tree(source)
            t = time.perf_counter()
            before = _rchar()
            jobs[name]()
            read = _rchar() - before
            per_rank = _all({"s": time.perf_counter() - t, "read": read})
            if r:
                times[name].append(per_rank)
    return {"world": world, "from": args.load_from, "times": times}


def _sharded_rank(args) -> dict:
    out = {}
    if args.load_from is not None:  # first: what the ranks of another world size saved
        out["load"] = _load_rank(args)  # (the launcher's malloc thresholds: as a job runs)
    if args.save_here:
        libc = ctypes.CDLL("libc.so.6")
        # freed tensors unmapped at once, freed small blocks trimmed (not phalanx run's 1 GiB)
        if libc.mallopt(_M_MMAP_THRESHOLD, 1 << 16) != 1 or libc.mallopt(_M_TRIM_THRESHOLD, 128 << 10) != 1:
            raise OSError("mallopt(M_MMAP_THRESHOLD, M_TRIM_THRESHOLD) failed: the peak memory would "
                          "not be exact")
        out["save"] = _save_rank(args)
    return out


def _run_sharded(args, argv) -> tuple[dict, dict]:
    """One launch per world size: it loads what the previous one saved, then saves; a last
    launch of the first world size loads what the last one saved."""
    scratch = tempfile.mkdtemp(prefix="bench-ckpt-sharded-", dir=args.dir)
    saves, loads = {}, {}
    plan = [(world, args.worlds[i - 1] if i else None, True) for i, world in enumerate(args.worlds)]
    plan.append((args.worlds[0], args.worlds[-1], False))
    try:
        for world, source, save in plan:
            extra = ["--sharded-rank", "--scratch", scratch] + (["--save-here"] if save else [])
            extra += [] if source is None else ["--load-from", str(source)]
            result = launch_ranks(__file__, world, [*argv, *extra])
            if "save" in result:
                saves[world] = result["save"]
            if "load" in result:
                loads[world] = result["load"]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return saves, loads


def _median(values) -> float:
    return statistics.median(values) if values else float("nan")


def _report_sharded(args, saves: dict, loads: dict) -> dict:
    rows: dict[str, dict] = {}
    MB = 1e6
    any_save = next(iter(saves.values()))
    total = sum(any_save["written"]["sharded"])
    print(f"\nsharded checkpoints: GPT dim {args.gpt_dim} depth {args.gpt_depth}, phalanx.fully_shard, "
          f"AdamW: {total / MB:.0f} MB of state; {args.sharded_rounds} rounds, medians; a save's "
          "time is its slowest rank's")
    for world, res in saves.items():
        t = {name: [max(p["s"] for p in per_rank) for per_rank in rounds] for name, rounds in res["times"].items()}
        floor = _median(t["disk write+fsync"])
        share = total / world
        unit = res["unit"]
        shard = max(res["held"])
        print(f"\nworld {world}: floor (disk write+fsync of the sharded save's bytes) {floor:.2f} s; "
              f"a rank's shard {shard / MB:.1f} MB, one unit (largest tensor shard) {unit / MB:.2f} MB")
        print(f"{'save':<18}{'median s':>9}{'/ floor':>8}{'best s':>8}{'rank 0 MB':>10}{'/ share':>8}"
              f"{'max rank MB':>12}{'peak rise MB (per rank)':>26}")
        for name in SAVES:
            med = _median(t[name])
            written = res["written"].get(name) or [0]
            rounds_rises = [[per_rank[r]["rise"] for per_rank in res["times"][name]] for r in range(world)]
            rises = [_median(r) for r in rounds_rises]
            print(f"{name:<18}{med:>9.2f}{med / floor:>7.2f}x{min(t[name] or [float('nan')]):>8.2f}"
                  f"{written[0] / MB:>10.1f}{written[0] / share:>7.2f}x{max(written) / MB:>12.1f}"
                  f"{' '.join(f'{x / MB:.1f}' for x in rises):>26}")
            rows[f"w{world} save: {name}"] = {
                "s_median": med, "s_all": t[name], "vs_floor": med / floor, "bytes_by_rank": written,
                "rank0_vs_share": written[0] / share, "peak_rise_by_rank": rises,
                "peak_rise_rounds_by_rank": rounds_rises, "shard_by_rank": res["held"],
                "unit": unit}
        print(f"sharded async keeps its staging copy between saves (reused: no page faults): "
              f"{' '.join(f'{k / MB:.1f}' for k in res['staging_kept'])} MB resident per rank; its peak rise "
              "above is over that")
        print(f"{'async':<18}{'returns s':>10}{'step s':>8}{'waits s':>9}{'stall s':>9}{'/ blocking':>11}"
              f"   (step after {res['step_gap']:.3f} s, wait after {res['gap']:.2f} s)")
        for name, blocking in ASYNC.items():
            rounds = res["times"][name]
            returned = _median([max(p["returned"] for p in pr) for pr in rounds])
            stepped = _median([max(p["stepped"] for p in pr) for pr in rounds])
            waited = _median([max(p["waited"] for p in pr) for pr in rounds])
            stall = _median(t[name])
            ratio = stall / _median(t[blocking])
            print(f"{name:<18}{returned:>10.3f}{stepped:>8.3f}{waited:>9.3f}{stall:>9.3f}{ratio:>10.1%}")
            rows[f"w{world} stall: {name}"] = {"returned_s": returned, "step_s": stepped, "waited_s": waited,
                                               "stall_s": stall, "vs_blocking": ratio, "gap_s": res["gap"],
                                               "step_gap_s": res["step_gap"]}
        rows[f"w{world} stall: sharded async"]["staging_kept_by_rank"] = res["staging_kept"]
        goals = rows[f"w{world} save: sharded"]
        goals["rank0_small_files"] = res["rank0_small_files"]
        print("rank 0 alone writes: " + ", ".join(f"{n} {b / 1e3:.1f} kB" for n, b in res["rank0_small_files"].items()))
        print(f"goals: sharded / floor {goals['vs_floor']:.2f}x (<= 1.25 at world 4); rank 0 wrote "
              f"{written_of(res, 'sharded')[0] / MB:.1f} MB, share + unit {(share + unit) / MB:.1f} MB; "
              f"stall {rows[f'w{world} stall: sharded async']['vs_blocking']:.1%} (<= 10%); "
              f"blocking peak rise {max(goals['peak_rise_by_rank']) / MB:.2f} MB (rank 0's rounds "
              f"{min(goals['peak_rise_rounds_by_rank'][0], default=0) / MB:.2f}-"
              f"{max(goals['peak_rise_rounds_by_rank'][0], default=0) / MB:.2f}) vs unit {unit / MB:.2f} MB")
    print(f"\n{'load (from disk)':<22}{'median s':>9}{'/ dcp.load':>11}{'read MB max rank':>17}")
    for world, res in sorted(loads.items()):
        t = {name: [max(p["s"] for p in pr) for pr in rounds] for name, rounds in res["times"].items()}
        base = _median(t["dcp.load"])
        print(f"world {world}, saved at {res['from']}")
        for name in LOADS:
            read = _median([max(p["read"] for p in pr) for pr in res["times"][name]])
            med = _median(t[name])
            print(f"  {name:<20}{med:>9.2f}{med / base:>10.2f}x{read / MB:>17.1f}")
            rows[f"w{world} load from w{res['from']}: {name}"] = {"s_median": med, "s_all": t[name],
                                                                   "vs_dcp": med / base, "read_max_rank": read}
    return rows


def written_of(res: dict, name: str) -> list[int]:
    return res["written"].get(name) or [0]


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parse(argv)
    if args.rank_result:  # one of the ranks: --check-ranks's or a sharded world's
        if args.sharded_rank:  # phalanx's process group at its defaults (one host: shared memory)
            serve(_sharded_rank, args.rank_result, args, shared_memory=None)
        else:
            serve(_check_rank, args.rank_result, args.check_calls)
        return
    rows, checks = {}, {}
    if not args.skip_single:
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
        if args.check_ranks > 1:
            checks = launch_ranks(__file__, args.check_ranks, argv)
            print(f"\nPreemptionHandler.should_stop() on {args.check_ranks} Gloo ranks (loopback): "
                  + ", ".join(f"check_every={k}: {v:.1f} us/call" for k, v in checks.items()))
    if args.worlds:
        rows.update(_report_sharded(args, *_run_sharded(args, argv)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": rows, "should_stop_us": checks}, f, indent=2)


if __name__ == "__main__":
    main()
