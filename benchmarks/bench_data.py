"""Samples/s through phalanx's StreamingDataset against a plain IterableDataset over the same
raw token files, at DataLoader workers 0 and 2.

Usage::

    python benchmarks/bench_data.py                          # 32 shards x 1000 samples x 128 tokens
    python benchmarks/bench_data.py --workers 0 2 --repeats 7 --json out.json

Variants, over the same ``.bin`` shards written once in a temporary directory, each giving
samples of one type, a 1-D tensor of ``--seq-len`` tokens, to the same ``DataLoader(data,
batch_size, num_workers, persistent_workers=num_workers > 0)``:

* "plain": an ``IterableDataset`` as users write it: each DataLoader worker takes every
  ``num_workers``-th file, opens it (buffered, Python's default) and reads its samples in file
  order (``f.read`` + ``torch.frombuffer``, uint16), no shuffle, no rank split, no resumption;
* "phalanx": ``phalanx.StreamingDataset`` (one rank), shuffled: each epoch (``set_epoch``) every
  worker computes the epoch's global order and reads its batches in that order (uint16);
* "phalanx unshuffled": the same with ``shuffle=False``;
* "HF datasets split_dataset_by_node" when ``datasets`` is installed: a generator-backed HF
  ``IterableDataset`` over the same files (read as "plain" reads them, yielding numpy arrays),
  in the torch format (int64 tensors: HF's choice), split for rank 0 of 1; without ``datasets``
  the report says it was skipped. ``datasets`` is not a dependency of phalanx or of its tests.

Each DataLoader is iterated once to warm up (workers start, files enter the page cache); then
the variants take turns, one epoch each, ``--repeats`` times. The report gives each variant's
median samples/s and the median ratio phalanx / plain over the rounds (the goal: at least
0.95). Timings mean something only on an otherwise idle machine; a busy one also slows torch's
multi-threaded operations (the main process's, with no workers) far more than plain Python.

It also gives each variant's median CPU seconds an epoch, the main process and its DataLoader
workers together (on Linux, from ``/proc``: the process's live children, every variant's
workers, the other variants' idle; the workers' times count in clock ticks, 10 ms), and the
median ratio of CPU rates, plain's CPU over phalanx's: steadier than samples/s on a shared
machine, though it does not see a pipeline's waits (with workers, the main process waiting
for a batch costs no CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import phalanx
from phalanx.streaming import TokenFiles, write_token_shards

DTYPE = torch.uint16  # GPT-2's 50257-token vocabulary fits, as in nanoGPT's shards


class PlainTokens(IterableDataset):
    """The plain baseline: files split over workers, samples read in file order."""

    def __init__(self, files: list[str], seq_len: int) -> None:
        self.files, self.sample_bytes = files, seq_len * DTYPE.itemsize

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for path in self.files[worker::workers]:
            with open(path, "rb") as f:  # buffered, as users open files
                while chunk := f.read(self.sample_bytes):
                    yield torch.frombuffer(bytearray(chunk), dtype=DTYPE)


def _hf_dataset(files: list[str], seq_len: int):
    """HF datasets' IterableDataset over the same files, split for rank 0 of 1; None without it.

    Its generator reads its share of the files (HF hands each DataLoader worker a part of the
    ``gen_kwargs`` list) as the plain baseline does and yields numpy arrays, the type HF
    documents for generators; the torch format makes them tensors (int64, HF's choice for
    integer arrays)."""
    try:
        import numpy as np
        from datasets import IterableDataset as HFIterable
        from datasets.distributed import split_dataset_by_node
    except ImportError:
        return None
    sample_bytes = seq_len * DTYPE.itemsize

    def generate(shards):
        for path in shards:
            with open(path, "rb") as f:
                while chunk := f.read(sample_bytes):
                    yield {"tokens": np.frombuffer(chunk, dtype=np.uint16)}

    data = HFIterable.from_generator(generate, gen_kwargs={"shards": files}).with_format("torch")
    return split_dataset_by_node(data, rank=0, world_size=1)


def _variants(files: list[str], shards: str, args) -> dict:
    source = TokenFiles(shards, seq_len=args.seq_len, dtype=DTYPE)
    out = {"plain": PlainTokens(files, args.seq_len)}
    for name, shuffle in (("phalanx", True), ("phalanx unshuffled", False)):
        out[name] = phalanx.StreamingDataset(source, batch_size=args.batch_size, ends="uneven",
                                             shuffle=shuffle, num_replicas=1, rank=0)
    hf = _hf_dataset(files, args.seq_len)
    if hf is not None:
        out["HF datasets split_dataset_by_node"] = hf
    return out


def _cpu_seconds() -> float | None:
    """CPU seconds of this process and its live children (DataLoader workers), or None where
    ``/proc`` does not list children (not Linux)."""
    pid = os.getpid()
    try:
        children = open(f"/proc/{pid}/task/{pid}/children").read().split()
    except OSError:
        return None
    total = time.process_time()
    for child in children:
        try:
            fields = open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()
        except OSError:  # gone
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return total


def _epoch(loader, data) -> tuple[float, int, float | None]:
    """Seconds for one epoch through ``loader``, the samples it gave, and the CPU seconds of
    this process and its workers (None where they cannot be read)."""
    if isinstance(data, phalanx.StreamingDataset):
        data.set_epoch(data.epoch + 1)
    cpu, start, samples = _cpu_seconds(), time.perf_counter(), 0
    for batch in loader:
        samples += len(batch["tokens"] if isinstance(batch, dict) else batch)
    seconds, after = time.perf_counter() - start, _cpu_seconds()
    return seconds, samples, None if cpu is None or after is None else after - cpu


def measure(args) -> dict:
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        shards = os.path.join(tmp, "shards")
        total = args.shards * args.samples_per_shard * args.seq_len
        tokens = torch.randint(0, 50257, (total,), generator=torch.Generator().manual_seed(0))
        files = write_token_shards(tokens, shards, args.seq_len, args.samples_per_shard, DTYPE)
        expected = args.shards * args.samples_per_shard
        for workers in args.workers:
            variants = _variants(files, shards, args)
            loaders = {name: DataLoader(data, batch_size=args.batch_size, num_workers=workers,
                                        persistent_workers=workers > 0)
                       for name, data in variants.items()}
            rates: dict = {name: [] for name in variants}
            cpus: dict = {name: [] for name in variants}
            for repeat in range(args.repeats + 1):  # the first round warms up (workers start)
                for name, loader in loaders.items():
                    seconds, samples, cpu = _epoch(loader, variants[name])
                    if samples != expected:
                        raise RuntimeError(f"{name} gave {samples} samples, expected {expected}")
                    if repeat:
                        rates[name].append(samples / seconds)
                        cpus[name].append(cpu)
            for name, values in rates.items():
                results[f"{name}, workers {workers}"] = {"median": statistics.median(values),
                                                         "samples_per_s": values}
            for name in ("phalanx", "phalanx unshuffled"):
                results[f"{name} / plain, workers {workers}"] = {"median": statistics.median(
                    p / q for p, q in zip(rates[name], rates["plain"]))}
            if all(c is not None for values in cpus.values() for c in values):
                for name, values in cpus.items():
                    results[f"{name} CPU s an epoch, workers {workers}"] = {
                        "median": statistics.median(values), "cpu_seconds": values}
                for name in ("phalanx", "phalanx unshuffled"):
                    ratios = [q / p for p, q in zip(cpus[name], cpus["plain"]) if p > 0]
                    results[f"{name} / plain by CPU, workers {workers}"] = {
                        "median": statistics.median(ratios)} if ratios else {
                        "median": None,
                        "absent": "no CPU time counted (epochs shorter than the clock's tick)"}
            if "HF datasets split_dataset_by_node" not in variants:
                results[f"HF datasets split_dataset_by_node, workers {workers}"] = {
                    "median": None,
                    "absent": "skipped: datasets is not installed (pip install datasets)"}
            del loaders
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shards", type=int, default=32)
    p.add_argument("--samples-per-shard", type=int, default=1000)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path, help="write the results here as JSON")
    args = p.parse_args(argv)
    results = measure(args)
    for name, row in results.items():
        median = row["median"]
        shown = row.get("absent") if median is None else (
            f"{median:.3f}" if "/" in name else f"{median:.3f} s" if "CPU s" in name
            else f"{median:,.0f} samples/s")
        print(f"{name:<60} {shown}")
    if args.json:
        args.json.write_text(json.dumps({"config": vars(args) | {"json": str(args.json)},
                                         "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
