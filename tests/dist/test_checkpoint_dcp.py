"""Checkpointer(format="sharded"): torch DCP directories, every rank writing its part.

Saved at world 2 and 3 (fully_shard, DDP), loaded at 1, 2 and 3 into both layouts, equal bit
for bit; torch's dcp.load and dcp_to_torch_save reading phalanx's; phalanx reading torch's
dcp.save; damage named and set aside; each rank reading its share, at the same world size and at
another (only the blocks of each stored chunk that hold its rows). (Processes killed mid-save:
test_checkpoint_dcp_kill.py.)
"""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

import phalanx
from phalanx.checkpoint import Checkpointer
from phalanx.fsdp import fully_shard
from tests.dist.test_fully_shard import VOCAB, _model, _shard
from tests.harness import error_of, run_ranks

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
    ckpt.save(1, 1)  # the one loaded is the second: its plans and .metadata's bytes reused (dcp_plan)
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
        # torch's dcp.load reads phalanx's directory as it is
        plain, _ = _build(layout, 3)
        target = {"model": (plain.module if layout == "ddp" else plain).state_dict()}
        dcp.load(target, checkpoint_id=state.path)
        out[name + "-dcp.load"] = {k: _full(v) for k, v in target["model"].items()}
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
    dcp_to_torch_save(max(Path(tmp_path / "w2-fully_shard").glob("ckpt-*.dcp")), tmp_path / "one.pt")
    whole = torch.load(tmp_path / "one.pt", weights_only=True)
    _equal({k: _full(v) for k, v in whole["model"].items()},
           {k: v for k, v in saved["w2-fully_shard"].items() if "." in k and not k.startswith("optim.")})


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-10])


# How each checkpoint of _damage is damaged, newest first, and the file its error names.
_DAMAGE = {5: ("__1_0.distcp", _flip), 4: (".metadata", _truncate),
           3: ("__0_0.distcp", os.unlink), 2: ("phalanx-manifest.json", _flip)}


def _damage(rank, world_size, directory):
    out = {}
    model, opt = _build("fully_shard", 0)
    ckpt = Checkpointer(directory, model, opt, format="sharded", keep=None)
    for step in range(1, 6):
        ckpt.save(0, step)
    paths = ckpt.checkpoints()
    import torch.distributed as dist
    if rank == 0:
        for step, (name, how) in _DAMAGE.items():
            how(paths[step - 1] / name)
    dist.barrier()
    for step in _DAMAGE:
        out[step] = error_of(ckpt.load, paths[step - 1])
    state = ckpt.load()  # "auto": the four newest are set aside, step 1 is loaded
    out["auto"] = state.step
    out["names"] = sorted(os.listdir(directory))
    # keep and resume="auto" across both formats in one directory
    mixed = Path(directory) / "mixed"
    for step, fmt in enumerate(("sharded", "consolidated", "sharded", "consolidated"), 1):
        Checkpointer(mixed, model, opt, format=fmt, keep=3).save(0, step)
    out["mixed"] = sorted(os.listdir(mixed))
    out["mixed-auto"] = Checkpointer(mixed, model, opt).load().path.name
    out["lower"] = error_of(Checkpointer(mixed, model, opt, format="sharded").save, 0, 1)
    out["consolidated-async"] = error_of(Checkpointer(mixed, model, opt, format="consolidated").save,
                                         0, 9, blocking=False)
    return out


@pytest.mark.slow
def test_damage_is_named_and_set_aside(tmp_path):
    out = run_ranks(_damage, 2, tmp_path, timeout=200)[0]
    for step, (name, _) in _DAMAGE.items():
        kind, message = out[step]
        assert kind in ("CheckpointError", "DamagedCheckpoint") and name in message, (step, out[step])
    assert out["auto"] == 1
    assert out["names"] == ["ckpt-000000000001.dcp"] + [
        f"ckpt-{s:012d}.dcp.damaged" for s in range(2, 6)], out["names"]
    assert out["mixed"] == ["ckpt-000000000002.ckpt", "ckpt-000000000003.dcp", "ckpt-000000000004.ckpt"]
    assert out["mixed-auto"] == "ckpt-000000000004.ckpt"
    assert out["lower"][0] == "CheckpointError" and "later step" in out["lower"][1]
    assert out["consolidated-async"][0] == "ValueError"


def _rchar():
    """Bytes this process has passed through read() and its kin, files and sockets alike."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _linears(seed, width, layers):
    """``layers`` fully sharded Linear(``width``, ``width``), each its own unit."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    for layer in model:
        fully_shard(layer)
    return fully_shard(model)


