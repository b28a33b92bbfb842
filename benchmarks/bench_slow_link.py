"""Training over a slow link: torch's hooks against phalanx's compression, local SGD and DiLoCo.

Two network namespaces joined by a veth pair whose two ends ``tc`` limits (1 Gbit/s by
default), one rank in each, started by ``phalanx run --nnodes 2`` as on two machines. Every
method trains its own copy of the model on scikit-learn's digits, all in one run, taking
turns (A B C ..., then backwards) of ``--every`` steps, so a change in load hurts them alike::

    python benchmarks/bench_slow_link.py                   # MLP (10.5M params), 1 Gbit/s, every method
    python benchmarks/bench_slow_link.py --rate 100mbit --steps 48 --repeats 1
    python benchmarks/bench_slow_link.py --loopback --model cnn --steps 120   # no namespaces

Needs root (``ip netns``, ``tc``) unless ``--loopback``, which runs both ranks on this
machine's loopback with no limit: the convergence runner (with the digits example's CNN; the
test suite runs one method for a few steps as a smoke test). For each method it reports the mean step time of the slowest rank
over the timed steps (all but ``--warmup``: mean, not median, as local SGD's steps are
cheap but every ``--every``-th), the bytes this rank's interface sent per step (netns
only: TCP/IP included), and the test accuracy after ``--steps`` steps; with ``--repeats``
the median and the range over repeats (fresh models, seed = repeat). MLP inputs are the
digits upsampled to 32x32 (1024 features). The namespaces go when the run ends, also on
Ctrl-C or a failure.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

from phalanx.bench.nodes import NodesFailed, launch_on_namespaces, raise_on_signals
from phalanx.bench.ranks import RESULT_FLAG, launch_ranks, serve

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("torch", "torch-fp16", "torch-powersgd", "phalanx", "phalanx-fp16", "phalanx-bf16",
           "phalanx-powersgd", "phalanx-localsgd", "phalanx-diloco", "phalanx-localsgd-overlap",
           "phalanx-diloco-overlap", "phalanx-alone")
# phalanx-alone: each rank trains by itself and never communicates, the floor every method's
# step time stands on (its accuracy is rank 0's model's); not in the default run.
DEFAULT_METHODS = METHODS[:-1]
# The two namespaces' names and addresses (a private /24 no test or benchmark uses otherwise).
PREFIX, SUBNET = "phxlink", "10.214.0"
NEVER = 2**62  # phalanx-alone's steps between meetings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = p.add_argument
    add("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=METHODS)
    add("--model", default="mlp", choices=("mlp", "cnn"), help="mlp: 10.5M params; cnn: the digits example's")
    add("--rate", default="1gbit", help="tc rate of each end of the link (default 1gbit)")
    add("--steps", type=int, default=96, help="training steps per method (default 96)")
    add("--warmup", type=int, default=8, help="untimed first steps (default 8)")
    add("--repeats", type=int, default=1, help="fresh runs of every method (default 1)")
    add("--batch-size", type=int, default=64, help="per rank (default 64)")
    add("--lr", type=float, default=0.02, help="SGD (momentum 0.9) learning rate (default 0.02)")
    add("--every", type=int, default=8, help="local SGD and DiLoCo: steps between meetings (default 8)")
    add("--overlap", type=int, default=None,
        help="the -overlap methods: steps a meeting runs behind before it lands (default: every / 2)")
    add("--outer-lr", type=float, default=0.7, help="DiLoCo's outer learning rate (default 0.7)")
    add("--outer-momentum", type=float, default=0.5,
        help="DiLoCo's outer Nesterov momentum (default 0.5: phalanx.DiLoCo's 0.9, the paper's, "
             "made for thousands of steps, lost 6 points of accuracy in these short runs)")
    add("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    add("--loopback", action="store_true", help="both ranks on loopback, no namespaces, no limit")
    add("--out", default=None, help="write the results as JSON here")
    add(RESULT_FLAG, dest="rank_result", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------- on each rank (torch) ----
def _example():
    """examples/train_digits.py as a module: its data split and its CNN."""
    spec = importlib.util.spec_from_file_location("train_digits", ROOT / "examples" / "train_digits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_digits(model: str):
    """(train x, train y, test x, test y); for the MLP the images are upsampled to 32x32."""
    import torch.nn.functional as F

    train, test = _example().digits(seed=0)
    tensors = [*train.tensors, *test.tensors]
    if model == "mlp":
        for i in (0, 2):
            tensors[i] = F.interpolate(tensors[i], size=32, mode="bilinear", align_corners=False).flatten(1)
        mean, std = tensors[0].mean(), tensors[0].std()  # standardised with the training set's statistics
        tensors[0], tensors[2] = (tensors[0] - mean) / std, (tensors[2] - mean) / std
    return tensors


class Method:
    """One method's model, optimizer and step."""

    def __init__(self, name: str, args: argparse.Namespace, seed: int) -> None:
        import torch
        from torch.nn.parallel import DistributedDataParallel as TorchDDP

        import phalanx
        from phalanx.bench.engine import mlp, register_hook

        impl, _, variant = name.partition("-")
        torch.manual_seed(seed)
        net = mlp() if args.model == "mlp" else _example().cnn()
        buckets = 1e6 if name == "torch-powersgd" else None  # torch's PowerSGD: one bucket on Gloo
        ddp = (TorchDDP if impl == "torch" else phalanx.DistributedDataParallel)(net, bucket_cap_mb=buckets)
        if variant in ("fp16", "bf16", "powersgd"):
            register_hook(ddp, impl, variant)
        self.model = ddp
        self.optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
        # a cosine from lr to 0 over the run, as the example's: every method ends settled
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        self.stepper = self.optimizer
        variant, _, overlapped = variant.partition("-")
        overlap = args.overlap if overlapped else 0
        if variant == "alone":
            self.stepper = phalanx.LocalSGD(ddp, self.optimizer, every=NEVER)
        elif variant == "localsgd":
            self.stepper = phalanx.LocalSGD(ddp, self.optimizer, every=args.every, overlap=overlap)
        elif variant == "diloco":
            self.stepper = phalanx.DiLoCo(ddp, self.optimizer, every=args.every, outer_lr=args.outer_lr,
                                          outer_momentum=args.outer_momentum, compress="bf16", overlap=overlap)
        self.rng = torch.get_rng_state()  # its own dropout masks, as if it ran alone

    def step(self, x, y) -> None:
        import torch
        import torch.nn.functional as F

        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self.rng)
            self.optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(self.model(x), y).backward()
            self.stepper.step()
            self.schedule.step()
            self.rng = torch.get_rng_state()

    def finish(self) -> None:
        """At the end of its turn (untimed): an overlapped meeting still under way (only the
        one begun at the last step: the turns are cut so that meetings land inside them)
        lands, so it never runs behind another method's turn."""
        if hasattr(self.stepper, "finish_meeting"):
            self.stepper.finish_meeting()

    def accuracy(self, x, y) -> float:
        import torch

        self.model.eval()
        with torch.no_grad(), _no_sync(self.model):
            correct = (self.model(x).argmax(1) == y).sum().item()
        self.model.train()
        return 100.0 * correct / len(y)


