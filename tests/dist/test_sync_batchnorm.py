"""SyncBatchNorm on real ranks against BatchNorm on the concatenated batch, and its conversion.

The oracle is torch's BatchNorm on one process, in float32 beside float64 (the truth): phalanx's
SyncBatchNorm must be as close to the truth as torch's float32 BatchNorm is, measured in the
same run (``tests.oracle``), not within a constant that depends on the CPU's summation order.
"""

import contextlib
import copy
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

import phalanx
from phalanx import sync_batchnorm
from tests.harness import run_ranks
from tests.oracle import oracle_bound

STEPS = 3

# (name, per-rank batch sizes (first world_size used), trailing shape after (N, C), BN kwargs)
CASES = [
    ("1d_NC", [4, 6, 5], (), {}),
    ("1d_NCL", [3, 2, 4], (7,), {"momentum": None}),
    ("2d", [2, 3, 2], (5, 4), {}),
    ("3d", [2, 1, 2], (3, 4, 2), {"momentum": 0.3}),
    ("uneven_one_empty", [0, 5, 2], (3,), {}),
    ("no_affine", [3, 4, 2], (4, 4), {"affine": False}),
    ("no_running_stats", [2, 3, 3], (6,), {"track_running_stats": False}),
]
CHANNELS = 3


class _CollectiveCounter(contextlib.ContextDecorator):
    """Counts torch.distributed collectives issued while active (any rank-local call)."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter")

    def __enter__(self):
        self.count, self._saved = 0, {n: getattr(dist, n) for n in self.NAMES}
        for name, fn in self._saved.items():
            setattr(dist, name, self._counting(fn))
        return self

    def _counting(self, fn):
        def wrapper(*args, **kwargs):
            self.count += 1
            return fn(*args, **kwargs)
        return wrapper

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        return False


def _reference_class(dim):
    return {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[dim]


def _global_batch(sizes, trail, step, offset, device="cpu"):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(sum(sizes), CHANNELS, *trail, generator=g) * 2 + offset
    dy = torch.randn(x.shape, generator=g)
    return x.to(device), dy.to(device)


def _max_err(a, b):
    return (a - b).abs().max().item() if a.numel() else 0.0


def _note(errs, name, ours, torchs, truth):
    """Keep, for ``name``, the largest distance over the steps of phalanx's result and of
    torch's float32 one from the float64 truth, and the truth's largest value."""
    truth = truth.detach()
    seen = (_max_err(ours.detach().double(), truth), _max_err(torchs.detach().double(), truth),
            truth.abs().max().item() if truth.numel() else 0.0)
    errs[name] = tuple(max(a, b) for a, b in zip(errs.get(name, (0.0, 0.0, 0.0)), seen))


# phalanx's path rounds in more stages than torch's one-process BatchNorm (each rank's sums,
# their all-reduce, then the combination; in DDP the gradients' average besides): up to twice
# as many roundings, so up to twice the multiple of torch's distance oracle_bound allows
STAGES = 2


def _as_accurate_as_torch(errs):
    """The names whose phalanx distance from the truth exceeds :func:`oracle_bound` of torch's."""
    return {name: e for name, e in errs.items() if e[0] > oracle_bound(e[1], e[2], factor=2.0 * STAGES)}


