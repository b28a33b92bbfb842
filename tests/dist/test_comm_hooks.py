"""phalanx's own communication (issue 12): 16-bit hooks that cannot overflow, PowerSGD with many
buckets on Gloo, the control tail beside a hook, local SGD and DiLoCo against a naive
reference written here, and checkpoints that resume all of them exactly."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import phalanx
from phalanx import comm_hooks
from phalanx.ledger import syncpoint
from tests.harness import error_of, run_ranks


def _net(bn=False):
    torch.manual_seed(0)
    layers = [nn.Linear(16, 48), nn.BatchNorm1d(48)] if bn else [nn.Linear(16, 48)]
    return nn.Sequential(*layers, nn.Tanh(), nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(),
                         nn.Linear(48, 4))


def _batch(rank, step, scale=1.0):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(24, 16, generator=g) * scale, torch.randint(0, 4, (24,), generator=g)


def _step(model, opt, rank, step, loss_scale=1.0):
    x, y = _batch(rank, step)
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    (loss * loss_scale).backward()
    return loss.item()


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _same_everywhere(t):
    everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, t)
    return all(torch.equal(everyone[0], other) for other in everyone)


# A cap below the smallest layer's 784 bytes: one bucket per layer, 4 buckets.
SMALL_BUCKETS_MB = 0.0007


def _compression(rank, world_size):
    out = {}
    exact = phalanx.DistributedDataParallel(_net(), bucket_cap_mb=SMALL_BUCKETS_MB)
    models = {}
    for name in ("fp16", "bf16", "torch_fp16"):
        models[name] = phalanx.DistributedDataParallel(_net(), bucket_cap_mb=SMALL_BUCKETS_MB)
        hook = default_hooks.fp16_compress_hook if name == "torch_fp16" else comm_hooks.by_name(name)[1]
        models[name].register_comm_hook(None, hook)
    out["buckets"] = len(exact.bucket_plan)
    for loss_scale in (1.0, 1e7):  # 1e7: gradients far beyond fp16's 65504
        _step(exact, torch.optim.SGD(exact.parameters(), lr=0), rank, 0, loss_scale)
        want = _grads(exact)
        for name, model in models.items():
            step = lambda: _step(model, torch.optim.SGD(model.parameters(), lr=0), rank, 0, loss_scale)  # noqa: E731
            if name == "fp16" and loss_scale > 1:
                out["fp16 jump all-reduces"] = _all_reduces(step)
            else:
                step()
            got = _grads(model)
            out[(name, loss_scale)] = (torch.isfinite(got).all().item(),
                                       ((got - want).abs().max() / want.abs().max()).item(),
                                       _same_everywhere(got))
    # the fp16 hook's all-reduces after the jump: one per bucket
    fp16, opt = models["fp16"], torch.optim.SGD(models["fp16"].parameters(), lr=0)
    out["fp16 all-reduces"] = [_all_reduces(lambda: _step(fp16, opt, rank, 1, 1e7)) for _ in range(2)]
    # a nan on rank 0 that no scale can save: sent unscaled after the agreement, nan everywhere
    out["fp16 nan all-reduces"] = _all_reduces(lambda: _step(fp16, opt, rank, 2, float("nan") if rank == 0 else 1.0))
    out["fp16 nan"] = torch.isnan(_grads(fp16)).all().item()
    fresh = phalanx.DistributedDataParallel(_net(), bucket_cap_mb=SMALL_BUCKETS_MB)
    fresh.register_comm_hook(None, comm_hooks.fp16_compress_hook)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0)
    out["fp16 first all-reduces"] = _all_reduces(lambda: _step(fresh, fresh_opt, rank, 1))
    return {**out, **_control_tail(rank)}


def _all_reduces(run):
    """The (dtype, numel) of each all-reduce ``run()`` issues through torch.distributed."""
    seen, all_reduce = [], dist.all_reduce

    def counting(tensor, *args, **kwargs):
        seen.append((str(tensor.dtype).removeprefix("torch."), tensor.numel()))
        return all_reduce(tensor, *args, **kwargs)

    with mock.patch.object(dist, "all_reduce", counting):
        run()
    return seen


class _Branches(nn.Module):
    """``a`` on every rank, ``b`` on rank 1 only, ``c`` nowhere."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, rank):
        return self.b(self.a(x)) if rank == 1 else self.a(x)