def _no_sync(model):
    return model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext()


def tx_bytes(interface: str) -> int:
    """Bytes ``interface`` has sent (/proc/net/dev of this process's network namespace)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == interface:
                return int(counters.split()[8])
    return 0


def measure(args: argparse.Namespace) -> dict:
    """On every rank: train every method, step by step in turn; rank 0's result is returned."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    x_train, y_train, x_test, y_test = load_digits(args.model)
    interface = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    out = {m: {"ms": [], "bytes": [], "accuracy": []} for m in args.methods}
    for repeat in range(args.repeats):
        methods = {m: Method(m, args, seed=repeat) for m in args.methods}
        seconds = torch.zeros(len(methods), dtype=torch.float64)
        sent = [0] * len(methods)
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(repeat))
        for turn, block in enumerate(blocks(args.steps, args.every, args.overlap)):
            for name in list(methods) if turn % 2 == 0 else list(reversed(methods)):
                i = args.methods.index(name)
                for step in block:
                    take = order[(torch.arange(args.batch_size) * world + rank + step * args.batch_size * world)
                                 % len(order)]
                    before, start = tx_bytes(interface), time.perf_counter()
                    methods[name].step(x_train[take], y_train[take])
                    if step >= args.warmup:
                        seconds[i] += time.perf_counter() - start
                        sent[i] += tx_bytes(interface) - before
                methods[name].finish()
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # a step ends when every rank's does
        timed = args.steps - args.warmup
        for i, (name, method) in enumerate(methods.items()):
            out[name]["ms"].append(1000 * seconds[i].item() / timed)
            out[name]["bytes"].append(sent[i] / timed)
            out[name]["accuracy"].append(method.accuracy(x_test, y_test))
        del methods
    return {"world_size": world, "settings": {k: v for k, v in vars(args).items() if k != "rank_result"},
            "results": out}


