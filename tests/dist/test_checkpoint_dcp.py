"""Checkpointer(format="sharded"): torch DCP directories, every rank writing its part.

Saved at world 2 and 3 (fully_shard, DDP), loaded at 1, 2 and 3 into both layouts, equal bit
for bit; torch's dcp.load and dcp_to_torch_save reading phalanx's; phalanx reading torch's
dcp.save; damage named and set aside; processes SIGKILLed during blocking and background saves.
"""

import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

import phalanx
from phalanx.checkpoint import Checkpointer, dcp_checkpoint, dcp_engine, dcp_layout
from phalanx.errors import CheckpointError
from phalanx.fsdp import fully_shard
from tests.dist.test_fully_shard import VOCAB, _model, _shard
from tests.harness import RankError, error_of, run_ranks

LAYOUTS = ("fully_shard", "ddp")


def _build(layout, seed):
    model = _model(seed)
    model = _shard(model, fully_shard) if layout == "fully_shard" else phalanx.DistributedDataParallel(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _full(t):
    """A tensor's whole value as (dtype, shape, bytes): compared bit for bit, and sent back
    from a rank without shared memory."""
    t = t.full_tensor() if isinstance(t, DTensor) else t.detach()
    return str(t.dtype), tuple(t.shape), t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _snapshot(model, opt):
    """Model and optimizer state, whole tensors (collectives under fully_shard)."""
    module = model.module if isinstance(model, phalanx.DistributedDataParallel) else model
    state = {k: _full(v) for k, v in module.state_dict().items()}
    osd = get_optimizer_state_dict(module, opt, options=StateDictOptions(full_state_dict=True))
    state.update({f"optim.{fqn}.{n}": _full(v) for fqn, s in osd["state"].items() for n, v in s.items()})
    state["param_groups"] = osd["param_groups"]
    return state


def _save(rank, world_size, directory, layout):
    torch.manual_seed(7)
    model, opt = _build(layout, 0)
    for step in range(2):  # every rank the same batch: DDP and fully_shard train alike
        x = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(step))
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    ckpt = Checkpointer(directory, model, opt, format="sharded")
    path = ckpt.save(1, 2, extra={"note": "hi"})
    ckpt.close()
    module = model.module if layout == "ddp" else model
    dcp.save({"model": module.state_dict()}, checkpoint_id=Path(directory) / "torch")  # torch's own
    files = {n: (Path(path) / n).stat().st_size for n in os.listdir(path) if n.endswith(".distcp")}
    return _snapshot(model, opt), files


def _load(rank, world_size, directories, layout):
    out = {}
    for name, directory in directories.items():
        model, opt = _build(layout, 1)  # other values everywhere
        state = Checkpointer(directory, model, opt, format="sharded").load()
        out[name] = (_snapshot(model, opt), state.step, state.world_size, state.extra)
        torch_model, _ = _build(layout, 2)
        Checkpointer(Path(directory) / "torch", torch_model).load(resume=Path(directory) / "torch")
        out[name + "-from-torch"] = _snapshot(torch_model, torch.optim.AdamW(torch_model.parameters()))
        module = model.module if layout == "ddp" else model
        # torch's dcp.load reads phalanx's directory as it is
        plain, _ = _build(layout, 3)
        target = {"model": (plain.module if layout == "ddp" else plain).state_dict()}
        dcp.load(target, checkpoint_id=state.path)
        out[name + "-dcp.load"] = {k: _full(v) for k, v in target["model"].items()}
        del module
    return out


def _equal(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if key == "param_groups":
            assert a[key] == b[key]
        else:
            assert a[key] == b[key], key


@pytest.mark.slow
def test_save_and_load_across_world_sizes_and_layouts(tmp_path):
    saved, files = {}, {}
    for world, layout in ((2, "fully_shard"), (3, "ddp")):
        name = f"w{world}-{layout}"
        results = run_ranks(_save, world, tmp_path / name, layout)
        saved[name], files[name] = results[0][0], results[0][1]
    # every rank wrote its part; the replicated (DDP) tensors are spread, not all on rank 0
    assert sorted(files["w2-fully_shard"]) == ["__0_0.distcp", "__1_0.distcp"]
    ddp = files["w3-ddp"]
    assert len(ddp) == 3 and max(ddp.values()) < 0.6 * sum(ddp.values()), ddp
    directories = {name: tmp_path / name for name in saved}
    for world in (1, 2, 3):
        for layout in LAYOUTS:
            results = run_ranks(_load, world, directories, layout, timeout=300)
            for name, reference in saved.items():
                snap, step, saved_world, extra = results[0][name]
                _equal(snap, reference)
                assert (step, saved_world, extra) == (2, int(name[1]), {"note": "hi"})
                model_only = {k: v for k, v in reference.items() if "." in k and not k.startswith("optim.")}
                got = {k: v for k, v in results[0][name + "-from-torch"].items() if k in model_only}
                _equal(got, model_only)
                _equal(results[0][name + "-dcp.load"], model_only)
    # torch's converter reads it as it is
    dcp_to_torch_save(next(Path(tmp_path / "w2-fully_shard").glob("ckpt-*.dcp")), tmp_path / "one.pt")
    whole = torch.load(tmp_path / "one.pt", weights_only=True)
    _equal({k: _full(v) for k, v in whole["model"].items()},
           {k: v for k, v in saved["w2-fully_shard"].items() if "." in k and not k.startswith("optim.")})
