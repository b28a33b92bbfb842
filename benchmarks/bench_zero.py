"""Optimizer-state memory and step time: unsharded Adam, phalanx ZeRO, torch's ZeRO; then
gradient + state memory and training-step time under phalanx DDP: Adam, ZeRO stage 1, stage 2.

Usage::

    python benchmarks/bench_zero.py                      # world size 2, one host
    python benchmarks/bench_zero.py --gloo               # everything on Gloo
    python benchmarks/bench_zero.py --width 2048 --rounds 11 --json zero.json

Each rank builds the same MLP three times, one per optimizer, with the same fixed gradients,
and takes one warm-up step with each (Adam creates its state on the first step). Then, for
``--rounds`` rounds, each optimizer in turn (the order rotating every round, A B C, B C A, ...)
runs ``--steps`` timed ``step()`` calls. A round's time is the slowest rank's, since a step is
done only when every replica has its parameters; the table shows medians over rounds.
``step()`` includes the parameter broadcast for both ZeRO variants; gradients are given, so
no backward pass or gradient all-reduce is timed. phalanx runs at its defaults (on one host
its shared-memory backend), torch's ZeRO on Gloo (a group of its own), as each one's users run
them; ``--gloo`` puts phalanx on Gloo too. State memory is the bytes of the tensors in
each rank's (local) optimizer state.

The second table times whole training steps (``zero_grad``, forward, backward, ``step``) of
the same MLP in phalanx DDP (``gradient_as_bucket_view=True``) on ``--batch`` random rows per
rank, with unsharded Adam (``ddp_adam``), phalanx ZeRO (``ddp_zero1``) and phalanx ZeRO with
``ddp.shard_gradients(opt)`` (``ddp_zero2``), rotated the same way. Gradient memory is
``ddp.gradient_bytes()`` right after a backward: ``.grad`` plus the bucket buffers kept.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

import phalanx
from phalanx.bench.ranks import RESULT_FLAG, add_gloo_option, run_script, slowest, torch_group, transport
from phalanx.zero import ZeroRedundancyOptimizer, optimizer_state_bytes

VARIANTS = ("unsharded", "phalanx_zero", "torch_zero")
TRAIN_VARIANTS = ("ddp_adam", "ddp_zero1", "ddp_zero2")


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", "--world_size", type=int, default=2)
    p.add_argument("--width", type=int, default=1024, help="hidden size of the MLP (default 1024)")
    p.add_argument("--layers", type=int, default=4, help="Linear(width, width) layers (default 4)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per optimizer (default 7)")
    p.add_argument("--steps", type=int, default=5, help="step() calls per round (default 5)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--batch", type=int, default=32, help="rows per rank per training step (default 32)")
    add_gloo_option(p.add_argument)
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument(RESULT_FLAG, dest="rank_result", help="(set by the script for its ranks)")
    return p.parse_args(argv)


def _model(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]
    model = torch.nn.Sequential(*layers)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    return model


def _optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = list(model.parameters())
    if name == "unsharded":
        return torch.optim.Adam(params, lr=1e-3)
    if name == "phalanx_zero":
        return ZeroRedundancyOptimizer(params, torch.optim.Adam, lr=1e-3)
    return TorchZero(params, optimizer_class=torch.optim.Adam, process_group=torch_group(), lr=1e-3)


def _trainer(name: str, args: argparse.Namespace):
    """(DDP model, optimizer) for one of TRAIN_VARIANTS."""
    ddp = phalanx.DistributedDataParallel(_model(args), gradient_as_bucket_view=True)
    if name == "ddp_adam":
        return ddp, torch.optim.Adam(ddp.parameters(), lr=1e-3)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=1e-3)
    if name == "ddp_zero2":
        ddp.shard_gradients(opt)
    return ddp, opt


def _train_step(ddp, opt, x: torch.Tensor) -> int:
    """One training step; returns the gradient bytes held right after the backward."""
    opt.zero_grad()
    ddp(x).pow(2).mean().backward()
    held = ddp.gradient_bytes()
    opt.step()
    return held


def _local_state_bytes(name: str, opt: torch.optim.Optimizer) -> int:
    # torch's ZeRO keeps its shard in .optim and leaves its own .state empty.
    return optimizer_state_bytes(opt.optim if name == "torch_zero" else opt)



def _rank(args: argparse.Namespace) -> dict:
    opts = {name: _optimizer(name, _model(args)) for name in VARIANTS}
    for opt in opts.values():
        opt.step()  # warm-up: creates the state
    memory = {name: [None] * args.world_size for name in VARIANTS}
    for name, opt in opts.items():
        dist.all_gather_object(memory[name], _local_state_bytes(name, opt))
    times = {name: [] for name in VARIANTS}
    for r in range(args.rounds):
        for name in VARIANTS[r % 3:] + VARIANTS[: r % 3]:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                opts[name].step()
            times[name].append(slowest(time.perf_counter() - start) / args.steps)
    del opts
    return {"memory": memory, "times": times, "train": _time_training(args), "transport": transport()}


def _time_training(args: argparse.Namespace) -> dict:
    """Per-rank gradient and state bytes, and median training-step times, of TRAIN_VARIANTS."""
    world = args.world_size
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(dist.get_rank()))
    trainers = {name: _trainer(name, args) for name in TRAIN_VARIANTS}
    out = {name: {"grad": [None] * world, "state": [None] * world, "times": []} for name in TRAIN_VARIANTS}
    for name, (ddp, opt) in trainers.items():
        held = _train_step(ddp, opt, x)  # warm-up: creates the optimizer state
        dist.all_gather_object(out[name]["grad"], held)
        dist.all_gather_object(out[name]["state"], optimizer_state_bytes(opt))
    for r in range(args.rounds):
        for name in TRAIN_VARIANTS[r % 3:] + TRAIN_VARIANTS[: r % 3]:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                _train_step(*trainers[name], x)
            out[name]["times"].append(slowest(time.perf_counter() - start) / args.steps)
    return out


def _mib(values: list[int]) -> str:
    return " / ".join(f"{v / 2**20:.1f}" for v in values)


def _report_training(args: argparse.Namespace, train: dict) -> dict:
    base = statistics.median(train["ddp_adam"]["times"]) * 1e3
    print(f"\ntraining step under phalanx DDP (gradient_as_bucket_view=True), {args.batch} rows per rank")
    print(f"{'variant':<14}{'grad MiB per rank':>22}{'state MiB per rank':>22}"
          f"{'step ms (median)':>18}{'vs ddp_adam':>13}")
    rows = {}
    for name in TRAIN_VARIANTS:
        r = train[name]
        ms = statistics.median(r["times"]) * 1e3
        rows[name] = {"grad_bytes_per_rank": r["grad"], "state_bytes_per_rank": r["state"],
                      "step_ms_median": ms, "step_ms_all": [t * 1e3 for t in r["times"]]}
        print(f"{name:<14}{_mib(r['grad']):>22}{_mib(r['state']):>22}{ms:>18.2f}{ms / base:>12.2f}x")
    return rows


def _report(args: argparse.Namespace, result: dict) -> dict:
    memory, times = result["memory"], result["times"]
    base_mem = max(memory["unsharded"])
    base_ms = statistics.median(times["unsharded"]) * 1e3
    n_params = args.layers * (args.width * args.width + args.width)
    print(f"world size {args.world_size}, {result['transport']}, MLP {args.layers} x Linear({args.width}, {args.width}) "
          f"= {n_params / 1e6:.1f} M params, Adam, {args.rounds} rounds x {args.steps} steps, "
          f"{args.threads} thread(s) per rank")
    print(f"{'optimizer':<14}{'state MiB per rank':>24}{'vs unsharded':>14}"
          f"{'step ms (median)':>18}{'vs unsharded':>14}")
    rows = {}
    for name in VARIANTS:
        ms = statistics.median(times[name]) * 1e3
        rows[name] = {"state_bytes_per_rank": memory[name], "step_ms_median": ms,
                      "step_ms_all": [t * 1e3 for t in times[name]]}
        print(f"{name:<14}{_mib(memory[name]):>24}"
              f"{max(memory[name]) / base_mem:>13.2f}x{ms:>18.2f}{ms / base_ms:>13.2f}x")
    return rows


def _report_both(args: argparse.Namespace, result: dict) -> dict:
    rows = _report(args, result)
    rows["training"] = _report_training(args, result["train"])
    return rows


def main(argv=None) -> None:
    run_script(__file__, argv, _parse, _rank, _report_both)


if __name__ == "__main__":
    main()