def _wide(seed):
    """8 MB of fully sharded parameters: large against what every rank reads whatever the
    size (.metadata, the state file, the collectives' messages, which rchar counts too)."""
    return _linears(seed, 512, 8)


def _read_bytes(rank, world_size, directory):
    Checkpointer(directory, _wide(0), format="sharded").save(0, 1)
    path = Path(directory) / "ckpt-000000000001.dcp"
    tensor_bytes = sum(f.stat().st_size for f in path.glob("*.distcp"))
    everyone = sum(f.stat().st_size for f in path.iterdir() if not f.name.endswith(".distcp"))
    ckpt = Checkpointer(directory, _wide(1), format="sharded")
    before = _rchar()
    ckpt.load()
    return _rchar() - before, tensor_bytes / world_size + everyone


@pytest.mark.slow
def test_each_rank_reads_its_share(tmp_path):
    """Each rank's bytes read at load (rchar, from /proc/self/io: reads served by the page
    cache count) are at most 1.2x its share: its shards, plus the files every rank reads
    (.metadata, the manifest, the state file)."""
    for rank, (read, share) in enumerate(run_ranks(_read_bytes, 2, tmp_path, timeout=200)):
        assert read <= 1.2 * share, (rank, read, share)


def _tall(seed):
    """64 MB of fully sharded parameters, each weight 16 MB (2048 x 2048): loaded at world 3 or
    4 from world 2, a rank needs a range of rows of 2.7-4 MB of each stored chunk it
    overlaps, against which the partial blocks at its ends (up to 64 KiB each) are small."""
    return _linears(seed, 2048, 4)


def _save_tall(rank, world_size, directory):
    Checkpointer(directory, _tall(0), format="sharded").save(0, 1)


def _without_blocks(path):
    """``path``'s manifest rewritten without its block CRC-32s (as an older phalanx wrote it)."""
    from phalanx.checkpoint.dcp_layout import MANIFEST, read_manifest, write_manifest

    body = read_manifest(path)
    for entry in body["files"].values():
        entry.pop("blocks", None)
    (path / MANIFEST).unlink()
    write_manifest(path, {k: v for k, v in body.items() if k not in ("format", "version")})


def _local_bytes(model):
    return sum(t.to_local().nbytes if isinstance(t, DTensor) else t.nbytes for t in model.state_dict().values())


def _resharded_reads(rank, world_size, paths):
    """Each checkpoint of ``paths`` loaded (world 2's, at this world size): the bytes read
    (rchar), this rank's share (its rows' bytes, the files every rank reads), and whether the
    state is the saved one bit for bit (the same seed, sharded at this world size)."""
    expected = _tall(0).state_dict()
    out = []
    for path in paths:
        model = _tall(1)
        everyone = sum(f.stat().st_size for f in Path(path).iterdir() if not f.name.endswith(".distcp"))
        ckpt = Checkpointer(Path(path).parent, model, format="sharded")
        before = _rchar()
        ckpt.load(resume=path)
        read = _rchar() - before
        equal = all(torch.equal(v.to_local().view(torch.uint8), expected[k].to_local().view(torch.uint8))
                    for k, v in model.state_dict().items())
        out.append((read, _local_bytes(model) + everyone, equal))
    return out


@pytest.mark.slow
def test_a_resharded_load_reads_its_share(tmp_path):
    """Saved at world 2 (fully_shard), loaded at 3 and 4: each rank needs only some rows of
    each stored chunk it overlaps, and reads only the blocks holding them (each checked by
    its block CRC-32): at most 1.2x its share (rchar). The same checkpoint without block
    CRC-32s (an older phalanx's) loads too, each stored chunk read whole; both bit for bit."""
    run_ranks(_save_tall, 2, tmp_path / "a", timeout=200)
    path = tmp_path / "a" / "ckpt-000000000001.dcp"
    old = tmp_path / "b" / path.name
    old.parent.mkdir()
    shutil.copytree(path, old)
    _without_blocks(old)
    for world in (4, 3):
        results = run_ranks(_resharded_reads, world, [path, old], timeout=300)
        print(f"world {world}: " + "; ".join(
            f"rank {r}: {new[0] / 1e6:.2f} MB read / {new[1] / 1e6:.2f} MB share "
            f"(without blocks: {whole[0] / 1e6:.2f} MB)" for r, (new, whole) in enumerate(results)))
        for rank, (new, whole) in enumerate(results):
            assert new[2] and whole[2], (world, rank)
            assert new[0] <= 1.2 * new[1], (world, rank, new)
            assert whole[0] > 1.3 * whole[1], (world, rank, whole)  # (each chunk whole: what the blocks save)


def _damaged_block(rank, world_size, path):
    ckpt = Checkpointer(Path(path).parent, _tall(1), format="sharded")
    return error_of(ckpt.load, path)


