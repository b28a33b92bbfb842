"""DistributedDataParallel(mixed_precision=torch's _MixedPrecision): bf16 compute around fp32
masters, gradients reduced in reduce_dtype, bit for bit.

The oracle is a data-parallel step written by hand, without DDP: fp32 master parameters, a
bf16 copy of each for the forward and backward (``torch.func.functional_call``, inputs cast
to bf16), each gradient cast up to fp32 (accumulated in fp32 over micro-batches), copied
into flat buffers of the reduce dtype laid out as ``ddp.bucket_plan`` says (the last one
with the reducer's one-element control tail: Gloo's sum order depends on the buffer's
length), divided by the world size and all-reduced; the fp32 masters step with AdamW.
phalanx must give the same bits for 3 steps.

Communication hooks and ZeRO stages 1 and 2 are compared, bit for bit, with what their users
write today: the same cast by hand in the module's forward, under phalanx's DDP in fp32.

torch's own DDP with ``mixed_precision`` cannot be the oracle here: on CPU its forward fails
("cpu backend doesn't support events"), asserted below so the comparison is added when it runs.

One group of ranks per world size (2 and 3) runs every check; the tests assert on its results.
"""

from __future__ import annotations

import io
import tempfile
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.nn.parallel.distributed import _MixedPrecision
from torch.utils.checkpoint import checkpoint

import phalanx
from phalanx.zero import ZeroRedundancyOptimizer
from tests.harness import error_of, run_ranks

BF16, FP32 = torch.bfloat16, torch.float32
STEPS = 3
LR = 1e-2


