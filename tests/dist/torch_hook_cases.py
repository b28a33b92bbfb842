"""Rank side of test_torch_ddp_suite.py's comm-hook cases: ``test/distributed/test_c10d_gloo.py``'s
``DistributedDataParallelTest`` comm-hook scenarios and assertions, in our code (that file is not
in torch's wheel). Each case runs with torch's DDP, then phalanx's, in one group made by torch
(:func:`tests.dist.torch_suite.torch_group`); problems are worded as in :mod:`tests.dist.torch_suite`.
"""

# No "from __future__ import annotations": torch's DDP checks the hooks' annotations as objects.
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.dist.torch_suite import Task, ddp_classes, described, differs, raises, torch_group


class ModuleForDdpCommHook(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.t0 = Task()

    def forward(self, x, rank):
        return self.t0(x + rank)


class SparseGradientModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.EmbeddingBag(10, 10, sparse=True)

    def forward(self, x):
        return F.softmax(self.embedding(x), dim=1)


def simple_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    fut = torch.futures.Future()
    fut.set_result(torch.ones_like(bucket.buffer()))
    return fut.then(lambda f: f.value() + torch.ones_like(f.value()))


def future_passing_cpu(ddp, group, rank, world_size):
    model = ddp(ModuleForDdpCommHook().cpu(), process_group=group)
    model.register_comm_hook(None, simple_hook)
    model(8, rank).mean().backward()  # without the hook: 0.25 * ones(2, 2)
    return sum((differs("grad", p.grad, 2 * torch.ones(2, 2)) for p in model.parameters()), [])


def invalid_comm_hook_init_not_callable(ddp, group, rank, world_size):
    model = ddp(ModuleForDdpCommHook(), process_group=group)
    return raises(lambda: model.register_comm_hook(state=None, hook=1), TypeError,
                  "Communication hook must be callable.")


def invalid_comm_hook_init_bucket_annotation(ddp, group, rank, world_size):
    model = ddp(ModuleForDdpCommHook(), process_group=group)

    def comm_hook(state: object, bucket: int) -> torch.futures.Future[torch.Tensor]:
        return torch.futures.Future()

    return raises(lambda: model.register_comm_hook(state=None, hook=comm_hook), ValueError,
                  "bucket annotation should be dist.GradBucket.")


def invalid_comm_hook_return_annotation(ddp, group, rank, world_size):
    model = ddp(ModuleForDdpCommHook(), process_group=group)

    def comm_hook(state: object, bucket: dist.GradBucket) -> int:
        return torch.futures.Future()

    expected_err = "Communication hook: return annotation should be torch.futures.Future"
    found = raises(lambda: model.register_comm_hook(state=None, hook=comm_hook), ValueError, expected_err)
    return found + error_logged(model, expected_err)


def error_logged(model, expected_err):
    """torch's ``verify_ddp_error_logged``: the DDP's logging data holds the error."""
    from torch.testing._internal.common_distributed import verify_ddp_error_logged

    try:
        verify_ddp_error_logged(model, expected_err)
    except Exception as e:  # noqa: BLE001 - its failure is the finding
        return [f"the error is not logged: {described(e)}"]
    return []


def invalid_comm_hook_return_not_future(ddp, group, rank, world_size):
    # torch's test registers this hook on the model whose annotated hook it refused just before;
    # a fresh model here, so that phalanx accepting that one does not hide this check
    model = ddp(ModuleForDdpCommHook(), process_group=group)

    def comm_hook(state: object, bucket: dist.GradBucket):
        return 1

    def run():
        model.register_comm_hook(state=None, hook=comm_hook)
        model(8, rank).mean().backward()

    return raises(run, RuntimeError, "callback must return a torch.futures.Future object, but got")


def comm_hook_register_just_once(ddp, group, rank, world_size):
    model = ddp(ModuleForDdpCommHook(), process_group=group)

    def dummy_hook(state, bucket):
        fut = torch.futures.Future()
        fut.set_result([bucket.buffer()])
        return fut

    model.register_comm_hook(None, dummy_hook)
    return raises(lambda: model.register_comm_hook(None, dummy_hook), RuntimeError,
                  "register_comm_hook or register_builtin_comm_hook can only be called once.")


def comm_hook_sparse_gradients(ddp, group, rank, world_size):
    torch.manual_seed(1337)  # the same weights and inputs on every rank
    vanilla = SparseGradientModule()
    model = ddp(copy.deepcopy(vanilla), process_group=group)

    def allreduce_hook_gloo(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        fut = group.allreduce([bucket.buffer()]).get_future()
        return fut.then(lambda f: f.wait()[0] / world_size)

    model.register_comm_hook(None, allreduce_hook_gloo)
    mult = 2
    criterion = nn.CrossEntropyLoss()
    inputs = torch.randint(0, 10, [mult * world_size, 2])
    target = torch.randint(0, 10, [mult * world_size])
    criterion(vanilla(inputs), target).backward()
    criterion(model(inputs.split(mult)[rank]), target.split(mult)[rank]).backward()
    ours, want = next(model.parameters()).grad, next(vanilla.parameters()).grad
    if not ours.is_sparse:
        return [f"the gradient is not sparse any more ({ours.layout})"]
    return differs("sparse grad", ours.coalesce(), want.coalesce())


HOOKS = [future_passing_cpu, invalid_comm_hook_init_not_callable, invalid_comm_hook_init_bucket_annotation,
         invalid_comm_hook_return_annotation, invalid_comm_hook_return_not_future,
         comm_hook_register_just_once, comm_hook_sparse_gradients]


def hook_cases(rank: int, world_size: int) -> dict[str, dict[str, list[str]]]:
    group = torch_group(rank, world_size)
    out: dict[str, dict[str, list[str]]] = {}
    try:
        for case in HOOKS:
            out[case.__name__] = {}
            for name, ddp in ddp_classes().items():
                try:
                    out[case.__name__][name] = case(ddp, group, rank, world_size)
                except Exception as e:  # noqa: BLE001
                    out[case.__name__][name] = [described(e)]
                dist.barrier(group=group)  # no case's collectives run into the next one's
    finally:
        dist.destroy_process_group()
    return out
