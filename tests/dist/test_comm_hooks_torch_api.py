"""torch's words and behaviour at the comm hook API (issue 21), torch's DDP as the oracle, in the
same ranks: the mistakes torch's own DDP tests check raise torch's exception classes with
torch's words first; ``_register_builtin_comm_hook`` gives torch's gradients; a hook on a
model with sparse gradients works."""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import phalanx
from tests.harness import run_ranks

BUILTINS = (dist.BuiltinCommHookType.ALLREDUCE, dist.BuiltinCommHookType.FP16_COMPRESS)


def _caught(fn, *args):
    """``(names of the exception's classes, message)`` of what ``fn(*args)`` raised, or ``None``."""
    try:
        fn(*args)
    except Exception as e:
        return [cls.__name__ for cls in type(e).__mro__], str(e)
    return None


def _first_sentence(message):
    return re.split(r"(?<=\.)\s", message, maxsplit=1)[0]


def _both():
    """A fresh torch DDP and phalanx DDP of the same model."""
    return {"torch": TorchDDP(nn.Linear(3, 3)), "phalanx": phalanx.DistributedDataParallel(nn.Linear(3, 3))}


def _echo(state, bucket):
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _int_bucket(state, bucket: int):  # a string annotation here: the module has future annotations
    return _echo(state, bucket)


def _int_result(state, bucket) -> int:
    return _echo(state, bucket)


def _torch_annotated(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return _echo(state, bucket)


def _no_future(state, bucket):
    return 1


def _registration(rank, world_size):
    out = {}
    for impl, ddp in _both().items():
        ddp.register_comm_hook(None, _echo)
        out["twice", impl] = _caught(ddp.register_comm_hook, None, _echo)
        out["builtin after hook", impl] = _caught(ddp._register_builtin_comm_hook, BUILTINS[0])
    for impl, ddp in _both().items():
        ddp._register_builtin_comm_hook(BUILTINS[0])
        out["hook after builtin", impl] = _caught(ddp.register_comm_hook, None, _echo)
    for impl, ddp in _both().items():
        out["not callable", impl] = _caught(ddp.register_comm_hook, None, 1)
        out["bucket annotation", impl] = _caught(ddp.register_comm_hook, None, _int_bucket)
        out["return annotation", impl] = _caught(ddp.register_comm_hook, None, _int_result)
        out["builtin argument", impl] = _caught(ddp._register_builtin_comm_hook, 1)
        # the failed registrations did not count (torch's own test registers again after them)
        out["string annotations", impl] = _caught(ddp.register_comm_hook, None, _torch_annotated)
    phalanx_ddp = phalanx.DistributedDataParallel(nn.Linear(3, 3))
    phalanx_ddp.register_comm_hook(None, _no_future)
    out["no future", "phalanx"] = _caught(lambda: phalanx_ddp(torch.ones(2, 3)).sum().backward())
    torch_ddp = TorchDDP(nn.Linear(3, 3))  # last: torch's DDP is unusable after this error
    torch_ddp.register_comm_hook(None, _no_future)
    out["no future", "torch"] = _caught(lambda: torch_ddp(torch.ones(2, 3)).sum().backward())
    return out


def test_registration_mistakes_raise_torchs_classes_with_torchs_words_first():
    out = run_ranks(_registration, 2)[0]
    for case in ("twice", "builtin after hook", "hook after builtin", "not callable", "bucket annotation",
                 "return annotation", "builtin argument"):
        (torch_classes, torch_message), (ours, message) = out[case, "torch"], out[case, "phalanx"]
        assert torch_classes[0] in ours, (case, torch_classes, ours)
        assert message.startswith(_first_sentence(torch_message)), (case, torch_message, message)
    assert out["twice", "phalanx"][1] == ("register_comm_hook or register_builtin_comm_hook can only be "
                                          "called once. This DistributedDataParallel has _echo already")
    assert out["builtin after hook", "phalanx"][1].startswith("register_builtin_comm_hook or register_comm_hook")
    assert out["not callable", "phalanx"] == (["TypeError", "Exception", "BaseException", "object"],
                                              "Communication hook must be callable. phalanx calls it as "
                                              "hook(state, bucket) -> torch.futures.Future; got int")
    assert "_int_bucket's bucket is annotated int" in out["bucket annotation", "phalanx"][1]
    assert "_int_result is annotated to return int" in out["return annotation", "phalanx"][1]
    # torch compares the annotations as written: strings under `from __future__ import annotations`
    assert out["string annotations", "torch"][0][0] == "ValueError"
    assert out["string annotations", "phalanx"] is None
    # a hook that returns no future: torch's RuntimeError; phalanx's UsageError is a ValueError too
    (torch_classes, torch_message), (ours, message) = out["no future", "torch"], out["no future", "phalanx"]
    words = "DDP communication hook's callback must return a torch.futures.Future object, but got builtins.int"
    assert torch_classes[0] == "RuntimeError" and words in torch_message
    assert {"UsageError", "ValueError", "RuntimeError"} <= set(ours)
    assert message == f"{words}: the communication hook _no_future returned 1 for bucket 0"


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))


