"""Rank side of test_torch_ddp_suite.py's join cases: distributed_test.py's DDP join tests (all
GPU-only in torch) moved to CPU, in our code, with smaller models where noted. Each case runs with
torch's DDP, then phalanx's, on a group made by torch or by phalanx; problems are worded as in
:mod:`tests.dist.torch_suite`, and phalanx's final models must also equal torch's.
"""

import copy
import itertools
import re
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

import phalanx
from tests.dist.torch_suite import Task, ddp_classes, described, differs, raises, torch_group


def model_step(model: nn.Module) -> None:
    """distributed_test's _model_step: p += grad, grad dropped."""
    for param in model.parameters():
        if param.grad is not None:
            with torch.no_grad():
                param += param.grad
            param.grad = None


def net_equivalence(net: nn.Module) -> list[str]:
    """distributed_test's validate_net_equivalence: every state_dict tensor equal on every rank."""
    problems = []
    for name, t in net.module.state_dict().items():
        gathered = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, t)
        for r, other in enumerate(gathered):
            problems += differs(f"{name} of rank {r} against this rank's", other, t)
    return problems


def join_model_equivalence(ddp, rank, world_size):
    batch, dim, learning_rate = 3, 10, 0.03
    model = nn.Linear(dim, dim, bias=False)
    inp = torch.rand(batch, dim)
    local = copy.deepcopy(model)
    iters = {r: 2 * (r + 1) for r in range(world_size)}
    opt = torch.optim.SGD(local.parameters(), lr=learning_rate)
    for _ in range(sum(iters.values())):
        opt.zero_grad()
        local(inp).sum().backward()
        opt.step()
    net = ddp(model)
    opt = torch.optim.SGD(model.parameters(), lr=learning_rate * world_size)
    with net.join():
        for _ in range(iters[rank]):
            opt.zero_grad()
            net(inp).sum().backward()
            opt.step()
    return sum((differs(k, b, a) for (k, a), (_, b) in zip(local.state_dict().items(),
                                                           net.module.state_dict().items())), [])


def ddp_grad_div_uneven_inputs(ddp, rank, world_size):
    dim, grad_scale = 5, 50
    net = ddp(nn.Linear(dim, dim, bias=False), bucket_cap_mb=1)
    inp = torch.ones(1, dim) * grad_scale
    n_iters = 3 + (2 if rank > 0 else 0)
    problems = []
    with net.join(divide_by_initial_world_size=False):  # the active ranks' average: always the same
        for i in range(n_iters):
            net(inp).sum().backward()
            problems += differs(f"divide by active, step {i}", next(net.parameters()).grad,
                                torch.ones(dim, dim) * grad_scale)
            net.zero_grad()
    with net.join(divide_by_initial_world_size=True):  # joined ranks count as zeros
        for i in range(n_iters):
            net(inp).sum().backward()
            active = world_size - (1 if i >= 3 else 0)
            problems += differs(f"divide by initial, step {i}", next(net.parameters()).grad,
                                torch.ones(dim, dim) * grad_scale * active / world_size)
            net.zero_grad()
    return problems


def ddp_uneven_input_join_disable(ddp, rank, world_size):
    torch.manual_seed(rank)
    net = ddp(nn.Linear(1, 1))
    inp = torch.ones(1) * rank
    problems = []
    with net.join(enable=False):
        for i in range(5):
            grad = net.module.weight.grad
            if grad is not None:
                grad.requires_grad_(False)
                grad.zero_()
            net(inp).sum().backward()
            expected = sum(range(world_size)) / world_size
            if net.module.weight.grad.item() != expected:
                problems.append(f"step {i}: weight grad {net.module.weight.grad.item()} != {expected}")
    # torch's test also reads net._join_config.enable (torch's private attribute): left out
    return problems + net_equivalence(net)


class ExceptionModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.param = nn.Parameter(torch.ones(1, requires_grad=True))

    def forward(self, _):
        raise ValueError("Intentional error")


def ddp_uneven_input_exception(ddp, rank, world_size):
    net = ddp(ExceptionModule())

    def run():
        with net.join():
            net(torch.ones(1)).sum().backward()

    return raises(run, ValueError, "Intentional error")


class NetWithBuffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(10, 10, bias=False)
        self.register_buffer("rank_local", torch.randn(10))

    def forward(self, x):
        return self.fc(x) + self.rank_local


