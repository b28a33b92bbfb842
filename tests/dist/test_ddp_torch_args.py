"""torch 2.13's DistributedDataParallel surface on phalanx's (issue 15): every constructor
argument accepted with torch's meaning (compared with torch's DDP in the same ranks) or
refused with a message; exception classes a torch script catches; distributed autograd
refused; torch attributes phalanx does not have explained."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import phalanx
from phalanx.ddp.options import (
    BOTH_BUFFER_FLAGS_WARNING,
    CHECK_REDUCTION_WARNING,
    NOTHING_IGNORED,
    TORCH_ONLY_ATTRIBUTES,
)
from tests.harness import error_of, free_port, run_ranks
from tests.oracle import torch_lacks

DDP = phalanx.DistributedDataParallel


class Net(nn.Module):
    """A BatchNorm (running statistics), a rank-dependent buffer, and an unused head."""

    def __init__(self, rank=0):
        super().__init__()
        torch.manual_seed(rank)
        self.lin, self.bn, self.out = nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2)
        self.unused = nn.Linear(2, 2)
        self.register_buffer("mark", torch.full((3,), float(rank)))

    def forward(self, x):
        return self.out(self.bn(self.lin(x)))


def _step(model, rank, step=0):
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * step + rank)) * (rank + 1)
    model(x).pow(2).sum().backward()


def _grad_diff(ours, theirs):
    return max((p.grad - q.grad).abs().max().item() for p, q in zip(ours.parameters(), theirs.parameters())
               if q.grad is not None)


def _classes(fn, *args, **kwargs):
    """The built-in classes (ValueError, TypeError, RuntimeError) what ``fn`` raised belongs to."""
    try:
        fn(*args, **kwargs)
    except Exception as e:
        return {c.__name__ for c in (ValueError, TypeError, RuntimeError) if isinstance(e, c)}
    return None


def _both(rank, **kwargs):
    """phalanx's and torch's DDP over equal nets built with this rank's seed."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's broadcast_buffers deprecation
        return DDP(Net(rank), **kwargs), TorchDDP(Net(rank), **kwargs)


