"""torch's FSDP (``fully_shard``) on a process group made by ``phalanx.init_process_group``:
it trains as close to one process on the global batch as it does on a Gloo group torch made,
and ``phalanx.Checkpointer`` saves and loads it (docs/sharding.md, the README's "works with" list)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import phalanx
from tests.harness import error_of, run_ranks
from tests.oracle import oracle_bound

_STEPS = 3
_MICRO = 4  # samples per rank per step


def _batch(step, world_size):
    g = torch.Generator().manual_seed(step)
    n = _MICRO * world_size
    return torch.randn(n, 8, generator=g), torch.randint(0, 2, (n,), generator=g)


def _step(model, opt, x, y):
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _fully_sharded_against_one_process(rank, world_size, directory):
    from torch.distributed.fsdp import fully_shard

    assert phalanx.is_initialized()  # the harness's group is phalanx's
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    model = copy.deepcopy(reference)
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    # the oracle: the same on a Gloo group torch made (its distance from one process: the bound)
    mesh = DeviceMesh.from_group(dist.new_group(backend="gloo"), "cpu")
    on_torchs = copy.deepcopy(reference)
    for layer in (on_torchs[0], on_torchs[2], on_torchs):
        fully_shard(layer, mesh=mesh)
    torchs_opt = torch.optim.AdamW(on_torchs.parameters(), lr=1e-2)
    mine = slice(rank * _MICRO, (rank + 1) * _MICRO)
    for step in range(_STEPS):
        x, y = _batch(step, world_size)
        _step(model, opt, x[mine], y[mine])
        _step(on_torchs, torchs_opt, x[mine], y[mine])
        _step(reference, reference_opt, x, y)  # the global batch, in one process
    full = {name: t.full_tensor() for name, t in model.state_dict().items()}
    torchs = {name: t.full_tensor() for name, t in on_torchs.state_dict().items()}
    phalanx.Checkpointer(f"{directory}/sharded", model, opt).save(0, _STEPS)
    phalanx.Checkpointer(f"{directory}/whole", reference, reference_opt).save(0, _STEPS)
    torch.manual_seed(1)  # other values, which the load replaces
    again = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    for layer in (again[0], again[2]):
        fully_shard(layer)
    fully_shard(again)
    again_opt = torch.optim.AdamW(again.parameters(), lr=1e-2)
    phalanx.Checkpointer(f"{directory}/sharded", again, again_opt).load()
    return {
        "reloaded": all(torch.equal(a.to_local(), b.to_local()) for a, b in
                        zip(again.state_dict().values(), model.state_dict().values())),
        "reloaded_state": all(torch.equal(again_opt.state[a]["exp_avg"].to_local(),
                                          opt.state[b]["exp_avg"].to_local())
                              for a, b in zip(again.parameters(), model.parameters())),
        "whole_refused": error_of(phalanx.Checkpointer(f"{directory}/whole", again, again_opt).load),
        "dim1": _dim1(directory),
        "sharded": all(t.to_local().numel() < t.numel() for t in model.state_dict().values()
                       if t.numel() >= world_size),
        "max_diff": max((full[n] - t).abs().max().item() for n, t in reference.state_dict().items()),
        "torch_max_diff": max((torchs[n] - t).abs().max().item() for n, t in reference.state_dict().items()),
        "magnitude": max(t.abs().max().item() for t in reference.state_dict().values()),
    }


def _dim1(directory):
    """Shards on dim 1 (torch's shard_placement_fn): not what the single file re-slices
    (refused); the sharded format, the default for a sharded model, takes them (DCP's own
    resharding), reloaded into a model initialised otherwise."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    def sharded(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        return fully_shard(model, shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else Shard(0))

    model, fresh = sharded(1), sharded(2)
    refused = error_of(phalanx.Checkpointer(f"{directory}/dim1", model, format="consolidated").save, 0, 1)
    ckpt = phalanx.Checkpointer(f"{directory}/dim1_dcp", model)
    ckpt.save(0, 1)
    differed = not all(torch.equal(a.to_local(), b.to_local())
                       for a, b in zip(model.parameters(), fresh.parameters()))
    phalanx.Checkpointer(f"{directory}/dim1_dcp", fresh).load()
    return {"refused": refused, "format": ckpt.format, "differed": differed,
            "reloaded": all(torch.equal(a.to_local(), b.to_local())
                            for a, b in zip(model.parameters(), fresh.parameters()))}


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    return run_ranks(_fully_sharded_against_one_process, 2, str(tmp_path_factory.mktemp("ckpt")))


def test_fully_shard_shards_the_parameters_on_a_phalanx_group(fsdp):
    assert [r["sharded"] for r in fsdp] == [True, True]


def test_fully_shard_trains_as_one_process_on_the_global_batch(fsdp):
    for result in fsdp:
        # as close as on a group torch made, in this run (tests.oracle)
        assert result["max_diff"] <= oracle_bound(result["torch_max_diff"], result["magnitude"]), result


def test_checkpointer_saves_and_loads_torchs_fully_sharded_model(fsdp):
    """(Other world sizes: tests/dist/test_fully_shard_checkpoint.py.)"""
    for result in fsdp:
        assert result["reloaded"] and result["reloaded_state"], result


def test_shards_on_another_dim_are_refused_by_the_single_file_and_kept_by_the_sharded_format(fsdp):
    for result in fsdp:
        kind, message = result["dim1"]["refused"]
        assert kind == "TypeError" and "but 0.weight has placements (Shard(dim=1),)" in message, result
        assert result["dim1"]["format"] == "sharded"  # format="auto", the default
        assert result["dim1"]["differed"] and result["dim1"]["reloaded"], result


def test_a_whole_model_checkpoint_is_refused_by_a_sharded_model(fsdp):
    for result in fsdp:
        kind, message = result["whole_refused"]
        assert kind == "CheckpointError" and "holds a model every rank held whole" in message, result
        assert "load it into the model before sharding it" in message