class Net(nn.Module):
    def __init__(self, seed: int = 0, recompute: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp, self.mid, self.out = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.recompute = recompute  # activation checkpointing of the middle layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = checkpoint(self.mid, h, use_reentrant=False) if self.recompute else self.mid(h)
        return self.out(torch.tanh(h))


class HandCast(nn.Module):
    """Mixed precision as written by hand today: a bf16 copy of each parameter at each forward."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lows = {n: p.to(BF16) for n, p in self.net.named_parameters()}
        return torch.func.functional_call(self.net, lows, (x.to(BF16),))


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def loss_of(output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output.float(), y)


class Reference:
    """The hand-written data-parallel mixed-precision step (see the module notes)."""

    def __init__(self, reduce_dtype: torch.dtype, plan: list) -> None:
        self.net = Net()
        self.masters = dict(self.net.named_parameters())
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=LR)
        self.reduce_dtype, self.plan = reduce_dtype, plan

    def backward(self, x: torch.Tensor, y: torch.Tensor) -> None:
        lows = {n: p.detach().to(BF16).requires_grad_() for n, p in self.masters.items()}
        loss_of(torch.func.functional_call(self.net, lows, (x.to(BF16),)), y).backward()
        for n, p in self.masters.items():
            up = lows[n].grad.to(FP32)
            p.grad = up if p.grad is None else p.grad + up

    def average(self, world_size: int) -> None:
        for b, spec in enumerate(self.plan):
            flat = torch.zeros(spec.numel + (b == len(self.plan) - 1), dtype=self.reduce_dtype)
            for s in spec.slots:
                flat[s.offset:s.offset + s.numel].copy_(self.masters[s.name].grad.reshape(-1))
            flat.div_(world_size)
            dist.all_reduce(flat)
            for s in spec.slots:
                self.masters[s.name].grad = flat[s.offset:s.offset + s.numel].view(s.shape).to(FP32)


def _max_diff(a, b) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a, b))


def _against_reference(rank, world_size, mp, accum=1, set_to_none=True, **ddp_kwargs):
    """3 AdamW steps of phalanx's DDP and of the Reference; what differs, and what each holds."""
    recompute = ddp_kwargs.pop("recompute", False)
    ddp = phalanx.DistributedDataParallel(Net(recompute=recompute), mixed_precision=mp, **ddp_kwargs)
    opt = torch.optim.AdamW(ddp.parameters(), lr=LR)
    ref = Reference(mp.reduce_dtype or mp.param_dtype, ddp.bucket_plan)
    out = {"grad_diff": [], "param_diff": [], "outputs": set(), "params": set(), "grads": set(), "bytes": []}
    initial = [p.detach().clone() for p in ddp.parameters()]
    for step in range(STEPS):
        for micro in range(accum):
            x, y = batch(step, micro, rank)
            with ddp.no_sync() if micro < accum - 1 else nullcontext():
                output = ddp(x)
                loss_of(output, y).backward()
            out["outputs"].add(output.dtype)
            ref.backward(x, y)
        ref.average(world_size)
        out["params"] |= {p.dtype for p in ddp.parameters()}
        out["grads"] |= {p.grad.dtype for p in ddp.parameters()}
        out["grad_diff"].append(_max_diff([p.grad for p in ddp.parameters()], [p.grad for p in ref.net.parameters()]))
        out["bytes"].append(ddp.gradient_bytes())
        for o in (opt, ref.opt):
            o.step()
            o.zero_grad(set_to_none=set_to_none)
        out["param_diff"].append(_max_diff(ddp.parameters(), ref.net.parameters()))
    out["moved"] = _max_diff(ddp.parameters(), initial)
    out["numel"] = sum(p.numel() for p in ddp.parameters())
    # the buckets, and the last one's control tail: one element (none with one process)
    out["bucket_bytes"] = sum(spec.nbytes for spec in ddp.bucket_plan) + sum(
        spec.dtype.itemsize for spec in ddp.bucket_plan[-1:])
    return out


CASES = {
    "bf16_params_fp32_reduce": dict(mp=_MixedPrecision(param_dtype=BF16, reduce_dtype=FP32), bucket_cap_mb=1e-3),
    "bf16_reduce": dict(mp=_MixedPrecision(param_dtype=BF16), set_to_none=False),
    "fp32_reduce_no_views_zeros": dict(mp=_MixedPrecision(param_dtype=BF16, reduce_dtype=FP32),
                                       gradient_as_bucket_view=False, set_to_none=False),
    "no_sync_fp32_reduce": dict(mp=_MixedPrecision(param_dtype=BF16, reduce_dtype=FP32), accum=3),
    "no_sync_bf16_reduce": dict(mp=_MixedPrecision(param_dtype=BF16, reduce_dtype=BF16), accum=2),
    "checkpointed_layer": dict(mp=_MixedPrecision(param_dtype=BF16, reduce_dtype=FP32), recompute=True),
}


def _against_hand_cast(rank, world_size, hook=None, zero=0):
    """phalanx's mixed precision against HandCast under phalanx's fp32 DDP, with the same comm
    hook or ZeRO stage: the largest difference in gradients and parameters over 3 steps."""
    mp = _MixedPrecision(param_dtype=BF16, reduce_dtype=FP32)
    pair = [phalanx.DistributedDataParallel(Net(), mixed_precision=mp, bucket_cap_mb=1e-3),
            phalanx.DistributedDataParallel(HandCast(Net()), bucket_cap_mb=1e-3)]
    opts = []
    for ddp in pair:
        if hook is not None:
            ddp.register_comm_hook(*hook)
        if zero:
            # stage 1 with the parameters as views into ZeRO's buffers: the masters are those views
            opt = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=LR,
                                          parameters_as_bucket_view=zero == 1)
            if zero == 2:
                ddp.shard_gradients(opt)
        else:
            opt = torch.optim.AdamW(ddp.parameters(), lr=LR)
        opts.append(opt)
    grad_diff, held = 0.0, set()
    for step in range(STEPS):
        x, y = batch(step, 0, rank)
        for ddp in pair:
            loss_of(ddp(x), y).backward()
        held |= {n for n, p in pair[0].module.named_parameters() if p.grad is not None}
        for p, q in zip(*(ddp.parameters() for ddp in pair)):
            assert (p.grad is None) == (q.grad is None)
            if p.grad is not None:
                grad_diff = max(grad_diff, (p.grad - q.grad).abs().max().item())
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return {"grad_diff": grad_diff, "param_diff": _max_diff(*(ddp.parameters() for ddp in pair)),
            "held": sorted(held)}


