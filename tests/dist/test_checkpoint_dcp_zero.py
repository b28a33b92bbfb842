"""Checkpointer(format="sharded") with phalanx's ZeroRedundancyOptimizer (ZeRO-2: DDP's
shard_gradients): every rank writes the optimizer state it owns.

Saved with ZeRO-2 at world 2 (blocking) and 3 (blocking=False), loaded at 1, 2 and 3 into
DDP+ZeRO-2, DDP with the plain AdamW and fully_shard, equal bit for bit to the state the saving
job had, gathered (``consolidate_state_dict``, torch's ``get_optimizer_state_dict``); each
optimizer entry lies in its owner's file; a fully_shard checkpoint loads into ZeRO; other
param groups are refused; non-tensor state of every owner is kept; each rank reads at most
1.2x its share (rchar, /proc/self/io).
"""

import os
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import phalanx
from phalanx.checkpoint import Checkpointer
from phalanx.fsdp import fully_shard
from tests.dist.test_checkpoint_dcp import _full, _rchar, _snapshot
from tests.dist.test_fully_shard import VOCAB, _model, _shard
from tests.harness import error_of, run_ranks

LAYOUTS = ("zero", "ddp", "fully_shard")


def _build(layout, seed, model=None):
    model = _model(seed) if model is None else model
    if layout == "fully_shard":
        model = _shard(model, fully_shard)
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)
    ddp = phalanx.DistributedDataParallel(model)
    if layout == "ddp":
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=0.01)
    opt = phalanx.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=0.01)
    ddp.shard_gradients(opt)  # ZeRO-2
    return ddp, opt


def _zero_snapshot(ddp, zero):
    """As test_checkpoint_dcp._snapshot, of DDP+ZeRO: the optimizer consolidated on rank 0
    (``None`` elsewhere), keyed by parameter name."""
    module = ddp.module
    zero.consolidate_state_dict(to=0)
    if phalanx.get_rank() != 0:
        return None
    names = {id(p): n for n, p in module.named_parameters()}
    params = [p for g in zero.param_groups for p in g["params"]]
    sd = zero.state_dict()
    state = {k: _full(v) for k, v in module.state_dict().items()}
    state.update({f"optim.{names[id(params[i])]}.{n}": _full(v)
                  for i, s in sd["state"].items() for n, v in s.items()})
    state["param_groups"] = [{**{k: v for k, v in g.items() if k not in ("params", "param_names")},
                              "params": [names[id(params[i])] for i in g["params"]]}
                             for g in sd["param_groups"]]
    return state


def _snap(layout, model, opt):
    return _zero_snapshot(model, opt) if layout == "zero" else _snapshot(model, opt)


def _train(model, opt, steps=2):
    for step in range(steps):  # every rank its own batch: DDP averages
        g = torch.Generator().manual_seed(100 * step + phalanx.get_rank())
        x = torch.randint(0, VOCAB, (2, 8), generator=g)
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()


def _save(rank, world_size, directory, blocking):
    model, opt = _build("zero", 0)
    _train(model, opt)
    ckpt = Checkpointer(Path(directory) / "zero", model, opt, format="sharded")
    path = ckpt.save(1, 2, extra={"note": "zero"}, blocking=blocking)
    ckpt.close()
    names = {id(p): n for n, p in model.module.named_parameters()}
    owners = {names[id(p)]: o for p, o in zip((p for g in opt.param_groups for p in g["params"]),
                                              opt.param_owners)}
    saved = _snap("zero", model, opt)
    # a fully_shard run's checkpoint, to load into ZeRO
    fs, fs_opt = _build("fully_shard", 0)
    _train(fs, fs_opt)
    Checkpointer(Path(directory) / "fs", fs, fs_opt, format="sharded").save(1, 2)
    return saved, _snapshot(fs, fs_opt), owners, str(path)


def _load(rank, world_size, directory):
    out = {}
    for source in ("zero", "fs"):
        for layout in LAYOUTS:
            if source == "fs" and layout != "zero":
                continue  # (fully_shard's checkpoint in DDP and fully_shard: test_checkpoint_dcp.py)
            model, opt = _build(layout, 1)  # other values everywhere
            state = Checkpointer(Path(directory) / source, model, opt, format="sharded").load()
            out[source, layout] = (_snap(layout, model, opt), state.step, state.world_size, state.extra)
            if layout == "zero":  # it trains on, its owners' new values broadcast to every rank
                _train(model, opt, steps=1)
                out[source, "trained"] = _snap(layout, model, opt)
    # an optimizer that does not fit: named, on every rank
    ddp = phalanx.DistributedDataParallel(_model(1))
    params = list(ddp.parameters())
    two_groups = phalanx.ZeroRedundancyOptimizer([{"params": params[:2]}, {"params": params[2:]}],
                                                 torch.optim.AdamW, lr=0.01)
    out["misfit"] = error_of(Checkpointer(Path(directory) / "zero", ddp, two_groups, format="sharded").load)
    return out


def _equal(got, expected, what):
    assert got.keys() == expected.keys(), (what, sorted(set(got) ^ set(expected))[:5])
    for key in expected:
        assert got[key] == expected[key], (what, key)


def _writers(path):
    """The rank whose file holds each optimizer entry: {parameter name: {rank}}."""
    metadata = FileSystemReader(path).read_metadata()
    found = {}
    for index, info in metadata.storage_data.items():
        at = metadata.planner_data[index.fqn]
        if at[:2] == ("optimizer", "state"):
            found.setdefault(at[2], set()).add(int(info.relative_path.split("_")[2]))
    return found


