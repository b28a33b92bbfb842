"""``phalanx.fully_shard`` against torch's ``fully_shard`` and single-process training.

A small GPT (``phalanx.bench.engine.GPT``: per-block units and the root) is built alike on
every rank, sharded by phalanx and by torch, and a plain copy trains on the global batch
(every rank's batch together) in one process. After several AdamW steps phalanx's shards
must equal torch's bit for bit at world 2 (a sum of two rounds once, whatever the order). At
world 3 Gloo's ring adds in another order than phalanx's rank order: phalanx's gradients and
parameters must be as close to the single-process run's as torch's are, measured in the same
run (``tests.oracle.oracle_bound``; less the key biases, whose exact gradient is zero: see
``_without_key_bias``), not within a constant tuned on one CPU. One group of ranks per world
size runs every check (a module fixture); the tests assert on its results.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard

from phalanx.bench.engine import GPT
from phalanx.diagnostics import ledger
from phalanx.fsdp import fully_shard
from tests.harness import run_ranks
from tests.oracle import magnitude, oracle_bound, triangle_bound

STEPS = 4
VOCAB, TOKENS, BATCH = 50, 8, 3  # BATCH sequences per rank and step
# reshard_after_forward cases: torch's default (blocks reshard, the root keeps), never, always
RESHARD = {"default": None, "keep": False, "always": True}
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _model(seed=0):
    torch.manual_seed(seed)
    # width 18 on 3 heads, 3 blocks: rows of 50 (embedding, head), 54 (qkv), 72 (fc1), 18
    # and 8 (positions): even shards at world 2, uneven ones (padded) at world 3
    return GPT(vocab=VOCAB, tokens=TOKENS, dim=18, depth=3, heads=3)


def _shard(model, fs, **kwargs):
    for block in model.blocks:
        fs(block, **kwargs)
    fs(model, **kwargs)
    return model


def _batch(step, world_size):
    """The global batch of ``step``: every rank's ``BATCH`` sequences, rank by rank."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, VOCAB, (BATCH * world_size, TOKENS), generator=g)
    return x, torch.randint(0, VOCAB, (BATCH * world_size * TOKENS,), generator=g)


def _mine(batch, rank):
    x, y = batch
    return x[rank * BATCH:(rank + 1) * BATCH], y[rank * BATCH * TOKENS:(rank + 1) * BATCH * TOKENS]


def _chunk(t, world_size, rank):
    """Rank ``rank``'s Shard(0) rows of a whole tensor (torch.chunk's; none past the last)."""
    chunks = t.chunk(world_size)
    return chunks[rank] if rank < len(chunks) else t[:0]


