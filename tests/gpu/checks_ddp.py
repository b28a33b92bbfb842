"""DDP on CUDA tensors, two ranks sharing cuda:0 over Gloo, against torch's DDP doing the same:
plain, many buckets, a side stream, no_sync, unused parameters, communication hooks (torch's
and phalanx's), autocast with a GradScaler. Each function is one check (see common.py)."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from phalanx import comm_hooks
from tests.gpu.common import DEV, ON_CPU, TOL, against_torch, batch, loss_of, pair, rel_diff, sync, train

# One bucket holds the whole model (torch's PowerSGD hook needs one bucket on Gloo).
ONE_BUCKET_MB = 100
# 4 KB: the 64x64 layer's gradient (16 KB) alone in its bucket, so the model has several.
SMALL_BUCKET_MB = 0.004
# One unit in the last place of the dtype a hook sums in (tests/dist/test_comm_hooks_torch.py).
ULP = {"fp16": 2**-10, "bf16": 2**-7}


def _adam(model):
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def ddp_equivalence(rank: int) -> dict[str, Any]:
    ours, theirs, ddp = pair(lambda m: train(m, _adam(m), rank))
    out = against_torch(ours, theirs)
    out["limits"]["grads on cuda:0"] = (float(not all(p.grad.device == DEV for p in ddp.parameters())), 0)
    return out


def many_buckets(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {"limits": {}, "info": {}}
    for view in (False, True):
        kwargs = dict(bucket_cap_mb=SMALL_BUCKET_MB, gradient_as_bucket_view=view)
        ours, theirs, ddp = pair(lambda m: train(m, _sgd(m), rank), kwargs)
        part = against_torch(ours, theirs, label=f"bucket view {view}")
        out["limits"].update(part["limits"])
        out["info"].update(part["info"])
        out["limits"][f"several buckets, view {view}"] = (float(len(ddp.bucket_plan) < 2), 0)
        out["info"]["buckets"] = len(ddp.bucket_plan)
    return out


def side_stream(rank: int) -> dict[str, Any]:
    """Forward, backward and step on a stream of the script's own, as a user overlapping data
    loading may do: the reducer must order its copies and all-reduces after that stream's work."""
    if ON_CPU:
        return {"limits": {}, "info": {"skipped": "no streams on the CPU"}}

    def on_stream(model):
        stream = torch.cuda.Stream(DEV)
        stream.wait_stream(torch.cuda.current_stream(DEV))
        with torch.cuda.stream(stream):
            record = train(model, _sgd(model), rank)
        torch.cuda.current_stream(DEV).wait_stream(stream)
        return record

    ours, theirs, _ = pair(on_stream, dict(bucket_cap_mb=SMALL_BUCKET_MB))
    return against_torch(ours, theirs)


def no_sync(rank: int) -> dict[str, Any]:
    def accumulate(model, rank, step):
        with model.no_sync():
            loss_of(model, rank, 10 + step).backward()
        loss_of(model, rank, step).backward()

    ours, theirs, _ = pair(lambda m: train(m, _adam(m), rank, backward=accumulate))
    return against_torch(ours, theirs)


def unused_parameters(rank: int) -> dict[str, Any]:
    def sometimes(model, rank, step):  # the branch unused on one rank, or on both (step 2)
        loss_of(model, rank, step, use_branch=(step + rank) % 2 == 0 and step != 2).backward()

    ours, theirs, _ = pair(lambda m: train(m, _adam(m), rank, steps=4, backward=sometimes),
                           dict(find_unused_parameters=True))
    return against_torch(ours, theirs)


def _renamed(hook):
    """``hook`` under another name: torch's DDP refuses hooks named bf16_compress_hook without
    NCCL, though Gloo sums bf16 (tests/dist/test_comm_hooks_torch.py)."""

    def renamed(state, bucket):
        return hook(state, bucket)

    return renamed


def _hooked(make_hook, rank):
    """Train with the ``(state, hook)`` that ``make_hook(on_torch)`` gives for either DDP."""

    def run(model):
        state, hook = make_hook(isinstance(model, torch.nn.parallel.DistributedDataParallel))
        model.register_comm_hook(state, hook)
        return train(model, _sgd(model), rank, steps=4)

    return run