def blocks(steps: int, every: int, overlap: int) -> list[range]:
    """The steps cut into turns of ``every`` steps, each ending ``overlap`` steps after a
    meeting: an overlapped meeting begins and lands within one method's turn, so no method's
    communication runs behind another's compute, nor shares the link with it."""
    ends = list(range(overlap % every or every, steps, every)) + [steps]
    return [range(start, end) for start, end in zip([0] + ends, ends) if end > start]


# ------------------------------------------------------------- orchestration (no torch) ----
def run_on_namespaces(args: argparse.Namespace, argv: list[str]) -> dict:
    """Node 0 and node 1 (``phalanx run --nnodes 2``), one in each namespace; rank 0's result."""
    try:
        return launch_on_namespaces(__file__, argv, args.rate, PREFIX, SUBNET)
    except NodesFailed as e:
        hint = "" if e.codes else " (or use --loopback)"  # the namespaces failed, not the ranks
        raise SystemExit(f"bench_slow_link: {e}{hint}") from None


def summary(results: dict) -> list[dict]:
    """One row per method: medians and ranges over repeats, and the ratio to torch's plain DDP."""
    rows = []
    base = statistics.median(results["torch"]["ms"]) if "torch" in results else None
    for name, r in results.items():
        ms = statistics.median(r["ms"])
        rows.append({"method": name, "ms/step": ms, "ms range": (min(r["ms"]), max(r["ms"])),
                     "vs torch": ms / base if base else None, "MB sent/step": statistics.median(r["bytes"]) / 1e6,
                     "accuracy %": statistics.median(r["accuracy"]),
                     "accuracy range": (min(r["accuracy"]), max(r["accuracy"]))})
    return rows


def format_table(rows: list[dict]) -> str:
    lines = ["| method | ms/step | range | vs torch DDP | MB sent/step | test accuracy % (range) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "-" if r["vs torch"] is None else f"{r['vs torch']:.2f}"
        lo, hi = r["accuracy range"]
        lines.append(f"| {r['method']} | {r['ms/step']:.1f} | {r['ms range'][0]:.1f}-{r['ms range'][1]:.1f} | "
                     f"{ratio} | {r['MB sent/step']:.2f} | {r['accuracy %']:.1f} ({lo:.1f}-{hi:.1f}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.rank_result:  # a worker, started by a launcher
        serve(measure, args.rank_result, args, threads=args.threads)
        return 0
    if args.warmup >= args.steps:
        raise SystemExit(f"bench_slow_link: --warmup ({args.warmup}) must be below --steps ({args.steps})")
    if args.overlap is None:
        args.overlap = max(1, args.every // 2)
        argv = [*argv, "--overlap", str(args.overlap)]
    if any(m.endswith("-overlap") for m in args.methods) and not 0 < args.overlap < args.every:
        raise SystemExit(f"bench_slow_link: --overlap must be from 1 to --every - 1 ({args.every - 1}), "
                         f"got {args.overlap}: a longer one would run behind the other methods' turns")
    raise_on_signals()
    started = time.monotonic()
    data = launch_ranks(__file__, 2, argv) if args.loopback else run_on_namespaces(args, argv)
    rows = summary(data["results"])
    where = "loopback" if args.loopback else f"two namespaces, {args.rate} each way"
    print(f"\n{args.model}, 2 ranks ({where}), {args.steps} steps of batch {args.batch_size} per rank, "
          f"{args.repeats} repeat(s), {time.monotonic() - started:.0f} s\n")
    print(format_table(rows))
    if args.out:
        Path(args.out).write_text(json.dumps({**data, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
