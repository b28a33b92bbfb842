"""Communication hooks meet phalanx's diagnostics and join (issue 12 after issues 11 and 13):
buckets reduced by a hook are recorded under the hook's name; under uneven inputs a rank that
has joined runs the hook on zeros, as torch's join does, with several buckets and every kind
of hook (torch's call-time hooks, torch's PowerSGD that issues from callbacks, phalanx's
phased hooks), and local SGD's meetings are sync points."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import phalanx
from phalanx import comm_hooks
from phalanx.diagnostics import ledger
from tests.harness import error_of, run_ranks

COUNTS = (5, 8, 11)  # batches of rank 0, 1, 2
# 104 bytes: a bucket closes once it holds that much, so each layer's bias (64 bytes) and
# weight share one: 4 buckets.
SMALL_BUCKETS_MB = 0.0001


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 2))


def _batches(rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)) for _ in range(n)]


def _train(model, data, join=True, **join_args):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with model.join(enable=join, **join_args):
        for x, y in data:
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _equal_everywhere(t: torch.Tensor) -> bool:
    everyone = [torch.empty_like(t) for _ in range(phalanx.get_world_size())]
    torch.distributed.all_gather(everyone, t)
    return all(torch.equal(everyone[0], other) for other in everyone)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _against_torch(rank, world_size):
    """torch's call-time hooks: phalanx's DDP (4 buckets) under phalanx's join against torch's
    DDP under torch's join, with the same hook, in both divide modes."""
    data = _batches(rank, COUNTS[rank])
    out = {}
    for name, hook in (("allreduce", default_hooks.allreduce_hook), ("fp16", default_hooks.fp16_compress_hook)):
        for divide in (True, False):
            theirs, ours = TorchDDP(_net()), phalanx.DistributedDataParallel(_net(), bucket_cap_mb=SMALL_BUCKETS_MB)
            theirs.register_comm_hook(None, hook)
            ours.register_comm_hook(None, hook)
            want = _train(theirs, data, divide_by_initial_world_size=divide)
            got = _train(ours, data, divide_by_initial_world_size=divide)
            out[name, divide] = (_rel(got, want), _rel(want, _net_params()), len(ours.bucket_plan))
    return out


def _net_params():
    return torch.cat([p.detach().flatten() for p in _net().parameters()])


def test_torchs_hooks_under_join_equal_torchs_join_with_the_hook():
    for out in run_ranks(_against_torch, 3, timeout=180):
        for (name, divide), (diff, moved, buckets) in out.items():
            assert buckets == 4, out
            assert moved > 1e-2, out  # it trained
            assert diff < (1e-6 if name == "allreduce" else 1e-3), (name, divide, out)


def _every_kind(rank, world_size):
    """Hooks of every kind on phalanx's DDP with 4 buckets under join: no hang, the replicas
    equal at the end, and (where the hook is an average of the gradients) the model of the
    join without a hook within the hook's precision."""
    data = _batches(rank, COUNTS[rank])
    plain = _train(phalanx.DistributedDataParallel(_net(), bucket_cap_mb=SMALL_BUCKETS_MB), data)
    hooks = {
        "phalanx fp16": (None, comm_hooks.fp16_compress_hook),
        "phalanx bf16": (None, comm_hooks.bf16_compress_hook),
        "phalanx powersgd": comm_hooks.by_name("powersgd", start_powerSGD_iter=2, matrix_approximation_rank=1),
        "torch powersgd": (powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2),
                           powerSGD_hook.powerSGD_hook),
    }
    out = {}
    for name, (state, hook) in hooks.items():
        ddp = phalanx.DistributedDataParallel(_net(), bucket_cap_mb=SMALL_BUCKETS_MB)
        ddp.register_comm_hook(state, hook)
        got = _train(ddp, data)
        out[name] = (_equal_everywhere(got), bool(torch.isfinite(got).all()), _rel(got, plain))
        # after the join the ranks are in step: an even step runs the hook as usual
        x, y = _batches(9, 1)[0]
        F.mse_loss(ddp(x), y).backward()
        out[name, "after"] = _equal_everywhere(torch.cat([p.grad.flatten() for p in ddp.parameters()]))
    return out


def test_every_kind_of_hook_under_join_with_several_buckets():
    for out in run_ranks(_every_kind, 3, timeout=240):
        for name in ("phalanx fp16", "phalanx bf16", "phalanx powersgd", "torch powersgd"):
            equal, finite, _ = out[name]
            assert equal and finite and out[name, "after"], (name, out)
        assert out["phalanx fp16"][2] < 1e-3, out  # joined ranks add zeros: the plain join's model
        assert out["phalanx bf16"][2] < 2e-2, out


def _recorded(rank, world_size):
    ddp = phalanx.DistributedDataParallel(_net(), bucket_cap_mb=SMALL_BUCKETS_MB)
    ddp.register_comm_hook(None, comm_hooks.bf16_compress_hook)
    x, y = _batches(rank, 1)[0]
    F.mse_loss(ddp(x), y).backward()
    ops = [r.op for r in ledger().log(None).records]
    # local SGD: a meeting is a sync point and one record; ranks at different steps are named
    model = phalanx.DistributedDataParallel(_net())
    local = phalanx.LocalSGD(model, torch.optim.SGD(model.parameters(), lr=0.1), every=2)
    local.synchronize()
    ops_local = [r.op for r in ledger().log(None).records][-2:]
    mismatch = error_of(local.synchronize if rank == 0 else lambda: phalanx.all_reduce(torch.ones(3)))
    return ops, ops_local, mismatch


def test_buckets_reduced_by_a_hook_and_local_sgd_meetings_are_in_the_collective_log():
    for ops, ops_local, mismatch in run_ranks(_recorded, 2):
        buckets = [op for op in ops if op.startswith("DDP bucket")]
        assert buckets == [f"DDP bucket {b} via bf16_compress_hook" for b in range(4)], ops
        assert ops_local == ["check before LocalSGD meeting", "LocalSGD meeting"], ops_local
        assert mismatch[0] == "CollectiveMismatchError", mismatch
        assert "rank 0 is at LocalSGD meeting" in mismatch[1], mismatch


def _iterations(rank, world_size):
    """The shadow leaves the hook's state as a step does: PowerSGD's iteration count."""
    state, hook = comm_hooks.by_name("powersgd", start_powerSGD_iter=2)
    ddp = phalanx.DistributedDataParallel(_net(), bucket_cap_mb=SMALL_BUCKETS_MB)
    ddp.register_comm_hook(state, hook)
    _train(ddp, _batches(rank, COUNTS[rank]))
    return state.iter


def test_a_joined_rank_keeps_powersgd_counting_steps():
    assert run_ranks(_iterations, 3, timeout=180) == [COUNTS[2]] * 3