def _run_case(rank, world_size, sizes, trail, kwargs, offset, device="cpu"):
    sizes = sizes[:world_size]
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    ours = phalanx.SyncBatchNorm(CHANNELS, **kwargs, device=device)
    ref = _reference_class(2 + len(trail))(CHANNELS, **kwargs, device=device)
    truth = _reference_class(2 + len(trail))(CHANNELS, **kwargs, device=device, dtype=torch.float64)
    if ours.affine:
        with torch.no_grad():
            for p, q, t in zip(ours.parameters(), ref.parameters(), truth.parameters()):
                p.copy_(torch.linspace(0.5, 1.5, CHANNELS, device=device))
                q.copy_(p)
                t.copy_(p)
    errs, collectives = {}, []
    for step in range(STEPS):
        x_all, dy_all = _global_batch(sizes, trail, step, offset, device)
        x_all.requires_grad_(True)
        x = x_all.detach()[lo:hi].clone().requires_grad_(True)
        with _CollectiveCounter() as counter:
            y = ours(x)
            y.backward(dy_all[lo:hi])
        collectives.append(counter.count)
        y_ref = ref(x_all)
        y_ref.backward(dy_all)
        x64 = x_all.detach().double().requires_grad_(True)
        y64 = truth(x64)
        y64.backward(dy_all.double())
        _note(errs, "out", y, y_ref[lo:hi], y64[lo:hi])
        _note(errs, "grad_in", x.grad, x_all.grad[lo:hi], x64.grad[lo:hi])
        for (name, p), q, t in zip(ours.named_parameters(), ref.parameters(), truth.parameters()):
            dist.all_reduce(p.grad)  # weight/bias grads are each rank's share; DDP would add them
            _note(errs, f"grad_{name}", p.grad, q.grad, t.grad)
        ours.zero_grad(), ref.zero_grad(), truth.zero_grad()
        for name in ("running_mean", "running_var"):
            if ours.track_running_stats:
                _note(errs, name, getattr(ours, name), getattr(ref, name), getattr(truth, name))
    ours.eval(), ref.eval(), truth.eval()
    x_all, _ = _global_batch(sizes, trail, STEPS, offset, device)
    with _CollectiveCounter() as counter:
        y = ours(x_all[lo:hi]).detach()
    # running stats when tracked; without them eval uses each rank's own batch, as torch's does
    y_ref = ref(x_all)[lo:hi] if ref.track_running_stats else ref(x_all[lo:hi])
    x64 = x_all.double()
    y64 = truth(x64)[lo:hi] if truth.track_running_stats else truth(x64[lo:hi])
    _note(errs, "eval_out", y, y_ref, y64)
    tracked = None if ours.num_batches_tracked is None else ours.num_batches_tracked.item()
    return {"errs": errs, "collectives": collectives, "eval_collectives": counter.count,
            "tracked": tracked}


def _large_mean(rank, world_size):
    """Mean 1e4, std 2: statistics against float64 truth, outputs as good as torch's float32 BN."""
    sizes = [8] * world_size
    x_all, _ = _global_batch(sizes, (16,), 0, 1e4)
    ours = phalanx.SyncBatchNorm(CHANNELS, momentum=1.0)  # running stats = this batch's
    y = ours(x_all[8 * rank : 8 * rank + 8]).detach().double()
    truth = nn.BatchNorm1d(CHANNELS, momentum=1.0).double()
    y64 = truth(x_all.double()).detach()[8 * rank : 8 * rank + 8]
    y32 = nn.BatchNorm1d(CHANNELS)(x_all).detach().double()[8 * rank : 8 * rank + 8]
    rel = lambda a, b: ((a.double() - b) / b).abs().max().item()
    return {"mean_rel": rel(ours.running_mean, truth.running_mean),
            "var_rel": rel(ours.running_var, truth.running_var),
            "out_err": _max_err(y, y64), "torch_out_err": _max_err(y32, y64)}


def _subgroup(rank, world_size):
    """Statistics pooled over ranks 0 and 1 only, with the last rank outside the group."""
    group = dist.new_group([0, 1])  # every rank must call new_group
    if rank > 1:
        return None
    x_all, _ = _global_batch([4, 4], (5,), 7, 0.5)
    y = phalanx.SyncBatchNorm(CHANNELS, process_group=group)(x_all[4 * rank : 4 * rank + 4])
    y_ref = nn.BatchNorm1d(CHANNELS)(x_all)[4 * rank : 4 * rank + 4]
    y64 = nn.BatchNorm1d(CHANNELS, dtype=torch.float64)(x_all.double())[4 * rank : 4 * rank + 4]
    errs = {}
    _note(errs, "out", y, y_ref, y64)
    return errs


def _eval_like_torch(rank):
    """Eval mode against torch's SyncBatchNorm (which runs on CPU in eval mode): no sync, also
    without running statistics, where both normalise with this rank's own batch."""
    x = torch.randn(3 + rank, CHANNELS, 4) * (rank + 1)
    out = {}
    for track in (True, False):
        ours = phalanx.SyncBatchNorm(CHANNELS, track_running_stats=track).eval()
        theirs = nn.SyncBatchNorm(CHANNELS, track_running_stats=track).eval()
        with _CollectiveCounter() as counter:
            y = ours(x)
        out[track] = (_max_err(y.detach(), theirs(x).detach()), counter.count)
    return out


