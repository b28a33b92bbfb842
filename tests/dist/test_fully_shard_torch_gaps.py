"""What torch's own FSDP2 tests do that ``phalanx.fully_shard`` got wrong, each against torch's
``fully_shard`` run in the same ranks.

* Tied weights in two units (``fully_shard(embed)``, ``fully_shard(head)`` with
  ``head.weight is embed.weight``): refused at the first forward with torch's words (each
  unit would train a copy of its own); in one unit (``fully_shard([embed, head])``) they
  train equal to torch's.
* A head sharded as a unit of its own, run outside the root's forward on chunks of the
  output (torch's chunked loss), one backward per chunk: through a detached output and then
  the trunk's backward (torchtitan's), or through the whole model each time
  (``retain_graph``). Equal to torch's bit for bit at world 2.
* Parameters that are DTensors already (tensor parallelism, ``parallelize_module``): refused
  by name at ``fully_shard``; torch's composes them.
* torch's ``copy.deepcopy`` and ``dcp.async_save``'s default stager on the sharded state:
  copies equal to the state, and an async save loaded back equal bit for bit, as torch's.
* World size 1: no collective at all in a training step (torch's runs none either), and
  the parameters equal to torch's bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from phalanx.diagnostics import ledger
from phalanx.fsdp import fully_shard
from tests.dist.test_fully_shard import _batch, _max_diff, _mine, _model, _shard, _step
from tests.dist.test_fully_shard_units import ChunkedGPT
from tests.harness import error_of, run_ranks
from tests.oracle import TORCH_2_13

STEPS = 3
# the head a unit of its own on chunks of a detached output, or of the output itself (each
# chunk's backward through the whole model); the head and the final norm one unit, detached
CHUNKED = ["detached", "retained", "grouped"]


def _tied_model(fs, grouped):
    """The GPT with its head tied to its embedding, the two sharded apart or as one unit."""
    model = _model(5)
    model.head.weight = model.embed.weight
    if grouped:
        fs([model.embed, model.head])
    else:
        fs(model.embed)
        fs(model.head)
    return _shard(model, fs)


def _tied(rank, world_size):
    """The refusal of each (its message, and a second forward's), and the one-unit form
    trained by both."""
    x, y = _mine(_batch(0, world_size), rank)
    apart = [_tied_model(fs, grouped=False) for fs in (fully_shard, torch_fully_shard)]
    out = {"refusals": [error_of(m, x) for m in apart], "again": error_of(apart[0], x)}
    models = [_tied_model(fs, grouped=True) for fs in (fully_shard, torch_fully_shard)]
    out["tied_in_one_unit"] = models[0].head.weight is models[0].embed.weight
    out.update(_trained(models, lambda m, step: F.cross_entropy(m(x), y), world_size))
    return out


def _trained(models, loss_of, world_size):
    """``STEPS`` AdamW steps of phalanx's model and torch's (``loss_of(model, step)``, whose
    backwards it runs itself or returns a loss to go backward): whether every gradient and
    shard is torch's, and how far training moved them."""
    opts = [torch.optim.AdamW(m.parameters(), lr=5e-3, weight_decay=0.1) for m in models]
    before = [p.detach().full_tensor() for p in models[0].parameters()]
    grads_equal = True
    for step in range(STEPS):
        for model in models:
            loss = loss_of(model, step)
            if loss is not None:
                loss.backward()
        grads_equal &= all(p.grad is not None and torch.equal(p.grad.to_local(), q.grad.to_local())
                           for p, q in zip(*(m.parameters() for m in models)))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    params = [list(m.parameters()) for m in models]
    return {"grads_equal": grads_equal,
            "equal": all(torch.equal(p.to_local(), q.to_local()) for p, q in zip(*params)),
            "moved": _max_diff((p.detach().full_tensor(), b) for p, b in zip(params[0], before))}


def _chunked_model(fs, grouped):
    torch.manual_seed(6)
    model = ChunkedGPT(vocab=50, tokens=8, dim=18, depth=3, heads=3)
    for block in model.blocks:
        fs(block)
    if grouped:
        fs([model.ln, model.head])
    else:
        fs(model.ln)  # run by the root's forward
        fs(model.head)  # run by the loop, on chunks of the root's output
    return fs(model)


def _chunked_loss(detached):
    """Two chunks of sequences, each through the head and backward by itself; ``detached``:
    the chunks of a detached output, then the trunk's backward with their gradients
    (torchtitan's); else the whole model's backward for each chunk (``retain_graph``)."""
    def loss_of(model, step):
        x, y = _mine(_batch(step, 2), torch.distributed.get_rank())
        h = model(x)
        trunk = h.detach().requires_grad_() if detached else h
        half = x.shape[0] // 2
        for i, rows in enumerate((slice(0, half), slice(half, None))):
            logits = model.head(trunk[rows]).flatten(0, 1)
            loss = F.cross_entropy(logits, y.view(x.shape[0], -1)[rows].flatten()) / 2
            loss.backward(retain_graph=not detached and i == 0)
        if detached:
            h.backward(trunk.grad)
        return None
    return loss_of


def _tensor_parallel(rank, world_size):
    """A 2-D mesh (dp 1, tp 2), the MLP's layers parallelised on tp: phalanx's fully_shard on
    dp refuses; torch's composes them (a training step runs)."""
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))
    out = {}
    for name, fs in (("phalanx", fully_shard), ("torch", torch_fully_shard)):
        torch.manual_seed(7)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 6))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        out[name] = error_of(fs, model, mesh=mesh["dp"])
        if out[name] is None:
            model(torch.randn(3, 6)).sum().backward()
            out["trained"] = all(p.grad is not None for p in model.parameters())
    return out


