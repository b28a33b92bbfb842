"""What the one-GPU checks share: the device, a small model, per-rank data, a training loop that
records every step's gradients, and how two runs are compared.

A check runs on every rank and returns ``{"limits": {label: (value, limit)}, "info": {...}}``:
each ``value`` must be ``<= limit`` (a relative difference against torch's oracle, or 0/1 for
a fact that must hold); ``info`` is reported, never asserted (whether a match was bit for bit).
"""

from __future__ import annotations

import copy
import os
import traceback
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

# "1" in the environment of the process that starts the ranks (it is read at import): the
# shared-GPU checks run their logic on the CPU, where streams and autocast do not apply; for
# working on the checks without a GPU (tools/gpu_check.py --rehearse-on-cpu sets it).
ON_CPU_VAR = "PHALANX_GPU_CHECKS_ON_CPU"
ON_CPU = os.environ.get(ON_CPU_VAR) == "1"
# Two ranks share the one GPU: every tensor of every rank lives on cuda:0, whatever LOCAL_RANK.
DEV = torch.device("cpu") if ON_CPU else torch.device("cuda", 0)
DEVICE_IDS = None if ON_CPU else [0]
# As tests/dist/test_ddp_equivalence.py: parameters agree within 1e-5 relative (max-norm).
TOL = 1e-5
# Where tools/gpu_check.py asks the checks to write their numbers (the report's detail).
RESULTS_VAR = "PHALANX_GPU_CHECK_RESULTS"
NEEDS_CUDA = "needs CUDA (one GPU is enough): run tools/gpu_check.sh on a GPU machine"


class Net(nn.Module):
    """An MLP with LayerNorm and a branch a forward may skip (an unused parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.norm = nn.Linear(16, 64), nn.LayerNorm(64)
        self.branch, self.out = nn.Linear(64, 64), nn.Linear(64, 4)

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = F.gelu(self.norm(self.inp(x)))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.out(h)


def net(device: torch.device = DEV) -> Net:
    torch.manual_seed(0)
    return Net().to(device)


def batch(rank: int, step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of step ``step``, on the CPU (DDP moves it with device_ids)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 16, generator=g) * (1 + rank), torch.randint(0, 4, (n,), generator=g)


def loss_of(model: nn.Module, rank: int, step: int, **kwargs: Any) -> torch.Tensor:
    x, y = batch(rank, step)
    return F.cross_entropy(model(x.to(DEV), **kwargs), y.to(DEV))


def flat_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().float()
                      for p in model.parameters()])


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().float() for p in model.parameters()])


def train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: int = 3,
          backward: Callable[[nn.Module, int, int], None] | None = None) -> list[torch.Tensor]:
    """``steps`` optimizer steps; each step's gradients, then the parameters, flat."""
    seen = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        if backward is None:
            loss_of(model, rank, step).backward()
        else:
            backward(model, rank, step)
        seen.append(flat_grads(model))
        opt.step()
    sync()
    return seen + [flat_params(model)]


def sync() -> None:
    """Wait for the GPU (step times, results read on the host)."""
    if not ON_CPU:
        torch.cuda.synchronize()


def rel_diff(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> float:
    """The largest difference, relative to the largest value, over paired tensors."""
    return max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in zip(ours, theirs))


def bitwise(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(ours, theirs))


def pair(run: Callable[[nn.Module], list[torch.Tensor]], ddp_kwargs: dict | None = None,
         model: nn.Module | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor], nn.Module]:
    """``run`` on phalanx's DDP and on torch's, built alike from the same model on cuda:0;
    the two records, and phalanx's DDP."""
    import phalanx

    base = net() if model is None else model
    kwargs = dict(device_ids=DEVICE_IDS, **(ddp_kwargs or {}))
    ours = phalanx.DistributedDataParallel(copy.deepcopy(base), **kwargs)
    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), **kwargs)
    return run(ours), run(theirs), ours


def against_torch(ours: list[torch.Tensor], theirs: list[torch.Tensor], limit: float = TOL,
                  label: str = "vs torch") -> dict[str, Any]:
    """The usual result: within ``limit`` of torch's, and whether bit for bit."""
    return {"limits": {label: (rel_diff(ours, theirs), limit)},
            "info": {f"{label} bitwise": bitwise(ours, theirs)}}


def run_checks(checks: dict[str, Callable[..., dict]], *args: Any) -> dict[str, dict]:
    """Every check in turn; one that raises is reported with its traceback and the rest go on."""
    out = {}
    for name, check in checks.items():
        try:
            out[name] = check(*args)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
        sync()
    return out


def assert_check(results: list[dict[str, dict]], name: str) -> None:
    """Check ``name`` held on every rank: no error, every value within its limit."""
    for rank, per_rank in enumerate(results):
        got = per_rank[name]
        assert "error" not in got, f"rank {rank}, {name}:\n{got['error']}"
        failed = {label: v for label, v in got["limits"].items() if not v[0] <= v[1]}
        assert not failed, f"rank {rank}, {name}: {failed} (info: {got.get('info')})"


def save_results(part: str, results: Any) -> None:
    """Write the raw results beside tools/gpu_check.py's report, when it asked for them."""
    directory = os.environ.get(RESULTS_VAR)
    if not directory:
        return
    import json

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"{part}.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
