"""``phalanx.Checkpointer`` with a model sharded by ``fully_shard`` (phalanx's and torch's):
saved at one world size, resumed at another, equal to an uninterrupted run.

Three groups of ranks run in turn on one directory (a module fixture): world 2 trains ``K``
AdamW steps and saves; world 3 resumes that checkpoint, trains to the end and compares with
one process trained on the same global batches, then trains ``K`` steps afresh and saves;
world 2 resumes that one (3 -> 2). Each step's global batch is ``GLOBAL`` samples of the
epoch's permutation (a ``phalanx.DistributedSampler``), split evenly over the ranks, so a
mid-epoch resume at another world size must continue the same sequence of global batches.
The world-2 group also measures the peak memory of a save (``_save_memory``).

This module is about the single file (``format="consolidated"``); a sharded model's default,
the sharded format, is tested in ``test_checkpoint_dcp.py``.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import phalanx
from phalanx import Checkpointer as _Checkpointer
from phalanx.fsdp import fully_shard, initialize
from tests.dist.test_fully_shard import _batch, _max_diff, _mine, _model, _shard, _without_key_bias
from tests.dist.test_fully_shard_models import _variant, _whole
from tests.oracle import magnitude, oracle_bound
from tests.harness import error_of, run_ranks

VOCAB, TOKENS = 50, 8  # as _model's
GLOBAL = 6  # samples per step: 3 per rank at world 2, 2 at world 3
SAMPLES = 48  # one epoch: 8 steps
K, STEPS = 2, 4  # saved after K steps, compared after STEPS
SEED = 5


def Checkpointer(*args, **kwargs):  # noqa: N802 - phalanx.Checkpointer, writing the single file
    return _Checkpointer(*args, format="consolidated", **kwargs)


def _data():
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, VOCAB, (SAMPLES, TOKENS), generator=g)
    return x, torch.randint(0, VOCAB, (SAMPLES, TOKENS), generator=g)


def _order():
    """The epoch's permutation, as one process's sampler gives it."""
    sampler = phalanx.DistributedSampler(range(SAMPLES), num_replicas=1, rank=0, seed=SEED)
    sampler.set_epoch(0)
    return list(sampler)


def _loss(model, indices):
    x, y = _data()
    return F.cross_entropy(model(x[indices]), y[indices].reshape(-1))


def _single(steps):
    """One process on the whole global batches: the parameters after ``steps`` steps."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.1)
    order = _order()
    for step in range(steps):
        _loss(model, order[step * GLOBAL:(step + 1) * GLOBAL]).backward()
        opt.step()
        opt.zero_grad()
    return model


def _run(fs, seed=99):
    """A sharded model (seed 99: other values than _model()'s, which a load must replace),
    its optimizer and its sampler."""
    model = _shard(_model(seed=seed), fs)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.1)
    sampler = phalanx.DistributedSampler(range(SAMPLES), seed=SEED)
    return model, opt, sampler