def _staged(rank, world_size, directory):
    """torch's deepcopy and dcp.async_save's default stager on each sharded model's state,
    after two steps: the copies equal and apart from the model; the async save, made before a
    third step, loaded into a fresh model equals the state when it was saved, bit for bit."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    group = dist.new_group(backend="gloo")  # the save's collectives, apart from training's
    out = {}
    for name, fs in (("phalanx", fully_shard), ("torch", torch_fully_shard)):
        model = _shard(_model(9), fs)
        opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
        for step in range(2):
            _step(model, opt, *_mine(_batch(step, world_size), rank))
        state = model.state_dict()
        copies = {k: copy.deepcopy(v) for k, v in state.items()}
        apart = all(c.to_local().data_ptr() != v.to_local().data_ptr() for k, v in state.items()
                    for c in [copies[k]] if v.to_local().numel())
        before = {k: v.full_tensor() for k, v in state.items()}
        future = dcp.async_save({"model": state}, checkpoint_id=f"{directory}/{name}", process_group=group)
        _step(model, opt, *_mine(_batch(2, world_size), rank))  # the copy was taken before
        future.result()
        fresh = _shard(_model(10), fs)
        target = {"model": fresh.state_dict()}
        dcp.load(target, checkpoint_id=f"{directory}/{name}")
        fresh.load_state_dict(target["model"])
        out[name] = {"deepcopy": all(torch.equal(copies[k].full_tensor(), before[k]) for k in state) and apart,
                     "async_save": all(torch.equal(v.full_tensor(), before[k]) for k, v in fresh.state_dict().items()),
                     "moved": _max_diff((model.state_dict()[k].full_tensor(), before[k]) for k in before)}
    dist.destroy_process_group(group)
    return out


def _gaps(rank, world_size, directory):
    out = {"tied": _tied(rank, world_size), "tensor_parallel": _tensor_parallel(rank, world_size),
           "staged": _staged(rank, world_size, directory)}
    for case in CHUNKED:
        grouped = case == "grouped"
        # torch 2.11's fully_shard fails the grouped case itself (in the trunk's backward: "The
        # tensor has a non-zero number of elements, but its data is not allocated yet"): there
        # torch's model is the detached case's, the same training (torch 2.13 gives both, and
        # phalanx's grouped, the same bits)
        models = [_chunked_model(fully_shard, grouped), _chunked_model(torch_fully_shard, grouped and TORCH_2_13)]
        out[case] = _trained(models, _chunked_loss(detached=case != "retained"), world_size)
    return out


def _alone(rank, world_size):
    """World size 1: the c10d collectives of each training step (torch's profiler sees every
    one, whoever issues it) and phalanx's ledger's records, for phalanx's model and torch's."""
    base = _model(8)
    models = [_shard(copy.deepcopy(base), fs) for fs in (fully_shard, torch_fully_shard)]
    opts = [torch.optim.AdamW(m.parameters(), lr=5e-3) for m in models]
    collectives = [[], []]
    for step in range(STEPS):
        x, y = _mine(_batch(step, world_size), rank)
        for model, opt, seen in zip(models, opts, collectives):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            seen += [e.name for e in prof.events() if e.name.startswith("c10d::")]
    params = [list(m.parameters()) for m in models]
    state = fully_shard.state(models[0])
    try:
        state._fsdp_param_group
        private = None
    except ValueError as e:
        private = str(e)
    return {"state": [fully_shard.state(m) is None for m in (base, models[0])],
            "torch_state": [torch_fully_shard.state(m) is None for m in (base, models[1])],
            "private": private, "forward_hook": callable(state._pre_forward),
            "collectives": collectives, "recorded": sum(len(log.records) for log in ledger().logs.values()),
            "equal": all(torch.equal(p.to_local(), q.to_local()) for p, q in zip(*params)),
            "moved": _max_diff((p.detach().full_tensor(), b) for p, b in zip(params[0], base.parameters()))}


# the world-2 spawn behind these (7-19 s) runs in the slow tier; world 1 stays in the fast one
@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_gaps, 2, str(tmp_path_factory.mktemp("staged")), timeout=300)


@pytest.mark.slow
def test_tied_parameters_in_two_units_refused_as_torch(ranks):
    for rank, out in enumerate(ranks):
        ours, theirs = out["tied"]["refusals"]
        assert ours is not None and ours[0] == "ValueError" and "'embed.weight'" in ours[1], (rank, ours)
        assert out["tied"]["again"] == ours, (rank, out["tied"]["again"])
        if theirs is None and not TORCH_2_13:
            continue  # torch 2.11's fully_shard raises nothing here (the skip below)
        assert theirs is not None and theirs[0] == "ValueError", (rank, theirs)
        assert ours[1].startswith(theirs[1]), (rank, ours, theirs)
    if any(out["tied"]["refusals"][1] is None for out in ranks):
        pytest.skip(f"phalanx's refusal checked, not against torch's words: torch {torch.__version__}'s "
                    "fully_shard does not refuse tied parameters in two units")


@pytest.mark.slow
def test_tied_parameters_in_one_unit_train_as_torch(ranks):
    for rank, out in enumerate(ranks):
        res = out["tied"]
        assert res["tied_in_one_unit"] and res["moved"] > 1e-2, (rank, res)
        assert res["grads_equal"] and res["equal"], (rank, res)


@pytest.mark.slow
@pytest.mark.parametrize("case", CHUNKED)
def test_head_unit_on_chunks_trains_as_torch(ranks, case):
    for rank, out in enumerate(ranks):
        res = out[case]
        assert res["moved"] > 1e-2, (rank, res)
        assert res["grads_equal"] and res["equal"], (rank, res)


@pytest.mark.slow
def test_torch_stagers_copy_the_shards_as_torchs(ranks):
    """copy.deepcopy and dcp.async_save's default stager copied phalanx's shards wrongly
    while they were views at a storage offset inside the unit's flat buffer (the DTensor
    wrapper took that offset: a nonzero data_ptr on a storage without memory)."""
    for rank, out in enumerate(ranks):
        for name in ("phalanx", "torch"):
            res = out["staged"][name]
            assert res["deepcopy"] and res["async_save"] and res["moved"] > 0, (rank, name, res)


@pytest.mark.slow
def test_tensor_parallel_parameters_refused_by_name(ranks):
    for rank, out in enumerate(ranks):
        res = out["tensor_parallel"]
        assert res["torch"] is None and res["trained"], (rank, res)
        kind, message = res["phalanx"]
        assert kind == "ValueError", (rank, res)
        assert "does not support parameters that are DTensors" in message, message
        assert "0.weight" not in message and "weight is one" in message, message
        assert "torch's fully_shard" in message, message


def test_world_size_one_runs_no_collective():
    out, = run_ranks(_alone, 1, timeout=120)
    assert out["moved"] > 1e-2, out
    assert out["collectives"] == [[], []] and out["recorded"] == 0, out
    assert out["equal"], out
    # fully_shard.state(module): None where it was not applied, as torch's; a unit's state
    # that names what torch's FSDPState has and phalanx's does not
    assert out["state"] == [True, False] and out["torch_state"] == [True, False], out
    assert out["forward_hook"], out
    assert "torch's FSDP state has no '_fsdp_param_group'" in out["private"], out
