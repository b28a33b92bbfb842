"""The DDP benchmark engine: models, timed training steps, interleaved comparisons.

Run inside an initialised process group (one process per rank): ``phalanx bench`` starts
``python -m phalanx.bench`` with its launcher, once alone and once on N processes, and
:mod:`phalanx.bench.report` turns the step times into its table and chart. Everything a rank
measures is a list of step times; a step is ``zero_grad``, forward, loss, backward (which,
under DDP, includes waiting for the gradient all-reduce) and an SGD step.

* :func:`compare` runs the implementations step by step in turn (A B, B A, A B, ...), each
  repeat on fresh models built from the same seed, with the same data and bucket size, so a
  noisy neighbour hurts all of them alike; it reports every step time, with and without
  gradient sync. Step i of A and step i of B ran side by side, so the median of their
  ratios (``paired_ratio``) cancels slow changes in the machine's load.
* Exposed communication is the step time minus the step time of the same implementation
  under ``no_sync()`` (no all-reduce at all): the communication the backward did not hide.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..ddp import DistributedDataParallel
from ..diagnostics import ledger
from . import fsdp
from .options import add_comm_hook_option, at_least, positive_float
from .ranks import RESULT_FLAG, serve

# "phalanx-nodiag": phalanx's DDP with its diagnostics switched off during its steps, to
# measure what the always-on checks cost (benchmarks/bench_diagnostics.py). The -fsdp ones:
# the model sharded by phalanx's or torch's fully_shard (``phalanx bench --fully-shard``).
FULLY_SHARDED = {"phalanx-fsdp": "phalanx fully_shard", "torch-fsdp": "torch fully_shard"}
IMPLEMENTATIONS = ("bare", "phalanx", "torch", "phalanx-nodiag", "torch-shm", *FULLY_SHARDED)
# The group each torch DDP runs on (None: the default group), set by _measure: "torch" on Gloo,
# "torch-shm" (torch's DDP over phalanx's shared-memory backend, the transport alone) on it.
_GROUPS: dict[str, dist.ProcessGroup | None] = {}
# PowerSGD's plain all-reduces before compressing: the least torch's hook allows (it needs > 1),
# so the timed steps (after --warmup 3) compress.
POWERSGD_START = 2


def mlp(width: int = 2048, depth: int = 3, inputs: int = 1024, classes: int = 10) -> nn.Module:
    """An MLP; the defaults give 10.5M parameters (42 MB of fp32 gradients)."""
    layers: list[nn.Module] = [nn.Linear(inputs, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def cnn(classes: int = 10) -> nn.Module:
    """A small CNN for 3x32x32 images (0.36M parameters), with BatchNorm buffers to broadcast."""

    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2)]

    return nn.Sequential(*block(3, 32), *block(32, 64), *block(64, 128), nn.Flatten(),
                         nn.Linear(128 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, classes))


def deep_mlp(width: int = 32, depth: int = 200, classes: int = 10) -> nn.Module:
    """A deep narrow MLP: 402 parameter tensors of 1 056 elements at most (0.21M parameters)."""
    return mlp(width, depth, width, classes)


class Block(nn.Module):
    """A pre-norm transformer block (causal self-attention, GELU MLP): 12 parameter tensors."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


GPT_VOCAB, GPT_TOKENS = 256, 32


class GPT(nn.Module):
    """A deep narrow GPT (24 blocks, width 64, 293 parameter tensors, 1.24M parameters) that
    returns next-token logits flattened to ``(batch * tokens, vocab)``."""

    def __init__(self, vocab: int = GPT_VOCAB, tokens: int = GPT_TOKENS, dim: int = 64,
                 depth: int = 24, heads: int = 4) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Embedding(tokens, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x)).flatten(0, 1)


# builder, batch maker (batch size, generator) -> (inputs, labels)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int, torch.Generator], tuple]]] = {
    "mlp": (mlp, lambda n, g: _classes(torch.randn(n, 1024, generator=g), n, g)),
    "cnn": (cnn, lambda n, g: _classes(torch.randn(n, 3, 32, 32, generator=g), n, g)),
    "deep-mlp": (deep_mlp, lambda n, g: _classes(torch.randn(n, 32, generator=g), n, g)),
    "gpt": (GPT, lambda n, g: (torch.randint(0, GPT_VOCAB, (n, GPT_TOKENS), generator=g),
                               torch.randint(0, GPT_VOCAB, (n * GPT_TOKENS,), generator=g))),
}


