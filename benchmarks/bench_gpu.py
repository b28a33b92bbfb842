"""phalanx's DDP against torch's DDP on one GPU: a GPT-style model, bf16 autocast, eager and compiled.

Two setups, each with both wrappers in the same processes, built from the same seed, fed the
same tokens, stepping in turn (phalanx, torch, torch, phalanx, ...; paired and alternating, so a
noisy neighbour slows both alike):

``gloo2``
    Two ranks sharing the GPU over Gloo (NCCL refuses two ranks on one device): every gradient
    all-reduce goes through host memory and loopback TCP.
``nccl1``
    One rank on NCCL. torch's DDP runs its reducer at world size 1 (bucket copies and a
    one-rank all-reduce); phalanx's builds none (``ddp/runtime.py``, ``Runtime``), so this
    setup measures what torch's reducer costs at world size 1 against no reducer at all.

``eager`` wraps the model as it is; ``compiled`` wraps ``torch.compile(model)`` in each DDP
(the same compiled graph under both wrappers, gradients all-reduced by their hooks after the
compiled backward). A step is ``zero_grad``, forward and loss under
``torch.autocast(..., torch.bfloat16)``, backward, a fused AdamW step, then a device
synchronisation; a rank's step time is the slowest rank's. Reported: each wrapper's median
and the median of the paired ratios phalanx/torch (below 1: phalanx is faster)::

    python benchmarks/bench_gpu.py --out runs/bench-gpu                    # both setups, both modes
    python benchmarks/bench_gpu.py --out DIR --setups gloo2 --modes eager  # one part alone
    python benchmarks/bench_gpu.py --smoke --out DIR                       # tiny, CPU and Gloo
    python benchmarks/bench_gpu.py --report DIR                            # the table of DIR's results

tools/gpu_check.py runs each (setup, mode) alone under its own time limit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from phalanx.bench.ranks import RESULT_FLAG, launch_ranks, serve

# setup -> (processes, backend); --smoke runs them on the CPU, over Gloo.
SETUPS = {"gloo2": (2, "gloo"), "nccl1": (1, "nccl")}
MODES = ("eager", "compiled")
IMPLS = ("phalanx", "torch")
# GPT-2 small's shape (12 blocks, width 768, 12 heads), with a smaller vocabulary and context
# so that both wrappers' replicas fit the time: ~92M parameters, 2048 tokens a rank a step.
SIZES = {
    "gpt": dict(blocks=12, width=768, heads=12, vocab=8192, context=256, batch=8),
    "smoke": dict(blocks=2, width=32, heads=2, vocab=64, context=16, batch=2),
}


def _gpt(blocks: int, width: int, heads: int, vocab: int, context: int):
    """A GPT-style decoder: token and position embeddings, pre-norm blocks (causal attention,
    4x GELU MLP), a head tied to the token embedding."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, width // heads).transpose(1, 3).unbind(2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, width))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(context, width)
            self.blocks = nn.Sequential(*(Block() for _ in range(blocks)))
            self.ln = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab, bias=False)
            self.head.weight = self.tokens.weight

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(idx.shape[1], device=idx.device)
            return self.head(self.ln(self.blocks(self.tokens(idx) + self.positions(pos))))

    return GPT()


class Trainer:
    """One wrapper's model, optimizer and tokens; :meth:`step` times one training step."""

    def __init__(self, impl: str, size: dict, device, compiled: bool, rank: int) -> None:
        import torch

        import phalanx

        torch.manual_seed(0)
        net = _gpt(**{k: v for k, v in size.items() if k != "batch"}).to(device)
        if compiled:
            net = torch.compile(net)
        wrap = phalanx.DistributedDataParallel if impl == "phalanx" else torch.nn.parallel.DistributedDataParallel
        self.model = wrap(net, device_ids=[device.index] if device.type == "cuda" else None)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=device.type == "cuda")
        g = torch.Generator().manual_seed(1 + rank)
        tokens = torch.randint(0, size["vocab"], (size["batch"], size["context"] + 1), generator=g)
        self.x, self.y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
        self.device = device

    def _sync(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)

    def step(self) -> float:
        import torch
        import torch.nn.functional as F

        self._sync()
        start = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            logits = self.model(self.x)
        F.cross_entropy(logits.flatten(0, 1).float(), self.y.flatten()).backward()
        self.opt.step()
        self._sync()
        return time.perf_counter() - start


def _slowest(times: list[float]) -> list[float]:
    """Each step's time on the slowest rank: a data-parallel step ends when every rank's does."""
    import torch
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return times
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a CPU tensor: the setups that span ranks are Gloo
    return t.tolist()


