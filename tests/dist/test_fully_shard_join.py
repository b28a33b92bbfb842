"""``phalanx.fully_shard`` under ``phalanx.join(model, optimizer)``: ranks with different numbers
of batches, against AdamW in one process on the data the ranks actually consumed (each step's
gradient the sum over the ranks that still had a batch, divided by the initial world size, or
with ``divide_by_initial_world_size=False`` by the number of those ranks), as close to it as
torch's ``fully_shard`` is on the same data, the ranks past their batches sending zero gradients
(``tests.oracle``); and the refusals (on every rank, no hang). One group of ranks per world size runs every check
(a module fixture); the tests assert on its results.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import phalanx
from phalanx import Checkpointer
from phalanx.fsdp import clip_grad_norm_, fully_shard
from tests.dist.test_fully_shard import (BATCH, TOKENS, VOCAB, _max_diff, _model, _shard, _without_key_bias,
                                        close_to_one_process)
from tests.harness import error_of, run_ranks
from tests.oracle import magnitude

COUNTS = (3, 5, 4)  # batches of rank 0, 1, 2
NONE_FIRST = (0, 2, 1)  # rank 0 has no batch at all: it never ran a forward itself
LR = 5e-3


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    return (torch.randint(0, VOCAB, (BATCH, TOKENS), generator=g),
            torch.randint(0, VOCAB, (BATCH * TOKENS,), generator=g))


def _loop(model, opt, rank, steps, clip=False):
    for step in range(steps):
        _loop_step(model, opt, rank, step, clip)


def _loop_step(model, opt, rank, step, clip=False):
    opt.zero_grad()
    x, y = _batch(rank, step)
    F.cross_entropy(model(x), y).backward()
    if clip:
        clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def _reference(base, world_size, divide_initial, counts):
    """One process: step t's gradient is the sum of the active ranks' gradients divided by
    the world size (``divide_initial``) or by the number of active ranks."""
    single = copy.deepcopy(base)
    opt = torch.optim.AdamW(single.parameters(), lr=LR, weight_decay=0.1)
    for step in range(max(counts[:world_size])):
        opt.zero_grad()
        active = [rank for rank in range(world_size) if step < counts[rank]]
        for rank in active:
            x, y = _batch(rank, step)
            (F.cross_entropy(single(x), y) / (world_size if divide_initial else len(active))).backward()
        opt.step()
    return single


def _torch_oracle(base, rank, world_size, divide_initial, counts):
    """torch's fully_shard on the same data, where a rank past its batches runs its last one
    (rank 0 of NONE_FIRST its first) with the loss times 0: the zero gradients a joined rank
    sends. Dividing by the active ranks: each loss times world_size / active (torch averages
    over all ranks; the product rounds once more, which only widens torch's distance)."""
    model = _shard(copy.deepcopy(base), torch_fully_shard)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    for step in range(max(counts[:world_size])):
        opt.zero_grad()
        active = sum(step < count for count in counts[:world_size])
        scale = float(step < counts[rank]) * (1.0 if divide_initial else world_size / active)
        x, y = _batch(rank, min(step, max(counts[rank] - 1, 0)))
        (F.cross_entropy(model(x), y) * scale).backward()
        opt.step()
    return model


def _oracles(base, rank, world_size, divide_initial, counts, cache):
    """(one process's parameters, torch's fully_shard's, torch's distance from one process),
    computed once per (divide_initial, counts): resharding or not changes no value."""
    key = divide_initial, counts
    if key not in cache:
        single = [p.detach() for p in _reference(base, world_size, divide_initial, counts).parameters()]
        theirs = _torch_oracle(base, rank, world_size, divide_initial, counts)
        cache[key] = (single, [q.detach().full_tensor() for q in theirs.parameters()],
                      _diff(theirs.named_parameters(), single))
    return cache[key]


def _diff(named, tensors):
    """The largest difference of sharded parameters from whole tensors (less the key biases)."""
    return _max_diff(_without_key_bias(n, p.detach().full_tensor(), q) for (n, p), q in zip(named, tensors))


def _uneven(rank, world_size, reshard, divide_initial, counts, cache):
    base = _model()
    model = _shard(copy.deepcopy(base), fully_shard, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    with phalanx.join(model, opt, divide_by_initial_world_size=divide_initial):
        _loop(model, opt, rank, counts[rank])
    single, theirs, torch_vs_single = _oracles(base, rank, world_size, divide_initial, counts, cache)
    out = {"vs_single": _diff(model.named_parameters(), single),
           "torch_vs_single": torch_vs_single,
           "vs_torch": _diff(model.named_parameters(), theirs),
           "magnitude": magnitude(single),
           "moved": _max_diff((p.detach().full_tensor(), q) for p, q in zip(model.parameters(), base.parameters()))}
    # after the join the ranks are in step: even training goes on, alike on every rank
    _loop(model, opt, 7, 1)
    out["after"] = [p.detach().full_tensor().tolist() for p in model.parameters()]
    return out


def _mixed_precision(rank, world_size):
    """bf16 parameters, fp32 reduce: the join equals, bit for bit, every rank running all steps
    with the loss of the steps past its batches times 0 (zero gradients: what a joined rank sends)."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    models = [_shard(_model(), fully_shard, mp_policy=policy) for _ in range(2)]
    opts = [torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.1) for m in models]
    with phalanx.join(models[0], opts[0]):
        _loop(models[0], opts[0], rank, COUNTS[rank])
    for step in range(max(COUNTS[:world_size])):
        opts[1].zero_grad()
        x, y = _batch(rank, min(step, COUNTS[rank] - 1))
        (F.cross_entropy(models[1](x), y) * float(step < COUNTS[rank])).backward()
        opts[1].step()
    return {"equal": all(torch.equal(p.to_local(), q.to_local())
                         for p, q in zip(models[0].parameters(), models[1].parameters())),
            "moved": _max_diff((p.detach().full_tensor(), q) for p, q in zip(models[0].parameters(),
                                                                              _model().parameters()))}


def _checkpoint(rank, world_size, directory):
    """A Checkpointer in the join saves after each step of the active ranks (a joined rank
    sends its shards): the last file, loaded at every rank into a fresh sharded model, is the
    model the join ended with."""
    model = _shard(_model(), fully_shard)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    ckpt = Checkpointer(Path(directory) / f"world{world_size}", model, opt)
    with phalanx.join(model, opt, ckpt):
        for step in range(COUNTS[rank]):
            _loop_step(model, opt, rank, step)
            ckpt.save(0, step)
    fresh = _shard(_model(5), fully_shard)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=LR, weight_decay=0.1)
    state = Checkpointer(Path(directory) / f"world{world_size}", fresh, fresh_opt).load()
    return {"step": state.step,
            "equal": all(torch.equal(p.to_local(), q.to_local())
                         for p, q in zip(model.parameters(), fresh.parameters()))}


def _refusals(rank, world_size):
    out = {}
    model = _shard(_model(), fully_shard)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    # only a block in the join: the root's all-gather cannot be shadowed
    out["part"] = error_of(lambda: _in_join(phalanx.join(model.blocks[0], opt), model, opt, rank))
    # the global norm needs the joined rank's shards of the gradients: refused once it joined
    out["clip"] = error_of(lambda: _in_join(phalanx.join(model, opt), model, opt, rank, clip=True))
    out["throw"] = error_of(lambda: _in_join(phalanx.join(model, opt, throw_on_early_termination=True),
                                             model, opt, rank))
    # one optimizer over two sharded models: a joined rank would step it twice
    other = _shard(_model(1), fully_shard)
    both = torch.optim.AdamW([*model.parameters(), *other.parameters()], lr=LR)
    out["shared"] = error_of(lambda: _in_join(phalanx.join(model, other, both), model, both, rank))
    # the group still works, and so does an even join
    _in_join(phalanx.join(model, opt), model, opt, 0)
    out["after"] = [p.detach().full_tensor().tolist() for p in model.parameters()]
    return out


def _in_join(join, model, opt, rank, clip=False):
    with join:
        _loop(model, opt, rank, COUNTS[rank], clip)


def _all_checks(rank, world_size, directory):
    cache = {}  # "default" and "keep" share their oracles
    out = {f"uneven {name}": _uneven(rank, world_size, reshard, divide, COUNTS, cache)
           for name, reshard, divide in (("default", None, True), ("keep", False, True),
                                         ("by active", None, False))}
    out["uneven none first"] = _uneven(rank, world_size, None, True, NONE_FIRST, cache)
    out["bf16"] = _mixed_precision(rank, world_size)
    out["checkpoint"] = _checkpoint(rank, world_size, directory)
    out["refusals"] = _refusals(rank, world_size)
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def ranks(request, tmp_path_factory):
    """(world size, every rank's results) of one group of ranks running all checks."""
    directory = str(tmp_path_factory.mktemp("fsdp_join"))
    return request.param, run_ranks(_all_checks, request.param, directory, timeout=300)


@pytest.mark.parametrize("case", ["uneven default", "uneven keep", "uneven by active", "uneven none first"])
def test_uneven_batches_equal_one_process_averaging_as_the_join_says(ranks, case):
    _, results = ranks
    for out in results:
        # as close to one process as torch's fully_shard on the same data, in this run
        assert not close_to_one_process(out[case]), (case, close_to_one_process(out[case]))
        assert out[case]["moved"] > 1e-3  # it trained
    for out in results[1:]:
        assert out[case]["after"] == results[0][case]["after"]


def test_mixed_precision_equals_zero_gradients_on_the_ranks_out_of_batches(ranks):
    _, results = ranks
    for out in results:
        assert out["bf16"]["equal"] and out["bf16"]["moved"] > 1e-3, out["bf16"]


def test_a_checkpoint_saved_in_the_join_holds_the_joined_ranks_shards(ranks):
    world_size, results = ranks
    for out in results:
        assert out["checkpoint"] == {"step": max(COUNTS[:world_size]) - 1, "equal": True}, out["checkpoint"]


def test_a_join_without_the_root_is_refused_on_every_rank(ranks):
    world_size, results = ranks
    for rank, out in enumerate(results):
        kind, message = out["refusals"]["part"]
        assert kind == "UsageError", out["refusals"]["part"]
        assert "fully_shard" in message and "join" in message.lower(), message
        if rank != 0:  # rank 0 ran out first: the others are told which rank joined
            assert "rank 0 has joined" in message, message
    for out in results[1:]:
        assert out["refusals"]["after"] == results[0]["refusals"]["after"]


def test_one_optimizer_over_two_sharded_models_is_refused_when_the_join_starts(ranks):
    _, results = ranks
    for out in results:
        kind, message = out["refusals"]["shared"]
        assert kind == "UsageError" and "AdamW steps the parameters of two fully_shard roots" in message, message
        assert "phalanx.join" in message, message


def test_throw_on_early_termination_raises_on_every_rank(ranks):
    _, results = ranks
    for out in results:
        kind, message = out["refusals"]["throw"]
        assert kind == "EarlyTerminationError" and "Rank 0 ran out of inputs" in message, message


def test_clipping_once_a_rank_has_joined_is_refused_on_every_rank(ranks):
    _, results = ranks
    for rank, out in enumerate(results):
        kind, message = out["refusals"]["clip"]
        assert kind == "UsageError", out["refusals"]["clip"]
        assert "fully_shard" in message and "join" in message.lower(), message
        if rank != 0:
            assert message.startswith("fully_shard clip_grad_norm_ all-reduce inside phalanx.join"), message