def _all_cases(rank, world_size):
    out = {name: _run_case(rank, world_size, sizes, trail, kwargs, offset=0.5)
           for name, sizes, trail, kwargs in CASES}
    out["eval_like_torch"] = _eval_like_torch(rank)
    out["large_mean"] = _large_mean(rank, world_size)
    out["subgroup"] = _subgroup(rank, world_size) if world_size == 3 else None
    # one value per channel over all ranks: every rank raises alike, nobody hangs
    bn = phalanx.SyncBatchNorm(CHANNELS)
    try:
        bn(torch.randn(1 if rank == 0 else 0, CHANNELS))
    except ValueError as e:
        out["single_value"] = str(e)
    return out


def _check_case(rank, out, name, kwargs):
    case = out[name]
    assert not _as_accurate_as_torch(case["errs"]), (rank, name, _as_accurate_as_torch(case["errs"]))
    # one all-reduce forward, one backward; eval communicates nothing
    assert case["collectives"] == [2] * STEPS, (rank, name)
    assert case["eval_collectives"] == 0, (rank, name)
    assert case["tracked"] == (STEPS if kwargs.get("track_running_stats", True) else None)


def _check_cases(rank, out):
    for name, _sizes, _trail, kwargs in CASES:
        _check_case(rank, out, name, kwargs)


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def all_cases(request):
    """(world size, every rank's results) of one group of ranks running _all_cases."""
    return request.param, run_ranks(_all_cases, request.param)


# the checks that need three ranks: the world3 group above, the world2 one has no results for them
ON_3_RANKS = pytest.mark.parametrize("all_cases", [3], indirect=True, ids=["world3"])


@pytest.mark.parametrize("name, kwargs", [(name, kwargs) for name, _, _, kwargs in CASES],
                         ids=[name for name, *_ in CASES])
def test_matches_batchnorm_on_the_concatenated_batch(all_cases, name, kwargs):
    _, results = all_cases
    for rank, out in enumerate(results):
        _check_case(rank, out, name, kwargs)


@ON_3_RANKS
def test_a_subgroup_pools_the_statistics_of_its_ranks_only(all_cases):
    world_size, results = all_cases
    for rank, out in enumerate(results):
        if world_size == 3 and rank < 2:
            assert not _as_accurate_as_torch(out["subgroup"]), out["subgroup"]


def test_a_large_mean_keeps_the_statistics_exact(all_cases):
    _, results = all_cases
    for out in results:
        big = out["large_mean"]
        # float32 sums of squares would be off by ~100% here (E[x^2] ~ 1e8, var ~ 4)
        assert big["mean_rel"] <= 1e-7 and big["var_rel"] <= 1e-5, big
        assert big["out_err"] <= 2 * big["torch_out_err"], big


def test_one_value_per_channel_over_all_ranks_raises_on_every_rank(all_cases):
    _, results = all_cases
    for rank, out in enumerate(results):
        assert "Expected more than 1 value per channel when training, got 1 value per channel " \
            "over all ranks" in out["single_value"], rank


def test_eval_mode_equals_torchs_without_communicating(all_cases):
    _, results = all_cases
    for rank, out in enumerate(results):
        for track, (err, collectives) in out["eval_like_torch"].items():
            assert err == 0.0 and collectives == 0, (rank, track, err, collectives)  # torch's arithmetic


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4, momentum=None), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2),
    )