def _classes(x: torch.Tensor, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return x, torch.randint(0, 10, (n,), generator=g)


def make_batch(model: str, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random inputs and labels for ``model`` (seeded: every run sees the same data)."""
    return MODELS[model][1](batch_size, torch.Generator().manual_seed(seed))


def build(model: str, impl: str, bucket_cap_mb: float | None = None, seed: int = 0,
          comm_hook: str = "none") -> nn.Module:
    """A fresh ``model``, bare, wrapped by phalanx's or torch's DDP (``None``: their default
    buckets) with ``comm_hook`` registered (:func:`register_hook`), or sharded by phalanx's or
    torch's ``fully_shard`` (:func:`phalanx.bench.fsdp.build`)."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl must be one of {', '.join(IMPLEMENTATIONS)}, got {impl!r}")
    if impl in FULLY_SHARDED:
        return fsdp.build(FULLY_SHARDED[impl], MODELS[model][0], seed)
    torch.manual_seed(seed)
    net = MODELS[model][0]()
    if impl == "bare":
        return net
    if impl == "torch" and comm_hook == "powersgd":
        bucket_cap_mb = 1e6  # torch's PowerSGD hook runs on Gloo with a single bucket only
    if impl in ("phalanx", "phalanx-nodiag"):
        return register_hook(DistributedDataParallel(net, bucket_cap_mb=bucket_cap_mb), "phalanx",
                             comm_hook)
    ddp = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=bucket_cap_mb,
                                                    process_group=_GROUPS.get(impl))
    return register_hook(ddp, "torch", comm_hook)


def register_hook(ddp: nn.Module, impl: str, name: str) -> nn.Module:
    """``ddp`` with the hook ``name`` registered: phalanx's own (:mod:`phalanx.comm_hooks`) on
    phalanx's DDP, torch's on torch's (its bf16 hook under another name: torch's DDP refuses
    that name without NCCL, though Gloo sums bf16)."""
    if name == "none":
        return ddp
    if impl == "phalanx":
        from ..comm_hooks import by_name

        ddp.register_comm_hook(*by_name(name, start_powerSGD_iter=POWERSGD_START) if name == "powersgd"
                               else by_name(name))
        return ddp
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "powersgd":
        state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=POWERSGD_START)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif name == "bf16":
        ddp.register_comm_hook(None, lambda state, bucket: default_hooks.bf16_compress_hook(state, bucket))
    else:
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    return ddp


class Trainer:
    """One implementation's model, optimizer and batch; :meth:`step` times one training step
    and leaves the bytes the process wrote during it (its collectives) in :attr:`sent`."""

    def __init__(self, net: nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                 diagnostics: bool = True) -> None:
        self.net = net
        self.opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
        self.batch = batch
        self.diagnostics = diagnostics
        self.sent = 0

    def step(self, sync: bool = True) -> float:
        """Seconds for zero_grad, forward, loss, backward, optimizer step (``sync=False``: in
        ``no_sync()``), with this process's diagnostics on or off as the trainer says."""
        book = ledger()
        was, book.enabled = book.enabled, book.enabled and self.diagnostics
        try:
            return self._step(sync)
        finally:
            book.enabled = was

    def _step(self, sync: bool) -> float:
        x, y = self.batch
        sent, start = fsdp.sent_bytes(), time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        if sync or not hasattr(self.net, "no_sync"):
            F.cross_entropy(self.net(x), y).backward()
        else:
            with self.net.no_sync():
                F.cross_entropy(self.net(x), y).backward()
        self.opt.step()
        seconds = time.perf_counter() - start
        self.sent = fsdp.sent_bytes() - sent
        return seconds