def _buffer_flags(rank):
    out = {}
    cases = {"broadcast_buffers=False": dict(broadcast_buffers=False),
             "forward_sync_buffers=False": dict(forward_sync_buffers=False),
             "default": {}}
    for name, kwargs in cases.items():
        # a torch whose DDP lacks the case's argument (2.11: forward_sync_buffers): phalanx's alone
        oracle_missing = next((torch_lacks(TorchDDP, f"{arg}=") for arg in kwargs), None)
        if oracle_missing:
            ours, theirs = DDP(Net(rank), find_unused_parameters=True, **kwargs), None
        else:
            ours, theirs = _both(rank, find_unused_parameters=True, **kwargs)
        models = [m for m in (ours, theirs) if m is not None]
        at_init = tuple(m.module.mark.tolist() for m in models)
        for step in (0, 1):  # the second forward broadcasts (or not)
            for m in models:
                _step(m, rank, step)
        out[name] = {"at_init": at_init, "own_stats": ours.module.bn.running_mean.tolist(),
                     "flags": (ours.broadcast_buffers, ours.will_sync_module_buffers()),
                     "oracle_missing": oracle_missing}
        if theirs is not None:
            out[name].update(stats=(ours.module.bn.running_mean - theirs.module.bn.running_mean).abs().max().item(),
                             torch_flags=(theirs.broadcast_buffers, theirs.will_sync_module_buffers()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        both = DDP(Net(rank), broadcast_buffers=True, forward_sync_buffers=False)
    out["both"] = (both.forward_sync_buffers, [(w.category.__name__, str(w.message)) for w in caught])
    return out


def _accepted(rank, world_size):
    out = {"buffers": _buffer_flags(rank)}
    # init_sync=False: no collective at construction (only rank 0 builds one: none waits),
    # and the replicas keep their own values, as with torch's
    if rank == 0:
        DDP(Net(5), init_sync=False, find_unused_parameters=True)
    dist.barrier()
    ours, theirs = _both(rank, init_sync=False, find_unused_parameters=True)
    out["no_init_sync"] = ((ours.module.lin.weight - theirs.module.lin.weight).abs().max().item(),
                           ours.module.lin.weight[0, 0].item(), ours.module.mark.tolist())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DDP(Net(), check_reduction=True, find_unused_parameters=True)
        TorchDDP(Net(), check_reduction=True, find_unused_parameters=True)
    out["check_reduction"] = [(w.category.__name__, str(w.message)) for w in caught if "check_reduction" in str(w.message)]
    # dim, skip_all_reduce_unused_params, batched_grad_copy, bucket_cap_mb_list: torch's results
    # (a torch without batched_grad_copy: the others compared, phalanx's with it)
    kwargs = dict(dim=1, find_unused_parameters=True, skip_all_reduce_unused_params=True,
                  bucket_cap_mb_list=[0.0001, 1])
    oracle_missing = torch_lacks(TorchDDP, "batched_grad_copy=")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # as in _both
        ours, theirs = DDP(Net(0), batched_grad_copy=True, **kwargs), TorchDDP(
            Net(0), **kwargs, **({} if oracle_missing else {"batched_grad_copy": True}))
    _step(ours, rank), _step(theirs, rank)
    out["extras"] = (_grad_diff(ours, theirs), ours.dim, ours.module.unused.weight.grad,
                     [[s.name for s in b.slots] for b in ours.bucket_plan], oracle_missing)
    mesh = init_device_mesh("cpu", (world_size,))
    ours, theirs = DDP(Net(rank), device_mesh=mesh, find_unused_parameters=True), TorchDDP(
        Net(rank), device_mesh=mesh, find_unused_parameters=True)
    _step(ours, rank), _step(theirs, rank)
    out["mesh"] = (_grad_diff(ours, theirs), ours.device_mesh is mesh)
    return out


@pytest.fixture(scope="module")
def accepted():
    """Every rank's results of one group of 2 ranks running _accepted (the tests below)."""
    return run_ranks(_accepted, 2)


def test_buffer_flags_mean_what_they_mean_in_torch(accepted):
    results = accepted
    missing = set()
    for rank, out in enumerate(results):
        buffers = out["buffers"]
        for name in ("broadcast_buffers=False", "forward_sync_buffers=False", "default"):
            res = buffers[name]
            # broadcast_buffers=False: the rank's own buffer, at construction too; otherwise rank 0's
            mark = [float(rank) if name == "broadcast_buffers=False" else 0.0] * 3
            if res["oracle_missing"]:  # phalanx's alone
                assert res["at_init"] == (mark,), (name, res)
                missing.add(res["oracle_missing"])
                continue
            assert res["at_init"] == (mark,) * 2, (name, res)
            assert res["stats"] < 1e-6 and res["flags"] == res["torch_flags"], (name, res)
        assert buffers["default"]["flags"] == (True, True) and buffers["broadcast_buffers=False"]["flags"] == (False, False)
        assert buffers["forward_sync_buffers=False"]["flags"] == (False, False)  # (torch 2.13's)
    # per-rank statistics without forward sync, rank 0's with it
    fwd = [r["buffers"]["forward_sync_buffers=False"]["own_stats"] for r in results]
    assert fwd[0] != fwd[1]
    if missing:
        pytest.skip(f"phalanx's checked, not against torch's: {'; '.join(sorted(missing))}")


def test_both_buffer_flags_given_warn_and_forward_sync_wins(accepted):
    for out in accepted:
        buffers = out["buffers"]
        assert buffers["both"] == (False, [("FutureWarning", BOTH_BUFFER_FLAGS_WARNING)])


def test_without_init_sync_the_replicas_keep_their_own_values(accepted):
    results = accepted
    for rank, out in enumerate(results):
        diff, _, mark = out["no_init_sync"]
        assert diff == 0 and mark == [float(rank)] * 3
    # replicas not synchronised at construction keep their own weights
    assert results[0]["no_init_sync"][1] != results[1]["no_init_sync"][1]


def test_check_reduction_warns_as_torch_does(accepted):
    for out in accepted:
        ours, torch_warning = out["check_reduction"]
        assert ours == torch_warning == ("FutureWarning", CHECK_REDUCTION_WARNING)


def test_dim_skip_unused_batched_copy_and_bucket_cap_list_give_torchs_results(accepted):
    for out in accepted:
        diff, dim, unused_grad, plan, oracle_missing = out["extras"]
        assert diff < 1e-6 and dim == 1 and unused_grad is None
        assert plan == [["unused.bias", "unused.weight", "out.bias", "out.weight", "bn.bias"],  # 104 bytes:
                        ["bn.weight", "lin.bias", "lin.weight"]]  # 0.0001 MiB closes it; then 1 MiB
    if oracle_missing:
        pytest.skip(f"dim, skip_all_reduce_unused_params and bucket_cap_mb_list checked against torch's, "
                    f"batched_grad_copy not: {oracle_missing}")


def test_a_device_mesh_gives_torchs_results(accepted):
    for out in accepted:
        assert out["mesh"][0] < 1e-6 and out["mesh"][1]


class Lazy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.LazyLinear(2)


def _refused(rank, world_size):
    out = {}
    frozen = Net().requires_grad_(False)
    mesh2d = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("tp", "dp"))
    mesh = mesh2d["dp"]
    # where torch raises RuntimeError, phalanx's UsageError is one too (and a ValueError)
    for name, kwargs in {"frozen": dict(module=frozen), "lazy": dict(module=Lazy()),
                         "group and mesh": dict(module=Net(), process_group=dist.group.WORLD, device_mesh=mesh),
                         "2-D mesh": dict(module=Net(), device_mesh=mesh2d)}.items():
        out[name] = (_classes(DDP, **kwargs), _classes(TorchDDP, **kwargs), error_of(DDP, **kwargs))
    from torch.distributed.tensor import Replicate, distribute_tensor

    tensor_parallel = nn.Linear(2, 2)
    tensor_parallel.weight = nn.Parameter(distribute_tensor(torch.ones(2, 2), mesh, [Replicate()]))
    marked = Net()
    marked._ddp_params_and_buffers_to_ignore = ["unused.weight"]
    for name, kwargs in {"delay": dict(delay_all_reduce_named_params=[("w", nn.Parameter(torch.ones(1)))],
                                       param_to_hook_all_reduce=nn.Parameter(torch.ones(1))),
                         "mixed_precision": dict(mixed_precision=object()),
                         "dtensor": dict(module=tensor_parallel, device_mesh=mesh),
                         "ignore": dict(module=marked), "dim": dict(dim="0")}.items():
        out[name] = error_of(DDP, **{"module": Net(), **kwargs})
    out["ignore_static"] = error_of(DDP._set_params_and_buffers_to_ignore_for_model, Net(), ["lin.weight"])
    ddp = DDP(Net(), find_unused_parameters=True)
    out["attributes"] = {name: error_of(getattr, ddp, name) for name in TORCH_ONLY_ATTRIBUTES}
    out["plain_missing"] = error_of(getattr, ddp, "no_such_thing")
    return out


@pytest.fixture(scope="module")
def refused():
    """Every rank's results of one group of 2 ranks running _refused (the tests below)."""
    return run_ranks(_refused, 2)


def test_modules_and_meshes_ddp_cannot_take_raise_torchs_exception_classes(refused):
    for out in refused:
        for name in ("frozen", "lazy", "group and mesh", "2-D mesh"):
            ours, theirs, (kind, _) = out[name]
            assert theirs == {"RuntimeError"} and ours == {"ValueError", "RuntimeError"}, name
            assert kind == "UsageError", name


def test_modules_and_meshes_ddp_cannot_take_are_named(refused):
    for out in refused:
        assert "at least one parameter that requires a gradient" in out["frozen"][2][1]
        assert out["lazy"][2][1] == ("DistributedDataParallel needs initialised parameters; ['lin.weight', "
                                     "'lin.bias'] are not (a lazy module): run one forward pass through the "
                                     "module before wrapping it")
        assert out["group and mesh"][2][1].startswith("DistributedDataParallel takes process_group or device_mesh, not both")
        assert "takes a 1-D device_mesh" in out["2-D mesh"][2][1] and "got a 2-D mesh" in out["2-D mesh"][2][1]


def test_delayed_all_reduce_is_refused(refused):
    for out in refused:
        assert out["delay"] == ("ValueError", (
            "delay_all_reduce_named_params and param_to_hook_all_reduce are torch's (all-reduce some "
            "parameters in one go once another one's gradient is ready); phalanx's DistributedDataParallel "
            "does not hold parameters back: it averages every trainable parameter in its buckets during "
            "the backward. Leave both None"))


def test_mixed_precision_of_another_type_is_refused_with_torchs_words(refused):
    # torch's DDP fails on it with AttributeError: 'object' object has no attribute 'param_dtype'
    for out in refused:
        kind, message = out["mixed_precision"]
        assert kind == "TypeError" and message.startswith("'object' object has no attribute 'param_dtype'")
        assert "must be None or a torch.nn.parallel.distributed._MixedPrecision(" in message


def test_dtensor_parameters_are_refused(refused):
    for out in refused:
        kind, message = out["dtensor"]
        assert kind == "ValueError" and message.startswith("parameters ['weight'] are DTensors")


def test_parameters_and_buffers_to_ignore_are_refused(refused):
    for out in refused:
        assert out["ignore"] == ("ValueError", (
            "the module names parameters and buffers for DDP to ignore (['unused.weight'], set by "
            f"_set_params_and_buffers_to_ignore_for_model): {NOTHING_IGNORED}"))
        assert out["ignore_static"] == ("ValueError", "_set_params_and_buffers_to_ignore_for_model is torch's: "
                                        + NOTHING_IGNORED)


def test_a_dim_that_is_not_an_int_is_refused(refused):
    for out in refused:
        assert out["dim"] == ("TypeError", "dim must be an int (the batch dimension), got '0'")


def test_torchs_attributes_phalanx_lacks_are_explained(refused):
    for out in refused:
        for name, (kind, message) in out["attributes"].items():
            assert kind == "AttributeError", name
            assert message == f"phalanx's DistributedDataParallel has no {name!r}: {TORCH_ONLY_ATTRIBUTES[name]}"
        assert out["plain_missing"][0] == "AttributeError" and "no_such_thing" in out["plain_missing"][1]


def _distributed_autograd(rank, world_size, port):
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc

    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    try:
        ddp, oracle = _both(0, find_unused_parameters=True)
        _step(ddp, rank), _step(oracle, rank)  # RPC running, plain autograd: averaged as usual
        out = {"plain": _grad_diff(ddp, oracle)}
        with dist_autograd.context():
            out["context"] = _classes(_step, ddp, rank), error_of(_step, ddp, rank)
        return out
    finally:
        rpc.shutdown()


def test_distributed_autograd_is_refused_at_the_forward():
    for out in run_ranks(_distributed_autograd, 2, free_port()):
        assert out["plain"] < 1e-6
        classes, (kind, message) = out["context"]
        assert kind == "UsageError" and classes == {"ValueError", "RuntimeError"}
        assert message.startswith("phalanx's DistributedDataParallel does not average gradients computed by "
                                  "torch.distributed.autograd.backward()")