def _train_in_ddp(rank, world_size, sizes, broadcast_buffers):
    """phalanx DDP over a converted CNN vs the plain CNN on the concatenated batch."""
    lo, hi, total = sum(sizes[:rank]), sum(sizes[: rank + 1]), sum(sizes)
    ref = _cnn()
    truth = copy.deepcopy(ref).double()  # the same model in float64
    model = phalanx.DistributedDataParallel(
        phalanx.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(ref)),
        broadcast_buffers=broadcast_buffers,
    )
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref, truth)]
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x, target = torch.randn(total, 3, 6, 6, generator=g), torch.randn(total, 2, generator=g)
        for opt in opts:
            opt.zero_grad()
        # DDP averages over ranks: scale each rank's sum so the average is the global mean loss
        ((model(x[lo:hi]) - target[lo:hi]) ** 2).sum().mul(world_size / total).backward()
        ((ref(x) - target) ** 2).sum().div(total).backward()
        ((truth(x.double()) - target.double()) ** 2).sum().div(total).backward()
        for opt in opts:
            opt.step()
    errs = {}
    state, expected, exact = model.module.state_dict(), ref.state_dict(), truth.state_dict()
    for k in expected:
        _note(errs, k, state[k].double(), expected[k].double(), exact[k].double())
    model.eval(), ref.eval(), truth.eval()
    x = torch.randn(5, 3, 6, 6, generator=torch.Generator().manual_seed(99))
    _note(errs, "eval_out", model(x), ref(x), truth(x.double()))
    return errs


def _ddp_cases(rank, world_size):
    return {flag: _train_in_ddp(rank, world_size, [3, 0, 4], flag) for flag in (True, False)}


@pytest.fixture(scope="module")
def ddp_cases():
    """Every rank's results of one group of 3 ranks running _ddp_cases."""
    return run_ranks(_ddp_cases, 3)


@pytest.mark.parametrize("flag", [True, False], ids=["broadcast_buffers=True", "broadcast_buffers=False"])
def test_inside_phalanx_ddp_with_and_without_broadcast_buffers(ddp_cases, flag):
    for rank, out in enumerate(ddp_cases):
        errs = out[flag]
        # 7 layers x (weight, bias), 3 BNs x 3 buffers, the eval output
        assert len(errs) == 24, errs
        # torch's distance taken over the whole model: the first conv's bias, which a BatchNorm
        # follows, has a true gradient of zero, so it holds rounding noise alone, small or large
        # by chance in either order of summation (torch's was 3e-8 on one Intel CPU, phalanx's
        # 2e-7, within the model's 1.4e-6); a wrong divisor or a lost gradient moves every
        # parameter by ~1e-2
        scale = max(torch_distance for _, torch_distance, _ in errs.values())
        wrong = {name: e for name, e in errs.items() if e[0] > oracle_bound(scale, e[2], factor=2.0 * STAGES)}
        assert not wrong, (rank, flag, wrong)


def _cuda_cases(rank, world_size):
    phalanx.init_process_group(backend="nccl")  # pins this rank to cuda:LOCAL_RANK
    try:
        device = torch.device("cuda", torch.cuda.current_device())
        return {name: _run_case(rank, world_size, sizes, trail, kwargs, 0.5, device)
                for name, sizes, trail, kwargs in CASES}
    finally:
        phalanx.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs CUDA and 2 GPUs (NCCL)")
def test_cuda_nccl_matches_batchnorm():
    for rank, out in enumerate(run_ranks(_cuda_cases, 2, init=False)):
        _check_cases(rank, out)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 1)
        self.bn = nn.BatchNorm2d(4, momentum=None)
        self.inner = nn.Sequential(nn.Sequential(nn.BatchNorm3d(2, affine=False)))


def _nested_model():
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("stem", nn.BatchNorm1d(5, eps=1e-3))
    model.add_module("block", _Block())
    model.add_module("f64", nn.BatchNorm1d(3).double())
    model.add_module("torch_sync", nn.SyncBatchNorm(6, track_running_stats=False))
    if sync_batchnorm._TAKES_BIAS:  # torch's BatchNorm takes bias= (2.13's does, 2.11's does not)
        model.add_module("no_bias", nn.BatchNorm2d(2, bias=False))
    model.add_module("head", nn.Linear(5, 2))
    for i, m in enumerate(model.modules()):
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            with torch.no_grad():
                for t in list(m.parameters()) + [b for b in m.buffers() if b.is_floating_point()]:
                    t.copy_(torch.rand_like(t) + 0.5)
            if m.num_batches_tracked is not None:
                m.num_batches_tracked.fill_(7 + i)
    model.block.bn.weight.requires_grad_(False)
    model.block.eval()
    return model