@pytest.mark.slow
def test_damage_in_a_block_a_resharded_load_reads_is_named(tmp_path):
    """A byte flipped inside the rows of a stored chunk that a world-4 rank reads in part:
    refused on every rank, naming the file and the block, before any of it is decoded."""
    run_ranks(_save_tall, 2, tmp_path, timeout=200)
    path = tmp_path / "ckpt-000000000001.dcp"
    entry = json.loads((path / "phalanx-manifest.json").read_text())["files"]["__1_0.distcp"]
    offset, start, _ = entry["blocks"]["items"][0]
    length = next(n for o, n, _ in entry["items"] if o == offset)
    damaged = offset + start + 3 * (length - start) // 4  # in the rows rank 1 or 3 reads
    with open(path / "__1_0.distcp", "r+b") as f:
        f.seek(damaged)
        byte = f.read(1)[0]
        f.seek(damaged)
        f.write(bytes([byte ^ 0x10]))
    for kind, message in run_ranks(_damaged_block, 4, path, timeout=300):
        assert kind == "DamagedCheckpoint" and "__1_0.distcp" in message and "block" in message, (kind, message)


def _save_while_training(rank, world_size, directory, layout):
    """save(blocking=False) with the writer's copy of the parameters held back; the next
    forward and backward run (all-gathers, reduce-scatters), the step waits for the copy."""
    import threading
    import time

    from phalanx.checkpoint import dcp_engine

    release = threading.Event()
    copy = dcp_engine.DeferredStaging._copy
    dcp_engine.DeferredStaging._copy = lambda self: (release.wait(60), copy(self))[1]
    torch.manual_seed(7)
    model, opt = _build(layout, 0)
    batches = [torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(s)) for s in range(4)]

    def train_step(x):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    train_step(batches[0])
    ckpt = Checkpointer(directory, model, opt, format="sharded")
    out = {}
    for step, x in ((1, batches[1]), (2, batches[2])):
        saved = _snapshot(model, opt)
        release.clear()
        ckpt.save(0, step, blocking=False)
        model(x).sum().backward()  # the copy not yet made: the forward and backward go on
        threading.Timer(0.5, release.set).start()
        start = time.perf_counter()
        opt.step()  # waits for the copy
        out[f"waited{step}"] = time.perf_counter() - start
        opt.zero_grad()
        out[f"saved{step}"] = saved
    train_step(batches[3])
    ckpt.close()
    out["after"] = _snapshot(model, opt)
    for step in (1, 2):
        fresh, fresh_opt = _build(layout, 1)
        Checkpointer(directory, fresh, fresh_opt, format="sharded").load(
            resume=Path(directory) / f"ckpt-{step:012d}.dcp")
        out[f"loaded{step}"] = _snapshot(fresh, fresh_opt)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_background_save_while_training_goes_on(tmp_path, layout):
    """Each background save holds the state at its call, bit for bit, though the next forward
    and backward ran before its copy was made and the step waited for it."""
    for out in run_ranks(_save_while_training, 2, tmp_path, layout, timeout=300):
        for step in (1, 2):
            _equal(out[f"loaded{step}"], out[f"saved{step}"])
            assert out[f"waited{step}"] > 0.3, out[f"waited{step}"]
        assert out["after"] != out["saved2"]


def _async_steps_differ(rank, world_size, directory):
    """A background save whose ranks pass different steps: its foreground checks nothing
    across ranks (the check is started, and waited for by the group's next collective); the
    background exchange names the difference, raised by wait() on every rank; the group's
    next collective then passes (the ranks agree they were at the save)."""
    model, opt = _build("ddp", 0)
    ckpt = Checkpointer(directory, model, opt, format="sharded")
    returned = ckpt.save(0, 5 + (rank == world_size - 1), blocking=False)
    out = {"returned": Path(returned).name, "wait": error_of(ckpt.wait)}
    t = torch.ones(3)
    torch.distributed.all_reduce(t)
    out["next"] = t.tolist()
    out["files"] = sorted(os.listdir(directory))
    return out


def test_a_background_save_with_different_steps_is_named_at_wait_on_every_rank(tmp_path):
    results = run_ranks(_async_steps_differ, 2, tmp_path, timeout=120)
    for rank, out in enumerate(results):
        assert out["returned"] == f"ckpt-00000000000{5 + rank}.dcp", out
        assert out["wait"][0] == "RankMismatchError", out
        assert "save(epoch, step) differs across ranks: ranks 1 disagree with rank 0" in out["wait"][1], out
        assert out["next"] == [2.0, 2.0, 2.0], out
        assert not any(name.endswith(".dcp") for name in out["files"]), out  # nothing committed