def measure(args: argparse.Namespace) -> dict:
    """On every rank: both wrappers, ``--warmup`` untimed steps each, then ``--steps`` timed
    steps in turn."""
    import torch
    import torch.distributed as dist

    device = torch.device("cpu") if args.smoke else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # both ranks of gloo2 on the one GPU
    size = SIZES["smoke" if args.smoke else "gpt"]
    rank = dist.get_rank()
    trainers = {impl: Trainer(impl, size, device, args.mode == "compiled", rank) for impl in IMPLS}
    first = {impl: [t.step() for _ in range(args.warmup)] for impl, t in trainers.items()}
    times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    for i in range(args.steps):
        for impl in IMPLS if i % 2 == 0 else reversed(IMPLS):
            times[impl].append(trainers[impl].step())
    times = {impl: _slowest(t) for impl, t in times.items()}
    ddp = trainers["phalanx"].model
    return {
        "setup": args.setup, "mode": args.mode, "world_size": dist.get_world_size(),
        "backend": dist.get_backend(), "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "size": size,
        "parameters": sum(p.numel() for p in ddp.parameters()),
        "phalanx_buckets": len(ddp.bucket_plan), "torch_reducer": hasattr(trainers["torch"].model, "reducer"),
        "warmup_s": first, "times_s": times,
        "median_s": {impl: statistics.median(t) for impl, t in times.items()},
        "paired_ratio": statistics.median(a / b for a, b in zip(times["phalanx"], times["torch"])),
    }


def _worker(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--setup", required=True)
    p.add_argument("--mode", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--smoke", action="store_true")
    p.add_argument(RESULT_FLAG, dest="rank_result", required=True)
    args = p.parse_args(argv)
    backend = "gloo" if args.smoke else SETUPS[args.setup][1]
    serve(measure, args.rank_result, args, threads=args.threads, backend=backend)


def run(out: Path, setups: list[str], modes: list[str], steps: int, warmup: int, smoke: bool) -> None:
    """Each (setup, mode) on its own processes; each result written to ``out`` as it comes."""
    out.mkdir(parents=True, exist_ok=True)
    threads = 1 if smoke else 4  # 4 cores a rank on the lent machine's 16, 1 on a shared CPU box
    for setup in setups:
        for mode in modes:
            argv = ["--worker", "--setup", setup, "--mode", mode, "--steps", str(steps), "--warmup",
                    str(warmup), "--threads", str(threads)] + (["--smoke"] if smoke else [])
            began = time.monotonic()
            result = launch_ranks(__file__, SETUPS[setup][0], argv)
            result["wall_s"] = time.monotonic() - began
            (out / f"{setup}-{mode}.json").write_text(json.dumps(result, indent=1))
            print(f"bench_gpu: {setup} {mode} done in {result['wall_s']:.0f} s", flush=True)


def report(directory: Path) -> str:
    """The table of the results in ``directory`` (a missing (setup, mode) is left out)."""
    rows = ["| setup | mode | backend, ranks | phalanx ms | torch ms | phalanx/torch (paired median) "
            "| phalanx buckets | first step phalanx / torch s |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for path in sorted(directory.glob("*.json")):
        r = json.loads(path.read_text())
        med, first = r["median_s"], r["warmup_s"]
        rows.append(f"| {r['setup']} | {r['mode']} | {r['backend']}, {r['world_size']} | "
                    f"{1e3 * med['phalanx']:.1f} | {1e3 * med['torch']:.1f} | {r['paired_ratio']:.3f} | "
                    f"{r['phalanx_buckets']} | {first['phalanx'][0]:.1f} / {first['torch'][0]:.1f} |")
    if len(rows) == 2:
        return f"no benchmark results in {directory}"
    r = json.loads(sorted(directory.glob("*.json"))[0].read_text())
    return "\n".join([f"{r['device']}, torch {r['torch']}, {r['parameters'] / 1e6:.1f}M parameters, "
                      f"model {r['size']}"] + rows)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        _worker(argv[1:])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="where each (setup, mode)'s JSON goes")
    p.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--steps", type=int, default=None, help="timed steps each (default 10; smoke 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps each (default 2; smoke 1)")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU over Gloo")
    p.add_argument("--report", type=Path, metavar="DIR", help="print the table of DIR's results")
    args = p.parse_args(argv)
    if args.report:
        print(report(args.report))
        return 0
    if args.out is None:
        p.error("--out is required (or --report DIR)")
    # torch's DDP rebuilds its buckets after its first step, and compiling takes the first: 2
    # untimed steps; 10 timed ones give a median of 10 pairs within the part's time limit.
    steps = args.steps or (3 if args.smoke else 10)
    warmup = args.warmup or (1 if args.smoke else 2)
    modes = args.modes if not args.smoke or "--modes" in argv else ["eager"]
    run(args.out, args.setups, modes, steps, warmup, args.smoke)
    print(report(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