@pytest.mark.slow
def test_zero2_saves_its_shards_and_loads_in_every_layout_at_every_world_size(tmp_path):
    saved = {}
    for world, blocking in ((2, True), (3, False)):
        directory = tmp_path / f"w{world}"
        zero, fs, owners, path = run_ranks(_save, world, directory, blocking, timeout=300)[0]
        saved[world] = (zero, fs)
        # each optimizer entry written once, by the rank that owns it (step, exp_avg, exp_avg_sq)
        assert _writers(path) == {name: {owner} for name, owner in owners.items()}, world
        assert len(set(owners.values())) == world
        files = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))
        assert files == [f"__{r}_0.distcp" for r in range(world)]
    for world in (1, 2, 3):
        for saved_at, (zero, fs) in saved.items():
            out = run_ranks(_load, world, tmp_path / f"w{saved_at}", timeout=300)[0]
            for layout in LAYOUTS:
                snap, step, saved_world, extra = out["zero", layout]
                _equal(snap, zero, (saved_at, world, layout))
                assert (step, saved_world, extra) == (2, saved_at, {"note": "zero"})
            _equal(out["fs", "zero"][0], fs, (saved_at, world, "fully_shard into zero"))
            # a step after loading changes the state: the loaded ZeRO is live, not a copy
            assert out["zero", "trained"]["optim.head.weight.exp_avg"] != zero["optim.head.weight.exp_avg"]
            kind, message = out["misfit"]
            assert kind == "CheckpointError" and "its optimizer state has 1 parameter groups, the " \
                "optimizer given has 2" in message, out["misfit"]


def _wide_zero(seed):
    """8 MB of parameters, 16 MB of AdamW state, DDP + ZeRO-2 (as test_checkpoint_dcp._wide)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(8)))
    return _build("zero", None, model)


def _read_bytes(rank, world_size, directory, save):
    if save:
        model, opt = _wide_zero(0)
        model(torch.randn(4, 512)).sum().backward()
        opt.step()
        Checkpointer(directory, model, opt, format="sharded").save(0, 1)
    path = Path(directory) / "ckpt-000000000001.dcp"
    everyone = sum(f.stat().st_size for f in path.iterdir() if not f.name.endswith(".distcp"))
    model, opt = _wide_zero(1)
    # its share: the whole model (DDP: every rank holds it) and the AdamW state of the
    # parameters it owns at this world size (exp_avg, exp_avg_sq, a 4-byte step)
    params = [p for g in opt.param_groups for p in g["params"]]
    owned = sum(2 * p.numel() * p.element_size() + 4
                for p, o in zip(params, opt.param_owners) if o == opt.rank)
    model_bytes = sum(p.numel() * p.element_size() for p in params)
    ckpt = Checkpointer(directory, model, opt, format="sharded")
    before = _rchar()
    ckpt.load()
    return _rchar() - before, model_bytes + owned + everyone, owned


@pytest.mark.slow
def test_each_zero_rank_reads_its_share(tmp_path):
    """Saved at world 2, loaded at 2 and at 3: a rank reads the model and the optimizer state
    it owns, at most 1.2x that (plus the small files every rank reads)."""
    for world, save in ((2, True), (3, False)):
        results = run_ranks(_read_bytes, world, tmp_path, save, timeout=200)
        assert sum(owned for *_, owned in results) == 2 * 8 * (512 * 512 + 512) * 4 + 16 * 4  # each once
        for rank, (read, share, _) in enumerate(results):
            assert read <= 1.2 * share, (world, rank, read, share)


class _Counting(torch.optim.SGD):
    """SGD keeping non-tensor entries per parameter (a count, a float of its size): what DCP
    does not store and phalanx's state file must carry, from every owner. (Not a string:
    torch's Optimizer.load_state_dict turns a string into the repr of a generator.)"""

    def step(self, closure=None):
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["count"] = state.get("count", 0) + 1
                state["tag"] = float(p.numel())


def _non_tensor(rank, world_size, directory):
    torch.manual_seed(0)
    ddp = phalanx.DistributedDataParallel(_model(0))
    zero = phalanx.ZeroRedundancyOptimizer(ddp.parameters(), _Counting, lr=0.01, momentum=0.9)
    for _ in range(3):
        _train(ddp, zero, steps=1)
    Checkpointer(directory, ddp, zero, format="sharded").save(0, 1)
    fresh = phalanx.DistributedDataParallel(_model(1))
    loaded = phalanx.ZeroRedundancyOptimizer(fresh.parameters(), _Counting, lr=0.01, momentum=0.9)
    Checkpointer(directory, fresh, loaded, format="sharded").load()
    plain = phalanx.DistributedDataParallel(_model(2))
    sgd = _Counting(plain.parameters(), lr=0.01, momentum=0.9)
    Checkpointer(directory, plain, sgd, format="sharded").load()
    loaded.consolidate_state_dict(to=0)
    counts = None
    if rank == 0:
        counts = sorted({(s["count"], s["tag"]) for s in loaded.state_dict()["state"].values()})
    return counts, sorted({(s["count"], s["tag"]) for s in sgd.state.values()}), len(sgd.state)


@pytest.mark.slow
def test_non_tensor_optimizer_state_of_every_owner_is_kept(tmp_path):
    counts, plain, entries = run_ranks(_non_tensor, 2, tmp_path, timeout=200)[0]
    params = len(list(_model(0).parameters()))
    expected_tags = sorted({(3, float(p.numel())) for p in _model(0).parameters()})
    assert counts == expected_tags and plain == expected_tags and entries == params