def ddp_join_respects_forward_sync_buffers_false(ddp, rank, world_size):
    torch.manual_seed(rank + 42)
    net = ddp(NetWithBuffers(), forward_sync_buffers=False)
    before = net.module.rank_local.detach().clone()
    with net.join():  # rank 0 runs out first
        for _ in range(rank + 1):
            net(torch.randn(2, 10)).sum().backward()
    return differs("rank_local after the join", net.module.rank_local, before)


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(2, 40, bias=False)
        self.bn = nn.BatchNorm1d(4)
        self.fc2 = nn.Linear(40, 4, bias=False)

    def forward(self, x):
        x = self.bn(torch.reshape(self.fc1(x), (-1, 4, 10)))
        return F.softmax(self.fc2(torch.reshape(x, (-1, 40))), dim=1)


class ModelWithComm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 40, bias=False)

    def forward(self, x):
        x = self.lin(x)
        dist.all_reduce(x)
        return x


def early_termination(rank: int, ran_out: bool):
    """torch's words for throw_on_early_termination, on a rank that ran out or not."""
    return (RuntimeError, f"Rank {rank} exhausted all inputs" if ran_out
            else "Detected at least one rank that exhausted inputs.")


def ddp_uneven_inputs_stop_iteration_sync_bn(ddp, rank, world_size):
    # torch's nn.SyncBatchNorm refuses CPU tensors: phalanx's SyncBatchNorm, under both DDPs
    model_bn = phalanx.SyncBatchNorm.convert_sync_batchnorm(BatchNormNet())
    problems = []
    for name, model in (("sync_bn", model_bn), ("all_reduce in forward", ModelWithComm())):
        net = ddp(model)
        min_iters = 5
        iters = min_iters if rank != 0 else 2 * min_iters
        kind, words = early_termination(rank, rank != 0)
        n = 0

        def run():
            nonlocal n
            with net.join(throw_on_early_termination=True):
                for _ in range(iters):
                    net(torch.randn(10, 2)).sum().backward()
                    model_step(net)
                    n += 1

        raised = raises(run, kind, words)
        if raised:  # torch's assertRaisesRegex failing ends its test: nothing more of this model
            problems += [f"{name}: {p}" for p in raised]
            continue
        if n != min_iters:
            problems.append(f"{name}: {n} steps, not {min_iters}")
        problems += [f"{name}: {p}" for p in net_equivalence(net)]
    return problems


JOIN_SCENARIOS = [join_model_equivalence, ddp_grad_div_uneven_inputs, ddp_uneven_input_join_disable,
                  ddp_uneven_input_exception, ddp_join_respects_forward_sync_buffers_false,
                  ddp_uneven_inputs_stop_iteration_sync_bn]


class UnusedParamModule(nn.Module):
    def __init__(self, unused_params_rank):
        super().__init__()
        self.t0, self.t1 = Task(), Task()
        self.unused_params_rank = unused_params_rank

    def forward(self, x, rank):
        return self.t1(self.t0(x)) if rank != self.unused_params_rank else self.t1(x)


# torch's test_ddp_uneven_inputs: name -> (model, input, hook, state). Scaled to 2 cores: torch's
# convolutions see a 1000x1000 image (here 32x32), its small model is 1000x1000 (here 100x100).
CONV_SIDE, SMALL_DIM = 32, 100


def uneven_model(name: str, rank: int) -> tuple[nn.Module, Any, Any, Any]:
    torch.manual_seed(0)  # the same model for torch's DDP and phalanx's
    small = nn.Linear(SMALL_DIM, SMALL_DIM, bias=False)
    models = {
        "batch_norm_net": (BatchNormNet(), torch.ones(1, 2)),
        "large_conv_model": (nn.Sequential(nn.Conv2d(1, 20, 5), nn.ReLU(), nn.Conv2d(20, 32, 5), nn.ReLU(),
                                           nn.Conv2d(32, 256, 5), nn.ReLU()), torch.ones(1, 1, CONV_SIDE, CONV_SIDE)),
        "small_model": (small, torch.ones(1, SMALL_DIM)),
        "unjoined_rank_with_unused_params_model": (UnusedParamModule(1), (torch.ones(1, 2), rank)),
        "joined_rank_with_unused_params_model": (UnusedParamModule(0), (torch.ones(1, 2), rank)),
        "small_model_allreduce_hook": (small, torch.ones(1, SMALL_DIM)),
        "small_model_power_sgd_hook": (small, torch.ones(1, SMALL_DIM)),
    }
    model, inp = models[name]
    hook = state = None
    if name == "small_model_allreduce_hook":
        hook = default_hooks.allreduce_hook
    elif name == "small_model_power_sgd_hook":  # PowerSGD from the first step on
        hook = powerSGD_hook.powerSGD_hook
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                            start_powerSGD_iter=1, warm_start=False, use_error_feedback=False)
    return model, inp, hook, state


UNEVEN_MODELS = ["batch_norm_net", "large_conv_model", "small_model", "unjoined_rank_with_unused_params_model",
                 "joined_rank_with_unused_params_model", "small_model_allreduce_hook", "small_model_power_sgd_hook"]


