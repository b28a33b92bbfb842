"""Checkpointer(format="sharded"): the peak memory of a blocking save at world 4, rank 0's
included, stays within one unit (the largest tensor shard a rank holds), issue 36's goal
"peak memory per rank during save <= its shard plus one staging unit".

Measured as ``benchmarks/bench_checkpoint.py`` measures it: the rise of the process's peak
resident memory (VmHWM, reset through /proc/self/clear_refs) over its resident memory before
the save, glibc's mmap threshold fixed at 64 KiB. Rank 0 alone builds and writes ``.metadata``,
the manifest and the state file, from what every rank reports (about 175 bytes of
``.metadata`` per stored chunk). The model here has the benchmark's GPT's count of tensors per
rank (552 against its 548; 414 of them shards) and its unit (1.05 MB at world 4), at a 25th
of its size, so that a save takes a fraction of a second. Before rank 0's reports were made
compact and ``.metadata`` patched in place, rank 0's rise here was 1.0-1.6 MB (median 1.38 MB
in one run), as in the benchmark's quiet runs (1.4-1.7 MB); now 0.3-0.6 MB.

A resident-memory rise can hide what a save allocates: memory freed by an earlier save stays
resident in Python's and glibc's free lists and is reused without a rise. So each rank also
measures the peak of its Python allocations during a save (tracemalloc, which counts every
byte a ``bytes``, list or pickle takes, whatever it reuses): rank 0's was 2.1 MB before, now
0.6 MB (the others' 0.5 MB), and must stay within the unit.
"""

import gc
import statistics
import tracemalloc

import torch
from torch import nn

from phalanx import Checkpointer
from phalanx.fsdp import fully_shard, initialize
from tests.dist.test_fully_shard_checkpoint import _peak_rss_during
from tests.harness import run_ranks

WORLD = 4
WIDTH = 32
BLOCKS = 34  # 34 x (Linear, LayerNorm) + the wide Linear: 138 parameters, 552 tensors per rank
WIDE = 32_768  # its weight, WIDE x WIDTH fp32: 4.2 MB, a 1.05 MB shard at world 4 (the unit)


def _model():
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH))
                                for _ in range(BLOCKS)], nn.Linear(WIDTH, WIDE))
    for block in model:
        fully_shard(block)
    fully_shard(model)
    initialize(model, lambda m: m.reset_parameters() if isinstance(m, (nn.Linear, nn.LayerNorm)) else None)
    return model


def _python_peak(fn):
    """Bytes of the peak of this process's Python allocations during ``fn()`` over before
    (earlier saves' cyclic garbage collected first: none of it is freed meanwhile)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        fn()
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


def _saves(rank, world_size, directory):
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, WIDTH)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    shards = [t.to_local() for t in model.state_dict().values()]
    shards += [v.to_local() for s in opt.state.values() for k, v in s.items() if k != "step"]
    ckpt = Checkpointer(directory, model, opt, format="sharded", keep=1)
    ckpt.save(0, 1)  # once first: what a save allocates once (plans, caches) is not counted
    rises = [_peak_rss_during(lambda: ckpt.save(0, step)) for step in (2, 3, 4)]
    python = _python_peak(lambda: ckpt.save(0, 5))
    return {"rises": rises, "python": python, "tensors": len(shards) + len(opt.state),
            "unit": max(t.numel() * t.element_size() for t in shards)}


def test_a_world_4_sharded_save_raises_no_rank_s_peak_by_more_than_one_unit(tmp_path):
    results = run_ranks(_saves, WORLD, str(tmp_path), timeout=240)
    unit = results[0]["unit"]
    assert unit == WIDE * WIDTH * 4 // WORLD, unit
    for rank, res in enumerate(results):
        print(f"rank {rank}: peak rise {[round(r / 1e6, 2) for r in res['rises']]} MB, Python "
              f"allocations {res['python'] / 1e6:.2f} MB; one unit {unit / 1e6:.2f} MB")
        assert res["tensors"] == 552, res["tensors"]
        # the benchmark's figure: the median over saves (now and then one save shows a
        # transient of another process's making, see test_fully_shard_checkpoint)
        assert statistics.median(res["rises"]) <= unit, (rank, res)
        assert res["python"] <= unit, (rank, res)