def _train(model, opt, sampler, steps, world_size, taken):
    it = iter(sampler)
    for _ in range(steps):
        mine = [next(it) for _ in range(GLOBAL // world_size)]
        taken.append(mine)
        _loss(model, mine).backward()
        opt.step()
        opt.zero_grad()


def _fresh(directory, fs, world_size, name):
    """K steps from the start, then a checkpoint in ``directory/name``."""
    model, opt, sampler = _run(fs, seed=0)
    sampler.set_epoch(0)
    _train(model, opt, sampler, K, world_size, [])
    Checkpointer(Path(directory) / name, model, opt, sampler=sampler).save(0, K)


def _vs_single(model, single):
    return _max_diff(_without_key_bias(n, p.detach().full_tensor(), q.detach())
                     for (n, p), q in zip(model.named_parameters(), single.parameters()))


def _uninterrupted(world_size):
    """torch's fully_shard trained every step at ``world_size`` on the same global batches:
    its distance from one process is the rounding noise a resumed run is held to."""
    model, opt, sampler = _run(torch_fully_shard, seed=0)
    sampler.set_epoch(0)
    _train(model, opt, sampler, STEPS, world_size, [])
    single = _single(STEPS)
    return {"vs_single": _vs_single(model, single), "magnitude": magnitude(single.parameters())}


def _resume(directory, fs, world_size, name):
    """Load ``directory/name`` at this world size, train to STEPS; compare with one process."""
    model, opt, sampler = _run(fs)
    state = Checkpointer(Path(directory) / name, model, opt, sampler=sampler).load()
    sampler.set_epoch(state.epoch)
    taken = []
    _train(model, opt, sampler, STEPS - K, world_size, taken)
    single = _single(STEPS)
    exp_avg = [opt.state[p]["exp_avg"] for p in model.parameters()]
    return {
        "saved_at": state.world_size, "step": state.step, "taken": taken,
        "types": sorted({type(p).__name__ for p in model.parameters()} |
                        {type(t).__name__ for t in exp_avg}),
        "vs_single": _vs_single(model, single),
        "moved": _max_diff((p.detach().full_tensor(), q.detach())
                           for p, q in zip(model.parameters(), _model().parameters())),
    }


def _tiny(shard, seed=3):
    """Tensors of 4 and 2 rows: at world 3 the last rank holds none of their rows (torch.chunk
    splits them 2, 2, 0 and 1, 1, 0)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    if shard:
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if seed == 3:  # one step, the same batch on every rank (so the same gradient as one process)
        model(torch.ones(3, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _tiny_save(directory, name):
    Checkpointer(Path(directory) / name, *_tiny(True)).save(0, 1)


def _tiny_load(directory, name):
    model, opt = _tiny(True, seed=4)
    Checkpointer(Path(directory) / name, model, opt).load()
    single, single_opt = _tiny(False)
    return {"rows": [p.to_local().shape[0] for p in model.parameters()],
            "params": _max_diff((p.detach().full_tensor(), q.detach())
                                for p, q in zip(model.parameters(), single.parameters())),
            "exp_avg": _max_diff((opt.state[p]["exp_avg"].full_tensor(), single_opt.state[q]["exp_avg"])
                                 for p, q in zip(model.parameters(), single.parameters())),
            "magnitudes": (magnitude(single.parameters()),
                           magnitude(single_opt.state[q]["exp_avg"] for q in single.parameters()))}


VARIANTS = ["tied", "frozen"]  # tests/dist/test_fully_shard_models.py's models


def _variant_model(kind, shard):
    base, kwargs = _variant(kind)
    model = _shard(base, fully_shard, **kwargs(base)) if shard else base
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-3)


def _loaded(kind, shard, where):
    model, opt = _variant_model(kind, shard)
    Checkpointer(where, model, opt).load()
    return _whole_state(model, opt)


def _whole_state(model, opt):
    """Every parameter and exp_avg whole, as lists (tensors do not outlive their rank)."""
    return {"params": [_whole(p).tolist() for p in model.parameters()],
            "exp_avg": [_whole(s["exp_avg"]).tolist() for s in opt.state.values()],
            "tied": model.head.weight is model.embed.weight}


def _variants(rank, world_size, directory, save):
    """Tied weights, frozen parameters. At world 2: trained one step, saved, and the file
    loaded whole into a plain model; at world 3: loaded sharded and whole."""
    out = {}
    for kind in VARIANTS:
        where = Path(directory) / kind
        if save:
            model, opt = _variant_model(kind, True)
            x, y = _mine(_batch(0, world_size), rank)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            Checkpointer(where, model, opt).save(0, 1)
            out[kind] = {"saved": _whole_state(model, opt), "whole": _loaded(kind, False, where)}
        else:
            out[kind] = {"sharded": _loaded(kind, True, where), "whole": _loaded(kind, False, where)}
    return out


def _world2(rank, world_size, directory):
    _tiny_save(directory, "tiny2")
    _fresh(directory, fully_shard, world_size, "w2")
    _fresh(directory, torch_fully_shard, world_size, "torch2")
    out = {"variants": _variants(rank, world_size, directory, save=True)}
    out["memory"] = _save_memory(Path(directory) / "memory")
    out["failures"] = _failures(rank, Path(directory) / "failures")
    return out


def _world3(rank, world_size, directory):
    out = {"from2": _resume(directory, fully_shard, world_size, "w2"),
           "torch_from2": _resume(directory, torch_fully_shard, world_size, "torch2"),
           "uninterrupted": _uninterrupted(world_size)}
    out["damaged"] = _damaged(rank, Path(directory) / "w2")
    out["tiny_from2"] = _tiny_load(directory, "tiny2")
    out["variants"] = _variants(rank, world_size, directory, save=False)
    _tiny_save(directory, "tiny3")
    _fresh(directory, fully_shard, world_size, "w3")
    return out


def _world2_again(rank, world_size, directory):
    return {"from3": _resume(directory, fully_shard, world_size, "w3"),
            "tiny_from3": _tiny_load(directory, "tiny3")}


def _failures(rank, directory):
    """A save that fails on the writer, before the tensors are sent and midway through
    writing them (rank 0's file size limit), raises on every rank and leaves no file; the
    group stays in step (the next saves work); keep=2 keeps the newest two."""
    model, opt, sampler = _run(fully_shard)
    ckpt = Checkpointer(directory, model, opt, sampler=sampler, keep=2)
    out = {"extra": error_of(ckpt.save, 0, 1, extra={"bad": object()})}
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 0:  # writes past 100 kB fail with EFBIG (and no SIGXFSZ)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, limit[1]))
    try:
        out["too_large"] = error_of(ckpt.save, 0, 1)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    out["left"] = sorted(os.listdir(directory)) if directory.exists() else []
    for step in (1, 2, 3):
        ckpt.save(0, step)
    out["kept"] = [p.name for p in ckpt.checkpoints()]
    return out


def _damaged(rank, directory):
    """A flipped byte in the middle of a sharded checkpoint, and one cut short: refused on
    every rank (the damage made by rank 0, read by all)."""
    source = next(directory.glob("ckpt-*.ckpt"))
    flipped, cut = directory.parent / "flipped.ckpt", directory.parent / "cut.ckpt"
    if rank == 0:
        data = bytearray(source.read_bytes())
        data[len(data) // 2] ^= 0xFF
        flipped.write_bytes(bytes(data))
        cut.write_bytes(bytes(data[:len(data) - 100]))
    torch.distributed.barrier()
    model, opt, sampler = _run(fully_shard)
    ckpt = Checkpointer(directory.parent / "damaged", model, opt, sampler=sampler)
    return [error_of(ckpt.load, path) for path in (flipped, cut)]


# ---- the peak memory of a save ---------------------------------------------------------------
MEM_WIDTH, MEM_DEPTH = 1024, 8  # each unit: one 1024 x 1024 fp32 Linear, 4 MiB of weight


# glibc's mallopt(M_MMAP_THRESHOLD, ...) (<malloc.h>: M_MMAP_THRESHOLD = -3): blocks of 64 kB
# and more are mapped on their own and unmapped when freed, and the threshold no longer grows
# (it would after the first free), so resident memory follows the live tensors; otherwise a
# freed block stays resident and a save that gathered everything would look free (tried: a
# save made to receive every tensor before writing raised the peak by 0.07 MiB without this,
# by the whole state with it).
_M_MMAP_THRESHOLD = -3


def _peak_rss_during(fn):
    """Bytes by which this process's peak resident memory rose over its resident memory
    before ``fn()`` (Linux: writing 5 to clear_refs resets VmHWM to the current VmRSS)."""
    libc = ctypes.CDLL("libc.so.6")
    if libc.mallopt(_M_MMAP_THRESHOLD, 1 << 16) != 1:
        raise OSError("mallopt(M_MMAP_THRESHOLD) failed: the measurement would not be exact")
    libc.malloc_trim(0)  # what earlier frees left resident goes back to the system
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - before) * 1024


def _status_kib(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _save_memory(directory):
    """A model built on the meta device (never whole), one AdamW step, then a save: how much
    the save raised each rank's peak memory, against the whole state's and one unit's bytes."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(MEM_WIDTH, MEM_WIDTH) for _ in range(MEM_DEPTH)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    initialize(model, lambda m: m.reset_parameters() if isinstance(m, nn.Linear) else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, MEM_WIDTH)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    ckpt = Checkpointer(directory, model, opt)
    ckpt.save(0, 1)  # once first: what a save allocates once (imports, buffers) is not counted
    # three saves: the least rise is the save's own; now and then one shows a transient of one
    # or two units more (seen: 1 save in 6 alone, 12.8 MB once in a full-suite run; not the
    # receive buffer, which is one storage), which a save gathering everything would dwarf
    rises = [_peak_rss_during(lambda: ckpt.save(0, step)) for step in (2, 3, 4)]
    unit = (MEM_WIDTH + 1) * MEM_WIDTH * 4
    return {"rise": min(rises), "rises": rises, "unit": unit,
            "state": 3 * MEM_DEPTH * unit,  # weights, exp_avg, exp_avg_sq
            "file": os.path.getsize(ckpt.checkpoints()[-1])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("fsdp_ckpt"))
    return {"w2": run_ranks(_world2, 2, directory, timeout=300),
            "w3": run_ranks(_world3, 3, directory, timeout=300),
            "w2_again": run_ranks(_world2_again, 2, directory, timeout=300)}


def _check_resume(results, key, saved_at, world_size, oracle):
    """``oracle``: every rank's ``_uninterrupted`` at world 3 (steps at world 3 round no less
    than at world 2): a resumed run is as close to one process as torch's fully_shard run
    without a break, measured in this run (``tests.oracle``)."""
    for rank, out in enumerate(results):
        res = out[key]
        assert (res["saved_at"], res["step"]) == (saved_at, K), (key, rank)
        assert res["types"] == ["DTensor"], (key, rank, res["types"])
        assert res["moved"] > 1e-2, (key, rank, "training changed nothing")
        bound = max(oracle_bound(o["uninterrupted"]["vs_single"], o["uninterrupted"]["magnitude"])
                    for o in oracle)
        assert res["vs_single"] <= bound, (key, rank, res["vs_single"], bound)
        assert all(len(m) == GLOBAL // world_size for m in res["taken"]), res["taken"]
    # the sampler resumed mid-epoch: each step's samples, all ranks together, are the
    # uninterrupted run's global batch
    order = _order()
    for step in range(STEPS - K):
        together = sorted(i for out in results for i in out[key]["taken"][step])
        assert together == sorted(order[(K + step) * GLOBAL:(K + step + 1) * GLOBAL]), (key, step)


def test_saved_at_world_2_resumed_at_world_3_equals_an_uninterrupted_run(runs):
    _check_resume(runs["w3"], "from2", 2, 3, runs["w3"])


def test_saved_at_world_3_resumed_at_world_2_equals_an_uninterrupted_run(runs):
    _check_resume(runs["w2_again"], "from3", 3, 2, runs["w3"])


def test_torchs_fully_shard_saved_at_2_resumed_at_3(runs):
    _check_resume(runs["w3"], "torch_from2", 2, 3, runs["w3"])


def test_empty_shards_are_saved_and_loaded(runs):
    """At world 3 a tensor of 4 rows has shards of 2, 2 and 0 rows, one of 2 rows 1, 1, 0
    (torch.chunk's split): saved from there and loaded there."""
    rows = {3: [[2, 2, 1, 1], [2, 2, 1, 1], [0, 0, 0, 0]], 2: [[2, 2, 1, 1]] * 2}
    for key, world in (("w3", 3), ("w2_again", 2)):
        res = [out[f"tiny_from{5 - world}"] for out in runs[key]]
        assert [r["rows"] for r in res] == rows[world], res
        # the same batch on every rank: the average of equal gradients rounds once (a sum of
        # 3 and a division), a few units in the last place of the values, whatever the CPU
        assert all(r["params"] <= oracle_bound(0.0, r["magnitudes"][0])
                   and r["exp_avg"] <= oracle_bound(0.0, r["magnitudes"][1]) for r in res), res


@pytest.mark.parametrize("kind", VARIANTS)
def test_tied_and_frozen_parameters_round_trip(runs, kind):
    """What was saved at world 2 is what a model every rank holds whole loads (at worlds 2
    and 3: whole tensors), and what a sharded model loads at world 3, exactly; the head
    stays tied to the embedding."""
    saved = runs["w2"][0]["variants"][kind]["saved"]
    assert saved["tied"] == (kind == "tied"), saved["tied"]
    frozen = 2 if kind == "frozen" else 0  # blocks.1.fc1.weight and ln.bias: no AdamW state
    assert len(saved["exp_avg"]) == len(saved["params"]) - frozen
    for key in ("w2", "w3"):
        for rank, out in enumerate(runs[key]):
            for form, state in out["variants"][kind].items():
                assert state == saved, (kind, key, rank, form)  # exactly


def test_a_failed_save_raises_on_every_rank_and_leaves_nothing(runs):
    for rank, out in enumerate(runs["w2"]):
        res = out["failures"]
        assert res["extra"][0] == "TypeError" and "extra['bad']" in res["extra"][1], (rank, res)
        kind, message = res["too_large"]
        assert kind == "CheckpointError" and "file too large" in message, (rank, res)
        assert res["left"] == [], (rank, res["left"])
        assert res["kept"] == ["ckpt-000000000002.ckpt", "ckpt-000000000003.ckpt"], (rank, res)


def test_damaged_sharded_checkpoint_is_refused_on_every_rank(runs):
    for rank, out in enumerate(runs["w3"]):
        flipped, cut = out["damaged"]
        assert flipped[0] == "CheckpointError" and "checksum mismatch" in flipped[1], (rank, flipped)
        assert cut[0] == "CheckpointError" and "truncated" in cut[1], (rank, cut)


def test_a_save_holds_no_more_than_one_unit_beyond_the_shards(runs):
    for rank, out in enumerate(runs["w2"]):
        mem = out["memory"]
        print(f"rank {rank}: save raised peak RSS by {mem['rise'] / 2**20:.1f} MiB; one unit "
              f"{mem['unit'] / 2**20:.1f} MiB, whole state {mem['state'] / 2**20:.1f} MiB, "
              f"file {mem['file'] / 2**20:.1f} MiB")
        assert mem["file"] >= mem["state"], mem  # every tensor whole, in one file
        # at most one unit gathered at a time, plus 1 MiB for what torch.save allocates
        assert mem["rise"] <= mem["unit"] + (1 << 20), (rank, mem)
        assert max(mem["rises"]) < mem["state"] / 4, (rank, mem)  # never near the whole state