def _grads_per_step(model, rank, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        opt.zero_grad()
        model(torch.randn(8, 6, generator=g) * (rank + 1)).square().mean().backward()
        seen.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        opt.step()
    return seen


def _builtin(rank, world_size, kind):
    models = {"torch": TorchDDP(_net(), bucket_cap_mb=0.001),  # several buckets
              "phalanx": phalanx.DistributedDataParallel(_net(), bucket_cap_mb=0.001)}
    for model in models.values():
        model._register_builtin_comm_hook(kind)
    grads = {impl: _grads_per_step(model, rank) for impl, model in models.items()}
    return {"buckets": len(models["phalanx"].bucket_plan),
            "diff": max((a - b).abs().max().item() for a, b in zip(grads["torch"], grads["phalanx"]))}


def test_builtin_hooks_give_torchs_gradients():
    for kind in BUILTINS:
        for out in run_ranks(_builtin, 2, kind):
            assert out["buckets"] > 1
            assert out["diff"] < 1e-6, kind  # the same operations, in the same dtype


class _Sparse(nn.Module):
    def __init__(self, dense=True):
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Embedding(10, 4, sparse=True)
        self.head = nn.Linear(4, 2) if dense else None

    def forward(self, ids):
        rows = self.table(ids)
        return rows if self.head is None else self.head(rows)


def _sparse(rank, world_size):
    out = {}
    for dense in (True, False):
        seen = []

        def recording(state, bucket):
            seen.append(bucket.buffer().layout)
            return default_hooks.allreduce_hook(state, bucket)

        ours = phalanx.DistributedDataParallel(_Sparse(dense))
        ours.register_comm_hook(None, recording)
        theirs = TorchDDP(_Sparse(dense))  # its gradients: the same as with torch's allreduce_hook
        ids = torch.tensor([rank, 3, 5 + rank])
        for model in (ours, theirs):
            model(ids).square().sum().backward()
        pairs = [(p.grad, q.grad) for p, q in zip(ours.parameters(), theirs.parameters())]
        out[dense] = {"layouts": sorted(set(map(str, seen))),
                      "table sparse": ours.module.table.weight.grad.is_sparse,
                      "diff": max((a.to_dense() - b.to_dense()).abs().max().item() for a, b in pairs)}
    return out


def test_a_hook_on_a_model_with_sparse_gradients_reduces_the_dense_buckets():
    for out in run_ranks(_sparse, 2):
        assert out[True]["layouts"] == ["torch.strided"]  # the hook sees the dense bucket only
        assert out[True]["table sparse"] and out[True]["diff"] < 1e-6
        # only sparse gradients: no dense bucket, the hook is never called
        assert out[False]["layouts"] == [] and out[False]["table sparse"] and out[False]["diff"] < 1e-6