def torch_hooks(rank: int) -> dict[str, Any]:
    """torch's fp16, bf16 and PowerSGD hooks on phalanx's DDP give what they give on torch's."""
    psgd = functools.partial(powerSGD_hook.PowerSGDState, None, matrix_approximation_rank=2,
                             start_powerSGD_iter=2)
    bf16 = default_hooks.bf16_compress_hook
    hooks = {"fp16": lambda on_torch: (None, default_hooks.fp16_compress_hook),
             "bf16": lambda on_torch: (None, _renamed(bf16) if on_torch else bf16),
             "powerSGD": lambda on_torch: (psgd(), powerSGD_hook.powerSGD_hook)}
    out: dict[str, Any] = {"limits": {}, "info": {}}
    for name, make in hooks.items():
        ours, theirs, _ = pair(_hooked(make, rank), dict(bucket_cap_mb=ONE_BUCKET_MB))
        part = against_torch(ours, theirs, ULP.get(name, TOL), label=name)
        out["limits"].update(part["limits"])
        out["info"].update(part["info"])
    return out


def phalanx_hooks(rank: int) -> dict[str, Any]:
    """phalanx's own hooks (comm_hooks) on its DDP: as on torch's DDP, and, for the 16-bit
    ones, within a few units in the last place of the uncompressed average."""
    out: dict[str, Any] = {"limits": {}, "info": {}}
    exact = pair(lambda m: train(m, _sgd(m), rank, steps=4), dict(bucket_cap_mb=ONE_BUCKET_MB))[0]
    for name in ("fp16", "bf16", "powersgd"):
        def make(on_torch, name=name):
            state, hook = (comm_hooks.by_name(name, start_powerSGD_iter=2) if name == "powersgd"
                           else comm_hooks.by_name(name))
            return state, _renamed(hook) if on_torch else hook

        ours, theirs, _ = pair(_hooked(make, rank), dict(bucket_cap_mb=ONE_BUCKET_MB))
        part = against_torch(ours, theirs, ULP.get(name, TOL), label=f"{name} as on torch's DDP")
        out["limits"].update(part["limits"])
        out["info"].update(part["info"])
        if name in ULP:  # gradients only: the parameters drift apart over the steps
            out["limits"][f"{name} vs uncompressed"] = (rel_diff(ours[:-1], exact[:-1]), 4 * ULP[name])
    return out


def autocast_grad_scaler(rank: int) -> dict[str, Any]:
    """``torch.autocast("cuda", dtype)`` with ``torch.amp.GradScaler("cuda")``, bf16 and fp16."""
    out: dict[str, Any] = {"limits": {}, "info": {}}
    for dtype in (torch.bfloat16, torch.float16):
        scales = []

        def mixed(model, dtype=dtype):
            opt, scaler = _sgd(model), torch.amp.GradScaler("cuda", init_scale=2.0**10)
            record = []
            for step in range(3):
                x, y = batch(rank, step)
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=dtype):
                    loss = F.cross_entropy(model(x.to(DEV)), y.to(DEV))
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                record.append(torch.cat([p.grad.flatten().float() for p in model.parameters()]))
                scaler.step(opt)
                scaler.update()
            scales.append(scaler.get_scale())
            sync()
            return record + [torch.cat([p.detach().flatten().float() for p in model.parameters()])]

        ours, theirs, _ = pair(mixed)
        name = str(dtype).removeprefix("torch.")
        part = against_torch(ours, theirs, label=name)
        out["limits"].update(part["limits"])
        out["info"].update(part["info"])
        out["limits"][f"{name} same scale"] = (float(scales[0] != scales[1]), 0)
        out["info"][f"{name} scale"] = scales
    return out


CHECKS = {
    "ddp_equivalence": ddp_equivalence,
    "many_buckets": many_buckets,
    "side_stream": side_stream,
    "no_sync": no_sync,
    "unused_parameters": unused_parameters,
    "torch_hooks": torch_hooks,
    "phalanx_hooks": phalanx_hooks,
    "autocast_grad_scaler": autocast_grad_scaler,
}