def _describe(model):
    return {
        name: (type(m).__name__, m.training, m.eps, m.momentum, m.affine, m.track_running_stats)
        for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
    }


def test_convert_sync_batchnorm_keeps_every_value():
    model = _nested_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = {name: (id(p), p.requires_grad, p.dtype) for name, p in model.named_parameters()}
    modes = _describe(model)
    head, conv = model.head, model.block.conv
    group = object()  # passed through untouched; never used without a process group
    converted = phalanx.SyncBatchNorm.convert_sync_batchnorm(model, process_group=group)
    assert converted is model and model.head is head and model.block.conv is conv
    after = _describe(model)
    assert set(after) == set(modes) and len(after) == 5 + sync_batchnorm._TAKES_BIAS
    for name, (kind, *rest) in after.items():
        assert kind == "SyncBatchNorm" and type(model.get_submodule(name)) is phalanx.SyncBatchNorm
        assert rest == list(modes[name][1:]), name
        assert model.get_submodule(name).process_group is group
    state = model.state_dict()
    assert list(state) == list(before)
    for key, value in before.items():
        assert state[key].dtype == value.dtype and torch.equal(state[key], value), key
    assert {n: (id(p), p.requires_grad, p.dtype) for n, p in model.named_parameters()} == params
    bare = phalanx.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm1d(4))
    assert type(bare) is phalanx.SyncBatchNorm and bare.num_features == 4
    # as torch's: any _BatchNorm (a custom one too), and its qconfig carried over
    custom = _CustomNorm(3)
    custom.qconfig = "qconfig"
    converted = phalanx.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(custom, nn.ReLU()))
    assert type(converted[0]) is phalanx.SyncBatchNorm and converted[0].qconfig == "qconfig"
    assert converted[0].weight is custom.weight


class _CustomNorm(nn.modules.batchnorm._BatchNorm):
    def _check_input_dim(self, input):
        pass


def test_a_torch_whose_batchnorm_takes_no_bias_argument(monkeypatch):
    """As on torch 2.11: SyncBatchNorm is built without bias= (its BatchNorm has a bias when
    affine), and bias=False is refused naming torch's version."""
    plain = nn.Sequential(nn.BatchNorm1d(4))
    monkeypatch.setattr(sync_batchnorm, "_TAKES_BIAS", False)
    real = nn.modules.batchnorm._BatchNorm.__init__

    def without_bias(self, *args, **kwargs):
        assert "bias" not in kwargs, kwargs
        real(self, *args, **kwargs)

    monkeypatch.setattr(nn.modules.batchnorm._BatchNorm, "__init__", without_bias)
    bn = phalanx.SyncBatchNorm(3)
    assert bn.bias is not None and bn.bias.shape == (3,)
    converted = phalanx.SyncBatchNorm.convert_sync_batchnorm(plain)
    assert isinstance(converted[0], phalanx.SyncBatchNorm)
    with pytest.raises(TypeError, match=rf"bias=False\) needs torch's BatchNorm bias argument, which "
                                        rf"torch {re.escape(torch.__version__)} lacks"):
        phalanx.SyncBatchNorm(3, bias=False)


def test_single_process_is_plain_batchnorm():
    """No process group: BatchNorm on the local batch, in training and eval mode."""
    assert not dist.is_initialized()
    torch.manual_seed(1)
    ours, ref = phalanx.SyncBatchNorm(3, momentum=None), nn.BatchNorm2d(3, momentum=None)
    for train in (True, True, False):
        ours.train(train), ref.train(train)
        x = torch.randn(4, 3, 2, 2)
        assert torch.equal(ours(x), ref(x))
    assert torch.equal(ours.running_var, ref.running_var) and ours.num_batches_tracked == 2
    with pytest.raises(ValueError, match=r"expected at least 2D input \(N, C, \*\), got 1D input"):
        ours(torch.randn(3))
    with pytest.raises(ValueError, match=r"expected 3 channels in dimension 1, got .* shape \(2, 4\)"):
        ours(torch.randn(2, 4))