def _control_tail(rank):
    """The unused-parameter counts travel beside the hook, summed exactly."""
    out = {}
    x = torch.ones(2, 4)
    model = phalanx.DistributedDataParallel(_Branches(), find_unused_parameters=True)
    model.register_comm_hook(None, comm_hooks.bf16_compress_hook)
    model(x, rank).sum().backward()
    out["tail grads"] = [None if p.grad is None else p.grad.abs().sum().item() for p in model.module.c.parameters()]
    out["tail b"] = model.module.b.bias.grad.tolist()
    strict = phalanx.DistributedDataParallel(_Branches())
    strict.register_comm_hook(None, comm_hooks.fp16_compress_hook)
    out["tail error"] = error_of(lambda: strict(x, rank).sum().backward())
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def compression(request):
    """(world size, every rank's results) of one group of ranks running _compression."""
    return request.param, run_ranks(_compression, request.param)


def _launch_order():
    """The diagnostics' sync point; the layers' buckets in launch order (the last layer's
    first), each with its bound; the control tail (one number)."""
    sync, tail = ("float32", syncpoint.envelope_size(3)), ("float32", 1)  # the same at world 2 and 3
    buckets = [("float16", n + 1) for n in (4 * 48 + 4, 48 * 48 + 48, 48 * 48 + 48, 16 * 48 + 48)]
    return sync, tail, buckets


@pytest.mark.parametrize("scale", [1.0, 1e7])
def test_16bit_hooks_average_within_their_precision_and_never_overflow(compression, scale):
    _, results = compression
    for out in results:
        # relative to the largest gradient: fp16 keeps 11 significant bits, bf16 8; two roundings
        assert out[("fp16", scale)][0] and out[("fp16", scale)][1] < 2**-10 and out[("fp16", scale)][2]
        assert out[("bf16", scale)][0] and out[("bf16", scale)][1] < 2**-7 and out[("bf16", scale)][2]


def test_torchs_fp16_hook_is_as_precise_but_overflows(compression):
    _, results = compression
    for out in results:
        assert out[("torch_fp16", 1.0)][1] < 2**-10
        assert out[("torch_fp16", 1e7)][0] is False  # torch's fp16 hook overflows to inf


def test_the_fp16_hook_all_reduces_each_bucket_once_with_its_bound(compression):
    _, results = compression
    for out in results:
        assert out["buckets"] == 4
        # the diagnostics' sync point; the layers' buckets in launch order (the last layer's
        # first), each with its bound; the control tail (one number) before the last one
        sync, tail, buckets = _launch_order()
        assert out["fp16 all-reduces"] == [[sync, *buckets[:3], tail, buckets[3]]] * 2, out["fp16 all-reduces"]


def test_after_a_jump_each_bucket_agrees_on_a_scale_and_goes_again(compression):
    _, results = compression
    for out in results:
        sync, tail, buckets = _launch_order()
        # the 1e7 jump: every bucket's bound failed at the end of the backward; each agreed on
        # a scale (one float32 number) and went again, in bucket order
        agree = ("float32", 1)
        retries = [x for b in buckets for x in (agree, b)]
        assert out["fp16 jump all-reduces"] == [sync, *buckets[:3], tail, buckets[3], *retries], (
            out["fp16 jump all-reduces"])


def test_a_nan_on_one_rank_is_agreed_on_and_sent_unscaled(compression):
    _, results = compression
    for out in results:
        assert out["fp16 nan all-reduces"] == out["fp16 jump all-reduces"] and out["fp16 nan"] is True


def test_a_fresh_fp16_hook_agrees_on_each_buckets_scale_first(compression):
    _, results = compression
    for out in results:
        sync, tail, buckets = _launch_order()
        agree = ("float32", 1)
        # nothing remembered: each bucket first agrees on its scale (one float32 number), and
        # sends at the end of the backward
        assert out["fp16 first all-reduces"] == [sync, agree, agree, agree, tail, agree, *buckets], (
            out["fp16 first all-reduces"])