def uneven_variants() -> list[tuple[str, int, bool]]:
    """torch's (model, sync interval, throw_on_early_termination) list: every model every step;
    the hook-less ones also with no_sync() between syncs (every 2nd, 3rd... step) and throwing."""
    plain = UNEVEN_MODELS[:5]
    return ([(m, 1, False) for m in UNEVEN_MODELS] + [(m, i + 2, False) for i, m in enumerate(plain)]
            + [(m, 1, True) for m in plain])


def iteration_mappings(world_size: int) -> list[dict[int, int]]:
    """torch's rank -> iterations for one rank joining early (world size 2): 0 or 5 steps, and
    the others 2, 3 or 10 more."""
    return [{0: base, **{r: base + offset for r in range(1, world_size)}}
            for base, offset in itertools.product((0, 5), (2, 3, 10))]


def ddp_uneven_inputs(ddp, rank, world_size, model_name, sync_interval, throw):
    problems, finals = [], []
    for mapping in iteration_mappings(world_size):
        model, inp, hook, state = uneven_model(model_name, rank)
        net = ddp(model, bucket_cap_mb=1, find_unused_parameters="unused_params" in model_name)
        if hook is not None:
            net.register_comm_hook(state, hook)
        min_iters, total = min(mapping.values()), 0
        kind, words = early_termination(rank, mapping[rank] == min_iters)

        def run():
            nonlocal total
            with net.join(throw_on_early_termination=throw):
                for i in range(mapping[rank]):
                    with net.no_sync() if i % sync_interval else nullcontext():
                        loss = net(*inp).sum() if isinstance(inp, tuple) else net(inp).sum()
                        loss.backward()
                        model_step(net)
                    total += 1

        if throw:
            raised = raises(run, kind, words)
            problems += [f"{mapping}: {p}" for p in raised]
            if not raised and total != min_iters:  # (a failed assertRaisesRegex ends torch's run)
                problems.append(f"{mapping}: {total} steps, not {min_iters}")
        else:
            try:
                run()
            except Exception as e:  # noqa: BLE001
                problems.append(f"{mapping}: {described(e)}")
                continue
            # torch also checks net._authoritative_rank (all ranks: the last) and the logging
            # data's join_uneven_inputs, both torch's private attributes: the final models equal
            # on every rank (and torch's, in join_cases) say the same
            problems += [f"{mapping}: {p}" for p in net_equivalence(net)]
            finals.append(torch.cat([t.detach().flatten().float() for t in net.module.state_dict().values()]))
        dist.barrier()
    return problems, finals


def join_case_names() -> list[str]:
    return [f.__name__ for f in JOIN_SCENARIOS] + [
        f"ddp_uneven_inputs[{m},sync_every_{s},{'throw' if t else 'shadow'}]" for m, s, t in uneven_variants()]


def _run_join_case(name: str, ddp, rank: int, world_size: int) -> tuple[list[str], list[torch.Tensor]]:
    scenario = next((f for f in JOIN_SCENARIOS if f.__name__ == name), None)
    if scenario is not None:
        torch.manual_seed(0)  # distributed_test seeds alike before each test (set_rng_seed)
        return scenario(ddp, rank, world_size), []
    model, sync, throw = re.fullmatch(r"ddp_uneven_inputs\[(\w+),sync_every_(\d+),(\w+)\]", name).groups()
    return ddp_uneven_inputs(ddp, rank, world_size, model, int(sync), throw == "throw")


def join_cases(rank: int, world_size: int, maker: str) -> dict[str, dict[str, list[str]]]:
    """Every join case with torch's DDP, then phalanx's, on a group made by ``maker`` (torch's
    ``dist.init_process_group``, or phalanx's, done by the harness); phalanx's final models must
    also equal torch's."""
    if maker == "torch":
        torch_group(rank, world_size)
    out: dict[str, dict[str, list[str]]] = {}
    try:
        for name in join_case_names():
            finals = {}
            out[name] = {}
            for which, ddp in ddp_classes().items():
                try:
                    out[name][which], finals[which] = _run_join_case(name, ddp, rank, world_size)
                except Exception as e:  # noqa: BLE001
                    out[name][which], finals[which] = [described(e)], []
                dist.barrier()  # no case's collectives run into the next one's
            if finals["torch"] and len(finals["phalanx"]) == len(finals["torch"]):
                out[name]["phalanx"] += sum((differs(f"final model of run {i} against torch's", ours, theirs)
                                             for i, (ours, theirs) in enumerate(zip(finals["phalanx"],
                                                                                    finals["torch"]))), [])
    finally:
        if maker == "torch":
            dist.destroy_process_group()
    return out