def _checkpoints(rank, world_size, directory):
    """State dicts and phalanx.Checkpointer hold the fp32 masters, also mid-accumulation and
    after an evaluation forward; a run resumed from a checkpoint continues bit for bit."""
    mp = _MixedPrecision(param_dtype=BF16, reduce_dtype=BF16)

    def replica(seed):
        ddp = phalanx.DistributedDataParallel(Net(seed), mixed_precision=mp)
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=LR)

    ddp, opt = replica(0)
    out = {}
    for step in range(2):
        x, y = batch(step, 0, rank)
        with ddp.no_sync():
            loss_of(ddp(x), y).backward()
        out.setdefault("mid_accumulation", set()).update(v.dtype for v in ddp.state_dict().values())
        loss_of(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    x, y = batch(9, 0, rank)
    with ddp.no_sync():
        loss = loss_of(ddp(x), y)
        with torch.no_grad():
            ddp(x)  # an evaluation between a forward and its backward: the bf16 copies stay
        loss.backward()  # its graph saved them
    out["eval_between"] = {v.dtype for v in ddp.state_dict().values()}
    ddp(x)  # a forward whose graph is thrown away...
    with torch.no_grad():
        ddp(x)  # ...waits for no backward: the masters come back after this one
    out["after_eval"] = {v.dtype for v in ddp.state_dict().values()}
    opt.zero_grad()
    ckpt = phalanx.Checkpointer(directory, ddp, opt)
    ckpt.save(epoch=0, step=2)
    buffer = io.BytesIO()
    torch.save(ddp.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    out["saved"] = {v.dtype for v in saved.values()}
    out["saved_equal"] = all(torch.equal(saved[k], v) for k, v in ddp.state_dict().items())
    resumed, resumed_opt = replica(7)
    phalanx.Checkpointer(directory, resumed, resumed_opt).load()
    for ours in ((ddp, opt), (resumed, resumed_opt)):
        x, y = batch(5, 0, rank)
        loss_of(ours[0](x), y).backward()
        ours[1].step()
    out["resumed_diff"] = _max_diff(ddp.parameters(), resumed.parameters())
    return out


def _buffers(rank, world_size):
    """buffer_dtype casts floating-point buffers, once (torch's rule); integer ones stay."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    mp = _MixedPrecision(param_dtype=BF16, buffer_dtype=BF16)
    ddp = phalanx.DistributedDataParallel(model, mixed_precision=mp)
    output = ddp(torch.randn(5, 4) + rank)
    output.float().sum().backward()
    return {name: str(b.dtype) for name, b in ddp.module.named_buffers()} | {"output": str(output.dtype)}


class Sparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.lin = nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb(ids).mean(1))


def _corners(rank, world_size):
    """Sparse gradients, backward(create_graph=True), a backward not through the outputs:
    (dtype, .grad's dtype, .grad sparse or with a graph) of every parameter after each."""
    out = {}
    for reduce_dtype in (FP32, BF16):
        mp = _MixedPrecision(param_dtype=BF16, reduce_dtype=reduce_dtype)
        ddp = phalanx.DistributedDataParallel(Sparse(), mixed_precision=mp)
        ddp(torch.tensor([[1, 2], [3, rank]])).float().sum().backward()
        out["sparse", reduce_dtype] = {(p.dtype, p.grad.dtype, p.grad.is_sparse) for p in ddp.parameters()}
        ddp = phalanx.DistributedDataParallel(Net(), mixed_precision=mp)
        with pytest.warns(UserWarning, match="higher-order gradients are not averaged"):
            loss_of(ddp(batch(0, 0, rank)[0]), batch(0, 0, rank)[1]).backward(create_graph=True)
        out["graph", reduce_dtype] = {(p.dtype, p.grad.dtype, p.grad.requires_grad) for p in ddp.parameters()}
        ddp = phalanx.DistributedDataParallel(Net(), mixed_precision=mp)
        ddp(batch(0, 0, rank)[0])  # its output is left alone: only the reducer can restore the masters
        sum((p.float() ** 2).sum() for p in ddp.parameters()).backward()
        out["params_only", reduce_dtype] = {(p.dtype, p.grad.dtype) for p in ddp.parameters()}
    return out


def _refusals(rank, world_size):
    def ddp(mp):
        return phalanx.DistributedDataParallel(Net(), mixed_precision=mp)

    out = {
        "dict": error_of(ddp, {"param_dtype": BF16}),
        "int_params": error_of(ddp, _MixedPrecision(param_dtype=torch.int32)),
        "int_reduce": error_of(ddp, _MixedPrecision(reduce_dtype=torch.int64)),
        "string": error_of(ddp, _MixedPrecision(param_dtype="bf16")),
        # one rank reduces in bf16, the others in fp32: every rank raises
        "ranks_differ": error_of(ddp, _MixedPrecision(param_dtype=BF16, reduce_dtype=BF16 if rank == 1 else FP32)),
        # torch's, as the oracle that could not be (see the module notes)
        "torch_int_params": error_of(TorchDDP, Net(), mixed_precision=_MixedPrecision(param_dtype=torch.int32)),
        "torch_dict": error_of(TorchDDP, Net(), mixed_precision={"param_dtype": BF16}),
        "torch_string": error_of(TorchDDP, Net(), mixed_precision=_MixedPrecision(param_dtype="bf16")),
    }
    mixed = _MixedPrecision(param_dtype=BF16, reduce_dtype=FP32)
    out["torch_forward"] = error_of(lambda: TorchDDP(Net(), mixed_precision=mixed)(torch.randn(2, 8)))
    return out


def _all_checks(rank, world_size, directory):
    out = {name: _against_reference(rank, world_size, **case) for name, case in CASES.items()}
    out["hook_phalanx_bf16"] = _against_hand_cast(rank, world_size, (None, phalanx.comm_hooks.bf16_compress_hook))
    out["hook_torch_allreduce"] = _against_hand_cast(rank, world_size, (None, default_hooks.allreduce_hook))
    out["zero1"] = _against_hand_cast(rank, world_size, zero=1)
    out["zero2"] = _against_hand_cast(rank, world_size, zero=2)
    out["checkpoints"] = _checkpoints(rank, world_size, directory)
    out["buffers"] = _buffers(rank, world_size)
    out["refusals"] = _refusals(rank, world_size)
    out["corners"] = _corners(rank, world_size)
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def ranks(request):
    """(world size, every rank's results) of one group of ranks running all checks."""
    with tempfile.TemporaryDirectory() as directory:
        yield request.param, run_ranks(_all_checks, request.param, directory, timeout=240)


@pytest.mark.parametrize("name", list(CASES))
def test_equals_the_hand_written_mixed_precision_step_bit_for_bit(ranks, name):
    _, results = ranks
    for rank, out in enumerate(r[name] for r in results):
        assert out["grad_diff"] == [0.0] * STEPS and out["param_diff"] == [0.0] * STEPS, (name, rank, out)
        assert out["moved"] > 1e-3, (name, rank, "training changed nothing: the test would prove nothing")
        assert out["outputs"] == {BF16}, (name, out["outputs"])  # the forward computed in bf16
        assert out["params"] == {FP32} and out["grads"] == {FP32}, (name, out)  # what the optimizer sees


def test_gradient_as_bucket_view_holds_a_slot_as_grad_only_where_the_dtypes_match(ranks):
    _, results = ranks
    for out in results:
        numel = out["bf16_reduce"]["numel"]
        assert out["bf16_reduce"]["bucket_bytes"] == 2 * (numel + 1)  # bf16 buckets
        for name in ("bf16_params_fp32_reduce", "bf16_reduce", "fp32_reduce_no_views_zeros"):
            bucket_bytes = out[name]["bucket_bytes"]
            assert out[name]["bytes"] == [{
                "bf16_params_fp32_reduce": bucket_bytes,  # .grad is the fp32 slot: one copy
                "bf16_reduce": 4 * numel + bucket_bytes,  # fp32 .grad of its own
                "fp32_reduce_no_views_zeros": 4 * numel + bucket_bytes,
            }[name]] * STEPS, name


@pytest.mark.parametrize("name", ["hook_phalanx_bf16", "hook_torch_allreduce", "zero1", "zero2"])
def test_comm_hooks_and_zero_equal_the_cast_written_by_hand(ranks, name):
    world_size, results = ranks
    for out in (r[name] for r in results):
        assert out["grad_diff"] == 0.0 and out["param_diff"] == 0.0, (name, out)
    held = [r[name]["held"] for r in results]
    if name == "zero2":  # no rank held every gradient (each holds its own, and the last bucket's)
        assert all(len(h) < 6 for h in held) and len(set().union(*held)) == 6, held
    else:
        assert all(len(h) == 6 for h in held), held


def test_checkpoints_hold_the_fp32_masters_and_resume_bit_for_bit(ranks):
    _, results = ranks
    for out in (r["checkpoints"] for r in results):
        assert out["mid_accumulation"] == out["eval_between"] == out["after_eval"] == out["saved"] == {FP32}
        assert out["saved_equal"] and out["resumed_diff"] == 0.0


def test_buffers_are_cast_to_buffer_dtype_except_integers(ranks):
    _, results = ranks
    for out in (r["buffers"] for r in results):
        assert out == {"1.running_mean": "torch.bfloat16", "1.running_var": "torch.bfloat16",
                       "1.num_batches_tracked": "torch.int64", "output": "torch.bfloat16"}


def test_bad_mixed_precision_is_refused_on_every_rank_with_torchs_words(ranks):
    _, results = ranks
    for out in (r["refusals"] for r in results):
        assert out["torch_dict"] == ("AttributeError", "'dict' object has no attribute 'param_dtype'")
        kind, message = out["dict"]
        assert kind == "TypeError" and message.startswith("'dict' object has no attribute 'param_dtype'")
        assert out["torch_int_params"] == ("RuntimeError",
                                           "Only Tensors of floating point and complex dtype can require gradients")
        kind, message = out["int_params"]
        assert kind == "ValueError" and message.startswith(out["torch_int_params"][1])
        assert "mixed_precision.param_dtype must be a floating-point dtype" in message and "torch.int32" in message
        kind, message = out["int_reduce"]
        assert kind == "ValueError" and "mixed_precision.reduce_dtype must be a floating-point dtype" in message
        assert out["torch_string"] == ("TypeError", "zeros_like(): argument 'dtype' must be torch.dtype, not str")
        assert out["string"] == ("TypeError", "argument 'dtype' must be torch.dtype, not str (torch's words): "
                                              "mixed_precision.param_dtype must be a torch.dtype or None, got 'bf16'")
        kind, message = out["ranks_differ"]
        assert kind == "RankMismatchError" and "mixed_precision=(param_dtype=torch.bfloat16, reduce_dtype=" in message


def test_torchs_ddp_mixed_precision_does_not_run_on_cpu(ranks):
    # the oracle this file would use, if it ran: when this fails, compare with it
    _, results = ranks
    for out in (r["refusals"] for r in results):
        kind, message = out["torch_forward"] or (None, None)
        if kind == "AcceleratorError" and "CUDA driver version is insufficient" in message:
            # a CUDA build of torch (2.11's) on a machine without a driver: its DDP's
            # construction calls torch.Stream(), and never reaches the CPU forward
            pytest.skip(f"torch {torch.__version__}'s DDP with mixed_precision cannot be built here: "
                        f"{message.splitlines()[0]}")
        assert (kind, message) == ("RuntimeError", "cpu backend doesn't support events.")


def test_sparse_gradients_create_graph_and_backwards_past_the_outputs_end_in_fp32(ranks):
    _, results = ranks
    for out in (r["corners"] for r in results):
        for reduce_dtype in (FP32, BF16):
            assert out["sparse", reduce_dtype] == {(FP32, FP32, True), (FP32, FP32, False)}
            assert out["graph", reduce_dtype] == {(FP32, FP32, True)}
            assert out["params_only", reduce_dtype] == {(FP32, FP32)}


def _one_process(rank, world_size):
    # one process: no reducer; the forward still computes in bf16 around the fp32 masters
    return _against_reference(rank, world_size, _MixedPrecision(param_dtype=BF16, reduce_dtype=FP32), accum=2)


def test_one_process_computes_in_bf16_around_fp32_masters():
    (out,) = run_ranks(_one_process, 1)
    assert out["grad_diff"] == [0.0] * STEPS and out["param_diff"] == [0.0] * STEPS, out
    assert out["outputs"] == {BF16} and out["params"] == out["grads"] == {FP32}, out