def compare(
    model: str,
    impls: Sequence[str],
    repeats: int = 5,
    steps: int = 10,
    warmup: int = 3,
    batch_size: int = 64,
    bucket_cap_mb: float | None = None,
    with_no_sync: bool = True,
    comm_hook: str = "none",
    min_seconds: float = 0.0,
) -> dict[str, dict[str, list[float]]]:
    """Step times per implementation, and the bytes this rank wrote in each timed step with
    sync: ``{impl: {"sync": [...], "no_sync": [...], "sent": [...]}}``.

    Each repeat builds every implementation afresh from seed 0 and gives each ``warmup``
    untimed steps (torch's DDP rebuilds its buckets after the first). Then the implementations
    take turns step by step (A B, B A, A B, ...): ``steps`` timed steps each, then, if
    ``with_no_sync``, ``steps`` more under ``no_sync()``. With ``min_seconds`` (and a warm-up)
    the first repeat raises ``steps`` so that each implementation's timed steps of a repeat
    take at least that long (:func:`steps_for`), for every repeat. Every rank must call this
    with the same arguments.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    batch = make_batch(model, batch_size, seed=1 + rank)
    out: dict[str, dict[str, list[float]]] = {impl: {"sync": [], "no_sync": [], "sent": []} for impl in impls}
    modes = ["sync", "no_sync"] if with_no_sync else ["sync"]
    for _ in range(repeats):
        trainers = {impl: Trainer(build(model, impl, bucket_cap_mb, comm_hook=comm_hook), batch,
                                  impl != "phalanx-nodiag")
                    for impl in impls}
        warm = [[trainer.step() for _ in range(warmup)] for trainer in trainers.values()]
        if min_seconds > 0 and warmup and not out[impls[0]]["sync"]:  # the first repeat decides
            steps = steps_for(steps, min_seconds, max(min(times) for times in warm))
        for mode in modes:
            times: dict[str, list[float]] = {impl: [] for impl in impls}
            for i in range(steps):
                order = list(impls) if i % 2 == 0 else list(reversed(impls))
                for impl in order:
                    times[impl].append(trainers[impl].step(sync=mode == "sync"))
                    if mode == "sync":
                        out[impl]["sent"].append(trainers[impl].sent)
            for impl in impls:
                if mode == "sync" or impl != "bare":
                    out[impl][mode] += _slowest(times[impl])
    return out


def steps_for(steps: int, min_seconds: float, step_seconds: float) -> int:
    """Timed steps per repeat: at least ``steps``, and enough that ``min_seconds`` pass at
    ``step_seconds`` a step (the slowest implementation's fastest warm-up step, on the
    slowest rank: every rank gets the same count)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([step_seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        step_seconds = t.item()
    return max(steps, math.ceil(min_seconds / step_seconds)) if step_seconds > 0 else steps


def _slowest(times: list[float]) -> list[float]:
    """Each step's time on the slowest rank: a data-parallel step ends when every rank's does."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return times
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _torch_groups(impls: Sequence[str], shared_memory: bool) -> dict[str, dist.ProcessGroup | None]:
    """The groups of torch's DDPs (collective): with the default group on shared memory,
    torch's plain DDP gets a Gloo group of its own; ``torch-shm`` gets a shared-memory group
    unless the default group is one."""
    groups: dict[str, dist.ProcessGroup | None] = {}
    from .. import shm

    on_shm = shm.uses_shared_memory()
    if shared_memory and not on_shm and dist.get_world_size() > 1:
        raise RuntimeError("--shared-memory: the default group is not on shared memory (the "
                           "ranks are not all on this host, or it could not be opened)")
    if "torch" in impls and on_shm:
        groups["torch"] = dist.new_group(backend="gloo")
    if "torch-shm" in impls and not on_shm:
        groups["torch-shm"] = dist.new_group(backend=shm.BACKEND_NAME)
    return groups


def _measure(args) -> dict:
    world = dist.get_world_size()
    _GROUPS.clear()
    _GROUPS.update(_torch_groups(args.impls, args.shared_memory))
    # a sharded model has no no_sync() (set_requires_gradient_sync(False) skips the
    # reduce-scatter only, not the all-gathers): its exposed communication is not measured
    no_sync = world > 1 and not any(impl in FULLY_SHARDED for impl in args.impls)
    times = {
        model: compare(model, args.impls, args.repeats, args.steps, args.warmup,
                       args.batch_size, args.bucket_cap_mb, with_no_sync=no_sync, comm_hook=args.comm_hook,
                       min_seconds=args.min_seconds or 0.0)
        for model in args.models
    }
    param_bytes = {model: fsdp.parameter_bytes(MODELS[model][0]) for model in args.models}
    return {"world_size": world, "batch_size": args.batch_size, "times": times, "param_bytes": param_bytes}


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m phalanx.bench``: time the implementations on this group; rank 0 writes
    the step times (see :mod:`phalanx.bench.ranks`)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m phalanx.bench", description=main.__doc__)
    p.add_argument("--models", nargs="+", default=["mlp"], choices=sorted(MODELS))
    p.add_argument("--impls", nargs="+", default=["phalanx", "torch"], choices=IMPLEMENTATIONS)
    p.add_argument("--repeats", type=at_least(1), default=5)
    p.add_argument("--steps", type=at_least(1), default=10)
    p.add_argument("--warmup", type=at_least(0), default=3)
    p.add_argument("--min-seconds", type=positive_float, default=None,
                   help="more timed steps where --steps would take less (compare's min_seconds)")
    p.add_argument("--batch-size", type=at_least(1), default=64, help="per process")
    p.add_argument("--bucket-cap-mb", type=positive_float, default=None)
    add_comm_hook_option(p.add_argument)
    p.add_argument("--shared-memory", action="store_true",
                   help="the default group on phalanx's shared-memory backend (phalanx's DDP and "
                        "torch-shm run there; torch's DDP on a Gloo group of its own)")
    p.add_argument("--threads", type=at_least(1), default=1, help="torch threads per process")
    p.add_argument(RESULT_FLAG, dest="rank_result", required=True,
                   help="where rank 0 writes the step times")
    args = p.parse_args(argv)
    serve(_measure, args.rank_result, args, threads=args.threads, shared_memory=args.shared_memory)