def test_the_control_tail_beside_a_16bit_hook_is_exact(compression):
    world_size, results = compression
    for out in results:
        assert out["tail grads"] == [None, None]  # no gradient on any rank: left alone
        # rank 1's gradient (2: a batch of two), averaged in bf16 (8 significant bits)
        assert all(abs(g - 2 / world_size) <= 2**-8 for g in out["tail b"]), out["tail b"]


def test_unused_parameters_under_a_16bit_hook_are_named(compression):
    _, results = compression
    for out in results:
        assert out["tail error"][0] == "UnusedParametersError"
        assert "b.weight" in out["tail error"][1] and "c.weight" in out["tail error"][1]


def _powersgd(rank, world_size):
    out = {}
    # full rank with no minimum compression rate: P Q^T is the average itself
    full = phalanx.DistributedDataParallel(_net(), bucket_cap_mb=SMALL_BUCKETS_MB)
    full.register_comm_hook(comm_hooks.PowerSGDState(None, 48, start_powerSGD_iter=0, min_compression_rate=0),
                            comm_hooks.powerSGD_hook)
    exact = phalanx.DistributedDataParallel(_net(), bucket_cap_mb=SMALL_BUCKETS_MB)
    for model in (full, exact):
        _step(model, torch.optim.SGD(model.parameters(), lr=0), rank, 0)
    out["full rank"] = ((_grads(full) - _grads(exact)).abs().max() / _grads(exact).abs().max()).item()
    # rank 2 with error feedback: what the approximations missed is kept, not lost. Summed
    # over steps: applied averages + the mean of the last errors = exact averages.
    ddp = phalanx.DistributedDataParallel(_net(), bucket_cap_mb=SMALL_BUCKETS_MB)
    state = comm_hooks.PowerSGDState(None, 2, start_powerSGD_iter=1)
    ddp.register_comm_hook(state, comm_hooks.powerSGD_hook)
    applied, exact_sum = 0, 0
    for step in range(6):
        for model in (ddp, exact):
            _step(model, torch.optim.SGD(model.parameters(), lr=0), rank, step)
        applied, exact_sum = applied + _grads(ddp), exact_sum + _grads(exact)
    errors = torch.cat([state.errors[b] for b in sorted(state.errors)])
    dist.all_reduce(errors)
    out["buckets"] = (len(ddp.bucket_plan), sorted(state.errors))
    out["compressed"] = ((applied - exact_sum).abs().max() / exact_sum.abs().max()).item()
    out["conserved"] = _conservation(ddp, state, applied, exact_sum, errors / world_size)
    out["same"] = _same_everywhere(applied)
    return out


def _conservation(ddp, state, applied, exact_sum, mean_error):
    """max |applied + mean error - exact| over the compressed matrices, relative."""
    offsets, offset = {}, 0
    for p in ddp.parameters():
        offsets[id(p)] = (offset, p.numel())
        offset += p.numel()
    worst, e = 0.0, 0
    for b, spec in enumerate(ddp.bucket_plan):
        layout = state._layouts[b]
        params = [dict(ddp.module.named_parameters())[s.name] for s in spec.slots]
        for m in layout.matrices:
            start, n = offsets[id(params[m.index])]
            residual = applied[start : start + n] + mean_error[e : e + n] - exact_sum[start : start + n]
            worst = max(worst, (residual.abs().max() / exact_sum[start : start + n].abs().max()).item())
            e += n
    return worst


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def powersgd(request):
    """(world size, every rank's results) of one group of ranks running _powersgd."""
    return request.param, run_ranks(_powersgd, request.param)


def test_powersgd_full_rank_is_exact(powersgd):
    _, results = powersgd
    for out in results:
        assert out["full rank"] < 1e-5


def test_powersgd_compresses_every_bucket(powersgd):
    _, results = powersgd
    for out in results:
        assert out["buckets"] == (4, [0, 1, 2, 3])


def test_powersgd_error_feedback_loses_nothing(powersgd):
    _, results = powersgd
    for out in results:
        assert out["compressed"] > 1e-2  # rank 2 of 48x48: lossy step by step...
        assert out["conserved"] < 1e-5  # ...but the errors hold exactly what is missing


def test_powersgd_replicas_stay_equal(powersgd):
    _, results = powersgd
    for out in results:
        assert out["same"]
