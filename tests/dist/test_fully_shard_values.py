"""Values put into a ``phalanx.fully_shard`` model, against torch's ``fully_shard`` in the same
ranks: torch's FSDP2 example's resume (meta device, ``to_empty``, ``distribute_tensor`` and
``load_state_dict(strict=False, assign=True)``), a DCP checkpoint, and every other way torch
lets a user set a sharded parameter's values. Each must give torch's values bit for bit
(and, trained on, torch's losses), or raise where torch raises (phalanx: ``ValueError``
naming the parameter); phalanx's class passes torch's ``isinstance`` checks.

One group of 2 ranks runs every check (a module fixture); the tests assert on
its results. World 2: the reductions add in one order, so training equals torch's bit for
bit; the small model of the paths has odd rows (padded shards)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     set_model_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp import register_fsdp_forward_method as torch_register
from torch.distributed.fsdp import share_comm_ctx
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from phalanx.bench.engine import GPT
from phalanx.fsdp import fully_shard
from tests.dist.test_fully_shard import VOCAB, TOKENS, _batch, _mine, _shard
from tests.harness import error_of, run_ranks

WORLD = 2
STEPS = 3
FS = {"phalanx": fully_shard, "torch": torch_fully_shard}


# ---- torch's FSDP2 example: resume from a full checkpoint -------------------------------
def _gpt(fs, meta=True, to_empty=True):
    """The sharded GPT; ``meta``: built on the meta device (``to_empty``: then given storage;
    the example's resume leaves its parameters on the meta device until the load)."""
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        model = GPT(vocab=VOCAB, tokens=TOKENS, dim=18, depth=3, heads=3)
    _shard(model, fs)
    if meta and to_empty:
        model.to_empty(device="cpu")
    return model


def _checkpoint():
    """The full state dict a finished run saved (other values than a fresh model's)."""
    torch.manual_seed(5)
    return GPT(vocab=VOCAB, tokens=TOKENS, dim=18, depth=3, heads=3).state_dict()


def _example_load(model, full_sd):
    """pytorch/examples distributed/FSDP2 checkpoint.py, ``Checkpointer.load_model``."""
    meta_sharded_sd = model.state_dict()
    sharded_sd = {}
    for name, full in full_sd.items():
        like = meta_sharded_sd.get(name)
        sharded_sd[name] = nn.Parameter(distribute_tensor(full, like.device_mesh, like.placements))
    model.load_state_dict(sharded_sd, strict=False, assign=True)


def _train(model, rank):
    """Adam (the example's), built after the load as there, for ``STEPS`` steps: the losses."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        x, y = _mine(_batch(step, WORLD), rank)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _locals(model):
    return [p.detach().to_local().clone() for p in model.parameters()]


def _rows(full_sd, model, rank):
    """Whether every parameter holds this rank's rows of ``full_sd``."""
    return all(torch.equal(p.detach().to_local(), full_sd[n].chunk(WORLD)[rank])
               for n, p in model.named_parameters())


def _side_by_side(rank, load, to_empty=True):
    """Each fully_shard's model after ``load(model)``: torch's isinstance, the loaded values
    against the checkpoint and against torch's, and ``STEPS`` steps of training."""
    full_sd, out, loaded, trained = _checkpoint(), {}, {}, {}
    for name, fs in FS.items():
        model = _gpt(fs, to_empty=to_empty)
        out[f"{name}_isinstance"] = isinstance(model, TorchFSDPModule)  # the example's assert
        load(model, dict(full_sd))  # (DCP's functions fill the dict they are given)
        out[f"{name}_rows"] = _rows(full_sd, model, rank)
        out[f"{name}_dtensors"] = all(isinstance(p, DTensor) for p in model.parameters())
        loaded[name] = _locals(model)
        out[f"{name}_losses"] = _train(model, rank)
        trained[name] = _locals(model)
    out["loaded_equal"] = all(map(torch.equal, loaded["phalanx"], loaded["torch"]))
    out["trained_equal"] = all(map(torch.equal, trained["phalanx"], trained["torch"]))
    out["trained_moved"] = any(not torch.equal(a, b) for a, b in zip(loaded["phalanx"], trained["phalanx"]))
    return out


def _dcp_load(directory):
    def load(model, full_sd):
        sd = get_model_state_dict(model)
        dcp.load(sd, checkpoint_id=directory)
        set_model_state_dict(model, sd)
    return load


def _broadcast_load(model, full_sd):
    """The example's DCP API: a full state dict on rank 0, broadcast."""
    set_model_state_dict(model, full_sd if torch.distributed.get_rank() == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def _resumes(rank, world_size, directory):
    saved = _gpt(torch_fully_shard, meta=False)
    _example_load(saved, _checkpoint())
    dcp.save(get_model_state_dict(saved), checkpoint_id=directory)
    return {"example": _side_by_side(rank, _example_load),
            "example without to_empty": _side_by_side(rank, _example_load, to_empty=False),
            "dcp": _side_by_side(rank, _dcp_load(directory)),
            "broadcast": _side_by_side(rank, _broadcast_load)}


# ---- every other way to set values --------------------------------------------------------
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)  # 5 and 3 rows: padded shards

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _net(fs, meta=False):
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        model = Net()
    fs(model.a)
    fs(model)
    if meta:
        model.to_empty(device="cpu")
    return model


def _values():
    torch.manual_seed(7)
    return Net().state_dict()


def _sharded(sd, mesh, placements=(Shard(0),)):
    return {k: distribute_tensor(v, mesh, list(placements)) for k, v in sd.items()}


def _each_param(fn):
    def act(model):
        with torch.no_grad():
            for name, p in list(model.named_parameters()):
                fn(model, name, p)
    return act


def _set(model, name, value):
    module, _, attr = name.rpartition(".")
    setattr(model.get_submodule(module), attr, value)


def _paths(mesh):
    """name: (build on the meta device and to_empty, the action on the model)."""
    sd = _values()
    dt = _sharded(sd, mesh)
    return {
        "load_state_dict": (False, lambda m: m.load_state_dict(_sharded(sd, mesh))),
        "load_state_dict meta": (True, lambda m: m.load_state_dict(_sharded(sd, mesh))),
        "load_state_dict assign": (False, lambda m: m.load_state_dict(_sharded(sd, mesh), assign=True)),
        "load_state_dict assign meta": (True, lambda m: m.load_state_dict(
            {k: nn.Parameter(v) for k, v in _sharded(sd, mesh).items()}, strict=False, assign=True)),
        "load_state_dict full": (False, lambda m: m.load_state_dict(_values())),
        "load_state_dict full assign": (False, lambda m: m.load_state_dict(_values(), assign=True)),
        "load_state_dict replicated assign": (False, lambda m: m.load_state_dict(
            _sharded(sd, mesh, (Replicate(),)), assign=True)),
        "set_model_state_dict full": (True, lambda m: set_model_state_dict(
            m, _values(), options=StateDictOptions(full_state_dict=True))),
        "set_model_state_dict sharded": (True, lambda m: set_model_state_dict(m, _sharded(sd, mesh))),
        "param.copy_": (False, _each_param(lambda m, n, p: p.copy_(dt[n]))),
        "param.copy_ full": (False, _each_param(lambda m, n, p: p.copy_(sd[n]))),
        "to_local().copy_": (False, _each_param(lambda m, n, p: p.to_local().copy_(dt[n].to_local()))),
        "param.data": (False, _each_param(lambda m, n, p: setattr(p, "data", dt[n]))),
        "param.data reshaped": (False, _each_param(
            lambda m, n, p: setattr(p, "data", distribute_tensor(sd[n][:2], mesh, [Shard(0)])))),
        "setattr": (False, _each_param(lambda m, n, p: _set(m, n, nn.Parameter(dt[n])))),
        "setattr after a forward": (False, lambda m: (_forward(m), _each_param(
            lambda m, n, p: _set(m, n, nn.Parameter(dt[n])))(m))),
        "to_empty reset_parameters": (True, lambda m: [mod.reset_parameters() for mod in m.modules()
                                                       if hasattr(mod, "reset_parameters")]),
        "nn.init": (False, _each_param(lambda m, n, p: (nn.init.trunc_normal_(p), nn.init.uniform_(p))
                                       if p.dim() == 1 else nn.init.xavier_uniform_(p))),
    }


def _full(model):
    return [(p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()).clone()
            for p in model.parameters()]


def _forward(model):
    model(torch.ones(2, 4)).sum().backward()


def _try(fs, meta, act):
    """(what the first step to fail raised, or None; the values after the action, and after a
    forward and backward)."""
    model = _net(fs, meta)
    torch.manual_seed(11)  # (the random initialisations: alike for both)
    values = []
    for step in (act, lambda m: values.append(_full(m)), _forward, lambda m: values.append(_full(m))):
        err = error_of(step, model)
        if err is not None:
            return err, values
    return None, values


def _path_checks(world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    expected = [t.clone() for t in _values().values()]
    out = {}
    for case, (meta, act) in _paths(mesh).items():
        (p_err, (p_before, p_after)), (t_err, (t_before, t_after)) = (
            (err, values + [None] * (2 - len(values))) for err, values in
            (_try(fs, meta, act) for fs in FS.values()))
        res = {"phalanx_error": p_err, "torch_error": t_err,
               "torch_kept": t_before is not None and t_after is not None
               and all(map(torch.equal, t_before, t_after))}
        if p_err is None and t_err is None:
            res["equal"] = all(map(torch.equal, p_before + p_after, t_before + t_after))
            res["kept"] = all(map(torch.equal, p_before, p_after))  # (the forward lost nothing)
            res["expected"] = all(map(torch.equal, p_after, expected))
        out[case] = res
    out["optimizer"] = _optimizer_before_assign(mesh)
    out["torch helpers"] = _torch_helpers()
    return out


def _optimizer_before_assign(mesh):
    """An optimizer built before ``load_state_dict(assign=True)``: torch's keeps the old
    Parameters (no longer the module's: its steps change nothing the model uses); phalanx's
    units keep their Parameters, so it trains as one built after the load."""
    out = {}
    for name, fs in FS.items():
        for when in ("before", "after"):
            model = _net(fs)
            opt = torch.optim.SGD(model.parameters(), lr=0.5) if when == "before" else None
            model.load_state_dict(_sharded(_values(), mesh), assign=True)
            opt = opt or torch.optim.SGD(model.parameters(), lr=0.5)
            start = _full(model)
            _forward(model)
            opt.step()
            out[f"{name} {when}"] = _full(model)
            out[f"{name} {when} moved"] = not all(map(torch.equal, start, out[f"{name} {when}"]))
    return {"phalanx_same": all(map(torch.equal, out["phalanx before"], out["phalanx after"])),
            "phalanx_equal_torch_after": all(map(torch.equal, out["phalanx after"], out["torch after"])),
            "moved": {k: v for k, v in out.items() if k.endswith("moved")}}


def _torch_helpers():
    """torch.distributed.fsdp's helpers that check the class, on a phalanx unit: torch's
    register_fsdp_forward_method gathers as phalanx's; one needing more of torch's state
    raises, naming it."""
    model = _net(fully_shard)
    x = torch.ones(2, 4)
    model.total = lambda x: model.b(torch.relu(model.a(x))).sum()  # (not through forward)
    torch_register(model, "total")
    seq = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    fully_shard(seq)
    return {"isinstance": isinstance(model, TorchFSDPModule) and isinstance(model.a, TorchFSDPModule),
            "register": error_of(lambda: model.total(x)) or torch.equal(model.total(x).detach(),
                                                                       model(x).sum().detach()),
            "share_comm_ctx": error_of(share_comm_ctx, [model]),
            "private": error_of(lambda: model._set_unshard_async_op(True)),
            "indexing": type(seq[0:1]).__name__}  # (FSDPModule.__new__: the original class)


def _all_checks(rank, world_size, directory):
    return {"resumes": _resumes(rank, world_size, directory), "paths": _path_checks(world_size)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_all_checks, WORLD, str(tmp_path_factory.mktemp("fsdp_values")), timeout=300)


@pytest.mark.parametrize("how", ["example", "example without to_empty", "dcp", "broadcast"])
def test_resume_is_torchs_bit_for_bit(results, how):
    """The example's resume (load_state_dict assign=True), DCP, and the broadcast of a full
    state dict: the loaded shards and the losses and parameters after training are torch's."""
    for rank, out in enumerate(results):
        res = out["resumes"][how]
        assert res["torch_rows"] and res["torch_dtensors"], (how, rank, "the oracle")
        assert res["phalanx_rows"] and res["phalanx_dtensors"], (how, rank, res)
        assert res["loaded_equal"], (how, rank)
        assert res["phalanx_losses"] == res["torch_losses"], (how, rank, res)
        assert res["trained_equal"] and res["trained_moved"], (how, rank)
        # the example's `assert isinstance(model, FSDPModule)`, torch's class
        assert res["phalanx_isinstance"] and res["torch_isinstance"], (how, rank)


# Paths torch refuses with DTensor's own error (a full tensor copied into a shard): phalanx's
# is the same; those it refuses by accident (an AttributeError, a narrow past the end):
# phalanx refuses with a ValueError naming the parameter.
SAME_ERROR = {"load_state_dict full", "param.copy_ full"}
REFUSED = {"load_state_dict full assign", "load_state_dict replicated assign", "param.data reshaped"}
# torch takes no value (a DTensor keeps its local tensor), and neither does phalanx
IGNORED = {"param.data"}
# torch drops the value at its next all-gather (it resets its parameters at its first
# forward only); phalanx keeps it
TORCH_LOSES = {"setattr after a forward"}
# values of the random generator, not of a state dict
RANDOM = {"to_empty reset_parameters", "nn.init"}


def test_every_value_setting_path_is_torchs_or_raises(results):
    for rank, out in enumerate(results):
        paths = {k: v for k, v in out["paths"].items() if k not in ("optimizer", "torch helpers")}
        assert len(paths) == 18, sorted(paths)
        for case, res in paths.items():
            p_err, t_err = res["phalanx_error"], res["torch_error"]
            if case in SAME_ERROR:
                assert t_err is not None and p_err == t_err, (case, rank, res)
            elif case in REFUSED:
                assert t_err is not None, (case, rank, "torch's behaviour changed", res)
                assert p_err[0] == "ValueError", (case, rank, res)
                assert p_err[1].startswith("phalanx.fully_shard: parameter 'weight' of "), res
            elif case in TORCH_LOSES:
                assert t_err is None and not res["torch_kept"], (case, rank, "torch keeps it now", res)
                assert p_err is None and res["kept"] and res["expected"], (case, rank, res)
            else:
                assert p_err is None and t_err is None, (case, rank, res)
                assert res["equal"] and res["kept"] and res["torch_kept"], (case, rank, res)
                assert res["expected"] is (case not in IGNORED | RANDOM), (case, rank, res)


def test_refusals_name_the_parameter(results):
    paths = results[0]["paths"]
    err = paths["load_state_dict full assign"]["phalanx_error"]
    assert err[0] == "ValueError", err
    assert "was set to a Parameter of shape (5, 4), expected a DTensor" in err[1], err
    err = paths["load_state_dict replicated assign"]["phalanx_error"]
    assert err[0] == "ValueError" and "placements (Replicate(),) (expected (Shard(dim=0),))" in err[1], err
    err = paths["param.data reshaped"]["phalanx_error"]
    assert err[0] == "ValueError" and "had its .data set to a tensor of shape (2, 5)" in err[1], err


def test_an_optimizer_built_before_assign_still_trains(results):
    for rank, out in enumerate(results):
        opt = out["paths"]["optimizer"]
        assert opt["phalanx_same"] and opt["phalanx_equal_torch_after"], (rank, opt)
        moved = opt["moved"]
        assert moved["phalanx before moved"] and moved["torch after moved"], (rank, moved)
        assert not moved["torch before moved"], (rank, "torch's stale optimizer now trains: update the docs")


def test_torch_helpers_on_a_phalanx_unit(results):
    helpers = results[0]["paths"]["torch helpers"]
    assert helpers["isinstance"] and helpers["register"] is True, helpers
    err = helpers["share_comm_ctx"]
    assert err[0] == "ValueError" and "torch's FSDP state has no '_comm_ctx'" in err[1], err
    err = helpers["private"]
    assert err[0] == "ValueError" and "does not support _set_unshard_async_op()" in err[1], err
    assert helpers["indexing"] == "Sequential"