def _step(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _max_diff(pairs):
    return max(((a - b).abs().max().item() if a.numel() else 0.0) for a, b in pairs)


def _train(rank, world_size, reshard, **kwargs):
    base = _model()
    ours = _shard(copy.deepcopy(base), fully_shard, reshard_after_forward=reshard, **kwargs)
    theirs = _shard(copy.deepcopy(base), torch_fully_shard, reshard_after_forward=reshard, **kwargs)
    single = copy.deepcopy(base)
    opts = [torch.optim.AdamW(m.parameters(), lr=5e-3, weight_decay=0.1) for m in (ours, theirs, single)]
    out = {"loss_diff": 0.0, **dict.fromkeys(_GRADS, 0.0)}
    for step in range(STEPS):
        batch = _batch(step, world_size)
        x, y = _mine(batch, rank)
        losses = []
        for model, opt in zip((ours, theirs), opts):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            losses.append(loss.detach())
        F.cross_entropy(single(batch[0]), batch[1]).backward()
        for key, value in _grads_compared(ours, theirs, single, world_size, rank).items():
            out[key] = max(out[key], value)
        out["loss_diff"] = max(out["loss_diff"], (losses[0] - losses[1]).abs().item())
        for opt in opts:
            opt.step()
            opt.zero_grad()
    params = list(ours.parameters())
    out["types"] = sorted({type(p).__name__ for p in params}), type(ours).__name__
    out.update(_compared(ours, theirs, single))
    out["moved"] = _max_diff((p.to_local(), _chunk(q.detach(), world_size, rank))
                             for p, q in zip(params, base.parameters()))
    out["state_dict"] = _state_dicts(ours, theirs)
    return out


_GRADS = ("grad_diff", "torch_grad_diff", "grad_vs_torch", "grad_magnitude")


def _grads_compared(ours, theirs, single, world_size, rank):
    """The sharded gradients side by side: the largest difference of phalanx's from one
    process's (``grad_diff``), of torch's from it, of phalanx's from torch's, and the largest
    gradient."""
    mine = [p.grad.to_local() for p in ours.parameters()]
    singles = [_chunk(q.grad, world_size, rank) for q in single.parameters()]
    torchs = [q.grad.to_local() for q in theirs.parameters()]
    return {"grad_diff": _max_diff(zip(mine, singles)), "torch_grad_diff": _max_diff(zip(torchs, singles)),
            "grad_vs_torch": _max_diff(zip(mine, torchs)), "grad_magnitude": magnitude(singles)}


def _grads_close(grads):
    """Phalanx's gradients as close to one process's as torch's are (:func:`oracle_bound`)."""
    return grads["grad_diff"] <= oracle_bound(grads["torch_grad_diff"], grads["grad_magnitude"])


def _norms_compared(norms):
    """Phalanx's, torch's and one process's gradient norms of each step: the largest
    difference of phalanx's from one process's, of torch's from it, of phalanx's from torch's,
    and the largest norm (:func:`close_to_one_process`)."""
    return {"norm_vs_single": max(abs(a - c) for a, _, c in norms),
            "norm_torch_vs_single": max(abs(b - c) for _, b, c in norms),
            "norm_vs_torch": max(abs(a - b) for a, b, _ in norms),
            "norm_magnitude": max(c for _, _, c in norms)}


def close_to_one_process(res, prefix=""):
    """The failed bounds (empty if none) of results with ``{prefix}vs_single``,
    ``{prefix}torch_vs_single``, ``{prefix}vs_torch`` and ``{prefix}magnitude``: phalanx
    within :func:`~tests.oracle.oracle_bound` of one process, and of torch's result by the
    triangle inequality."""
    ours, theirs, size = (res[prefix + k] for k in ("vs_single", "torch_vs_single", "magnitude"))
    failed = []
    if ours > oracle_bound(theirs, size):
        failed.append(f"{prefix}vs_single {ours:.4g} > bound {oracle_bound(theirs, size):.4g} "
                      f"(torch's {theirs:.4g})")
    if res[prefix + "vs_torch"] > triangle_bound(ours, theirs, size):
        failed.append(f"{prefix}vs_torch {res[prefix + 'vs_torch']:.4g}")
    return failed


def _compared(ours, theirs, single):
    """Trained models side by side: whether ours equals torch's every element (the local
    shards), the largest difference from torch's and from one process, and torch's own from
    one process (the key bias left out of the differences: :func:`_without_key_bias`)."""
    def diff(pairs):
        return _max_diff(_without_key_bias(n, p.detach().full_tensor(), q.detach())
                         for (n, p), q in pairs)

    named, torchs = list(ours.named_parameters()), list(theirs.parameters())
    return {"torch_equal": all(torch.equal(p.to_local(), q.to_local()) for (_, p), q in zip(named, torchs)),
            "vs_torch": diff(zip(named, [q.full_tensor() for q in torchs])),
            "vs_single": diff(zip(named, single.parameters())),
            "torch_vs_single": diff(zip(theirs.named_parameters(), single.parameters())),
            "magnitude": magnitude(single.parameters())}


def _without_key_bias(name, a, b):
    """``(a, b)``, less the key third of a qkv bias: its exact gradient is zero (softmax does
    not change when every key score shifts alike), so what a backward computes for it is
    rounding noise, which Adam's normalisation turns into steps of about ``lr`` in a sign
    that depends on the summation order (1e-4 and more after 4 steps, torch's FSDP as
    ours; equal only where the order is: world 2). Every other element is compared."""
    if name.endswith("qkv.bias"):
        dim = a.shape[0] // 3
        keep = torch.cat([torch.arange(dim), torch.arange(2 * dim, 3 * dim)])
        return a[keep], b[keep]
    return a, b


def _state_dicts(ours, theirs):
    mine, torchs = ours.state_dict(), theirs.state_dict()
    return {
        "keys": list(mine) == list(torchs),
        "dtensors": all(isinstance(v, DTensor) and v.placements == (Shard(0),) for v in mine.values()),
        "shapes": all(mine[k].shape == torchs[k].shape and mine[k].to_local().shape == torchs[k].to_local().shape
                      for k in mine),
        "equal": all(torch.equal(mine[k].to_local(), torchs[k].to_local()) for k in mine),
    }


def _accumulation(rank, world_size, sync_first=False, keep=False, **kwargs):
    """Two micro-batches, the first without gradient sync: equal to torch's, and no
    reduce-scatter recorded for the first backward (``sync_first``: both synchronised, the
    second reduce-scatter's shards added to the first's .grad; ``keep``: the first backward
    does not reshard either, so the second forward gathers nothing)."""
    base = _model(1)
    ours = _shard(copy.deepcopy(base), fully_shard, **kwargs)
    theirs = _shard(copy.deepcopy(base), torch_fully_shard, **kwargs)
    single = copy.deepcopy(base)  # the sum of both global batches' gradients
    for micro in range(2):
        x, y = _batch(50 + micro, world_size)
        F.cross_entropy(single(x), y).backward()
    log = ledger().logs["world"]
    counts, gathers = [], []
    for model in (ours, theirs):
        for micro in range(2):
            model.set_requires_gradient_sync(sync_first or micro == 1)
            model.set_reshard_after_backward(not keep or micro == 1)
            x, y = _mine(_batch(50 + micro, world_size), rank)
            before = log.next_seq
            F.cross_entropy(model(x), y).backward()
            if model is ours:  # (the log keeps the last 64 records: enough for one backward)
                counts.append(sum("reduce-scatter" in r.op for r in log.records if r.seq >= before))
                gathers.append(sum("all-gather" in r.op for r in log.records if r.seq >= before))
    grads = _grads_compared(ours, theirs, single, world_size, rank)
    return {"grad_diff": grads["grad_vs_torch"], "grad_close": _grads_close(grads),
            "reduce_scatters": counts, "all_gathers": gathers,
            "ops": sorted({r.op for r in log.records if r.op.startswith("fully_shard")})}


def _all_checks(rank, world_size):
    out = {name: _train(rank, world_size, reshard) for name, reshard in RESHARD.items()}
    out["bf16"] = _train(rank, world_size, None, mp_policy=BF16)
    out["accumulation"] = _accumulation(rank, world_size)
    out["bf16_accumulation"] = _accumulation(rank, world_size, mp_policy=BF16)
    out["synced_accumulation"] = _accumulation(rank, world_size, sync_first=True)
    out["kept_accumulation"] = _accumulation(rank, world_size, keep=True)
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def ranks(request):
    """(world size, every rank's results) of one group of ranks running all checks."""
    return request.param, run_ranks(_all_checks, request.param, timeout=300)


@pytest.mark.parametrize("case", list(RESHARD))
def test_equal_to_torch_and_to_one_process(ranks, case):
    world_size, results = ranks
    for rank, out in enumerate(results):
        res = out[case]
        assert res["types"] == (["DTensor"], "FSDPGPT"), (case, rank, res["types"])
        assert res["moved"] > 1e-2, (case, rank, "training changed nothing: the test would prove nothing")
        if world_size == 2:  # every element, the key biases too, and every gradient
            assert res["torch_equal"] and res["grad_vs_torch"] == 0.0, (case, rank, res["vs_torch"])
            assert res["loss_diff"] == 0.0, (case, rank)
        # world 3: as close to one process as torch's fully_shard, measured in this run
        assert not close_to_one_process(res), (case, rank, close_to_one_process(res))
        assert _grads_close(res), (case, rank, res["grad_diff"], res["torch_grad_diff"])


def test_mixed_precision_equal_to_torch(ranks):
    """bf16 parameters, fp32 reduction: equal to torch's bit for bit at world 2. At world 3
    the reduction's order differs by an fp32 rounding, which a bf16 cast of the next
    all-gather can round to one bf16 step (2^-8 relative): the bound is a few such steps
    of the parameters' size after 4 steps."""
    world_size, results = ranks
    for rank, out in enumerate(results):
        res = out["bf16"]
        assert res["moved"] > 1e-2, rank
        if world_size == 2:
            assert res["torch_equal"] and res["loss_diff"] == 0.0, (rank, res["vs_torch"])
        else:
            assert res["vs_torch"] <= 1e-3, (rank, res["vs_torch"])
        acc = out["bf16_accumulation"]
        assert acc["reduce_scatters"] == [0, 4], (rank, acc)
        assert acc["grad_diff"] <= (0.0 if world_size == 2 else 1e-3), (rank, acc["grad_diff"])


@pytest.mark.parametrize("case", list(RESHARD))
def test_state_dict_is_torchs(ranks, case):
    world_size, results = ranks
    for rank, out in enumerate(results):
        sd = out[case]["state_dict"]
        assert (sd["keys"], sd["dtensors"], sd["shapes"]) == (True, True, True), (case, rank, sd)
        assert sd["equal"] or world_size > 2, (case, rank, sd)  # (the values: vs_torch above)


def test_accumulation_without_sync_sends_nothing(ranks):
    world_size, results = ranks
    for rank, out in enumerate(results):
        kept = out["kept_accumulation"]
        assert kept["reduce_scatters"] == [0, 4], (rank, kept)
        # 4 units forward, 3 blocks again backward; kept: the second forward gathers nothing
        assert kept["all_gathers"] == [7, 3] and out["accumulation"]["all_gathers"] == [7, 7], (rank, kept)
        synced = out["synced_accumulation"]
        assert synced["reduce_scatters"] == [4, 4], (rank, synced)
        acc = out["accumulation"]
        for res in (kept, synced, acc):  # torch's bit for bit at world 2; else as near one process
            assert res["grad_close"] and (res["grad_diff"] == 0.0 or world_size > 2), (rank, res)
        assert acc["reduce_scatters"] == [0, 4], (rank, acc["reduce_scatters"])  # 3 blocks + root
        assert acc["ops"] == [f"fully_shard {op} {unit}" for op in ("all-gather", "reduce-scatter")
                              for unit in ("(root)", "blocks.0", "blocks.1", "blocks.2")], acc["ops"]
