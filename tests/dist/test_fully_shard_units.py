"""``fully_shard([a, b])`` (one unit of several modules) and ``CPUOffloadPolicy``, against
torch's ``fully_shard`` with the same arguments and single-process training.

The small GPT of ``test_fully_shard`` with, besides per-block units and the root, the
embedding and the final norm as one unit (they run at either end of the forward: gathered
when the embedding runs, freed after the norm), two blocks as one unit, and the final norm
and the head as one unit whose head the training loop calls by itself, on two chunks of the
batch, after the root's forward (torch's chunked loss). After several AdamW steps: equal to
torch's bit for bit at world 2; at world 3, gradients and parameters as close to one process
as torch's are in the same run (``tests.oracle``).

CPU offload on a CPU mesh: the shards, their gradients and AdamW's state are where they
already were, in host memory, and the run is torch's under ``CPUOffloadPolicy(pin_memory=False)``
bit for bit; ``pin_memory=True`` (the default), which torch 2.13 refuses without an accelerator
("Cannot access accelerator device when none is available."), runs the same with nothing
pinned. The accelerator's path (copies to the device and back): tests/gpu/test_fsdp_offload.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from phalanx.bench.engine import GPT
from phalanx.diagnostics import ledger
from phalanx.fsdp import FSDPModule, fully_shard
from tests.dist.test_fully_shard import (BF16, STEPS, _batch, _chunk, _compared, _grads_close, _grads_compared,
                                        _max_diff, _mine, _model, close_to_one_process)
from tests.harness import error_of, run_ranks

pytestmark = pytest.mark.slow


class ChunkedGPT(GPT):
    """The GPT whose forward stops at the final norm: the loop applies the head itself."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.ln(x)


def _ends(model, fs, **kwargs):
    """The embedding and the final norm one unit; each block; the root."""
    out = fs([model.embed, model.ln], **kwargs)
    for block in model.blocks:
        fs(block, **kwargs)
    fs(model, **kwargs)
    return out


def _pair(model, fs, **kwargs):
    """blocks 0 and 1 one unit; block 2; the root."""
    out = fs([model.blocks[0], model.blocks[1]], **kwargs)
    fs(model.blocks[2], **kwargs)
    fs(model, **kwargs)
    return out


def _norm_head(model, fs, **kwargs):
    """The final norm and the head one unit (the head called outside the root's forward)."""
    for block in model.blocks:
        fs(block, **kwargs)
    out = fs([model.ln, model.head], **kwargs)
    fs(model, **kwargs)
    return out


def _blocks(model, fs, **kwargs):
    """Each block; the root."""
    for block in model.blocks:
        fs(block, **kwargs)
    return [fs(model, **kwargs)]


UNPINNED = CPUOffloadPolicy(pin_memory=False)
# name: (sharding, phalanx's arguments, torch's where they differ)
CASES = {"ends": (_ends, {}, None), "ends_keep": (_ends, {"reshard_after_forward": False}, None),
         "ends_bf16": (_ends, {"mp_policy": BF16}, None), "pair": (_pair, {}, None),
         "chunked": (_norm_head, {}, None),
         "offload": (_blocks, {"offload_policy": UNPINNED}, None),
         "offload_pin": (_blocks, {"offload_policy": CPUOffloadPolicy()}, {"offload_policy": UNPINNED}),
         "offload_keep": (_blocks, {"offload_policy": UNPINNED, "reshard_after_forward": False}, None),
         "offload_bf16": (_ends, {"offload_policy": UNPINNED, "mp_policy": BF16}, None)}


def _loss(model, x, y, chunked):
    if not chunked:
        return F.cross_entropy(model(x), y)
    h = model(x)
    half = x.shape[0] // 2  # two chunks of sequences, each through the head alone
    logits = [model.head(part).flatten(0, 1) for part in (h[:half], h[half:])]
    return F.cross_entropy(torch.cat(logits), y)


def _train(rank, world_size, case):
    shard, kwargs, torch_kwargs = CASES[case]
    chunked = case == "chunked"
    torch.manual_seed(0)
    base = ChunkedGPT(vocab=50, tokens=8, dim=18, depth=3, heads=3) if chunked else _model()
    ours, theirs, single = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    group = shard(ours, fully_shard, **kwargs)
    torch_group = shard(theirs, torch_fully_shard, **(torch_kwargs or kwargs))
    opts = [torch.optim.AdamW(m.parameters(), lr=5e-3, weight_decay=0.1) for m in (ours, theirs, single)]
    out = {"loss_diff": 0.0, "grads_close": True, "grad_vs_torch": 0.0,
           "returned": (type(group).__name__, [type(m).__name__ for m in group],
                        [type(m).__name__ for m in torch_group])}
    for step in range(STEPS):
        batch = _batch(step, world_size)
        x, y = _mine(batch, rank)
        start = log.next_seq if (log := ledger().logs.get("world")) else 0
        losses = [_loss(m, x, y, chunked) for m in (ours, theirs)]
        for loss in losses:
            loss.backward()
        out["ops"] = [r.op.removeprefix("fully_shard ") for r in ledger().logs["world"].records
                      if r.seq >= start]
        _loss(single, *batch, chunked).backward()
        grads = _grads_compared(ours, theirs, single, world_size, rank)
        out["grads_close"] = out["grads_close"] and _grads_close(grads)
        out["grad_vs_torch"] = max(out["grad_vs_torch"], grads["grad_vs_torch"])
        out["loss_diff"] = max(out["loss_diff"], (losses[0] - losses[1]).abs().item())
        for opt in opts:
            opt.step()
            opt.zero_grad()
    out.update(_compared(ours, theirs, single))
    out["moved"] = _max_diff((p.to_local(), _chunk(q.detach(), world_size, rank))
                             for p, q in zip(ours.parameters(), base.parameters()))
    out["sharded"] = sorted({type(p).__name__ for p in ours.parameters()})
    if case.startswith("offload"):
        out["where"] = _where(ours, opts[0])
    return out


def _where(model, opt):
    """Devices (and pinning) of the shards, of the last step's gradients (kept: one more
    backward) and of the optimizer's state tensors (DTensors: their local tensors, as the
    others; torch 2.11's DTensor has no is_pinned)."""
    F.cross_entropy(model(_mine(_batch(9, 2), 0)[0]), _mine(_batch(9, 2), 0)[1]).backward()
    tensors = {"shards": [p.to_local() for p in model.parameters()],
               "grads": [p.grad.to_local() for p in model.parameters()],
               "state": [t.to_local() for st in opt.state.values() for t in st.values() if t.dim() > 0]}
    return {k: sorted({(str(t.device), t.is_pinned()) for t in ts}) for k, ts in tensors.items()}


def _errors(rank, world_size):
    """A unit of several modules cannot be the root (torch's words); a list that is not of
    modules, or empty, is refused; a module in a unit already cannot join another."""
    model = _model()
    fully_shard([model.embed, model.ln])
    out = {"root": error_of(model.embed, torch.zeros(1, 2, dtype=torch.long))}
    out["not_modules"] = error_of(fully_shard, [model.pos, 3])
    out["empty"] = error_of(fully_shard, [])
    out["again"] = error_of(fully_shard, [model.ln, model.head])
    linear = nn.Linear(2, 2)
    out["torch_pinned"] = error_of(torch_fully_shard, linear, offload_policy=CPUOffloadPolicy())
    out["bad_offload"] = error_of(fully_shard, nn.Linear(2, 2), offload_policy="cpu")
    nested = _model()
    fully_shard([nested.blocks[0], nested.blocks[0].qkv])  # the block only: qkv is inside it
    out["nested"] = (isinstance(nested.blocks[0], FSDPModule), isinstance(nested.blocks[0].qkv, FSDPModule))
    return out


def _all_checks(rank, world_size):
    out = {case: _train(rank, world_size, case) for case in CASES}
    out["errors"] = _errors(rank, world_size)
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def ranks(request):
    """(world size, every rank's results) of one group of ranks running all checks."""
    return request.param, run_ranks(_all_checks, request.param, timeout=400)


@pytest.mark.parametrize("case", list(CASES))
def test_equal_to_torch_and_to_one_process(ranks, case):
    world_size, results = ranks
    for rank, out in enumerate(results):
        res = out[case]
        assert res["moved"] > 1e-2, (case, rank)
        assert res["sharded"] == ["DTensor"], (case, rank)
        bf16 = case.endswith("bf16")
        if world_size == 2:  # every element, the key biases too, and every gradient
            assert res["torch_equal"] and res["loss_diff"] == 0.0, (case, rank, res["vs_torch"])
            assert res["grad_vs_torch"] == 0.0, (case, rank, res["grad_vs_torch"])
        if bf16:  # one fp32 rounding of the reduction can round to one bf16 step (test_fully_shard)
            assert res["vs_torch"] <= 1e-3, (case, rank, res["vs_torch"])
        else:  # as close to one process as torch's fully_shard, measured in this run
            assert not close_to_one_process(res), (case, rank, close_to_one_process(res))
            assert res["grads_close"], (case, rank)


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("offload")])
def test_offloaded_state_lives_on_the_host(ranks, case):
    _, results = ranks
    for out in results:
        # on a CPU mesh: host memory, nothing pinned (no accelerator to pin for)
        assert out[case]["where"] == {"shards": [("cpu", False)], "grads": [("cpu", False)],
                                      "state": [("cpu", False)]}, out[case]["where"]
    e = results[0]["errors"]
    # torch's pinned offload fails for want of an accelerator (a CUDA build of torch, as torch
    # 2.11's wheel on this machine, says so of the driver)
    no_accelerator = ("Found no NVIDIA driver on your system" if torch.version.cuda
                      else "Cannot access accelerator device when none is available.")
    assert e["torch_pinned"][0] == "RuntimeError" and e["torch_pinned"][1].startswith(no_accelerator), e
    assert e["bad_offload"] == ("ValueError", "offload_policy should be an OffloadPolicy (OffloadPolicy() "
                                "or CPUOffloadPolicy()), got 'cpu'"), e


def test_the_list_is_returned_its_modules_sharded(ranks):
    _, results = ranks
    assert results[0]["ends"]["returned"] == ("list", ["FSDPEmbedding", "FSDPLayerNorm"],
                                              ["FSDPEmbedding", "FSDPLayerNorm"])
    assert results[0]["pair"]["returned"] == ("list", ["FSDPBlock", "FSDPBlock"], ["FSDPBlock", "FSDPBlock"])


def test_one_all_gather_and_one_reduce_scatter_per_pass(ranks):
    """The unit of the embedding and the final norm: gathered once for the forward (at the
    embedding), freed after the norm, gathered again for the backward (at the norm), one
    reduce-scatter after the embedding's backward; named by both paths."""
    _, results = ranks
    for out in results:
        gathers = [op for op in out["ends"]["ops"] if op == "all-gather embed, ln"]
        scatters = [op for op in out["ends"]["ops"] if op == "reduce-scatter embed, ln"]
        assert (len(gathers), len(scatters)) == (2, 1), out["ends"]["ops"]
        assert out["ends_keep"]["ops"].count("all-gather embed, ln") == 1, out["ends_keep"]["ops"]
        assert out["pair"]["ops"].count("all-gather blocks.0, blocks.1") == 2, out["pair"]["ops"]
        assert out["pair"]["ops"].count("reduce-scatter blocks.0, blocks.1") == 1, out["pair"]["ops"]


def test_refusals(ranks):
    _, results = ranks
    e = results[0]["errors"]
    assert e["root"][0] == "RuntimeError"
    assert e["root"][1].startswith("FSDP requires a single root module but got (FSDPEmbedding("), e["root"]
    assert e["not_modules"] == ("ValueError", "fully_shard expects an nn.Module or a list of "
                                "nn.Module, got a list of Embedding, int")
    assert e["empty"] == ("ValueError", "fully_shard expects an nn.Module or a list of nn.Module, "
                          "got an empty list")
    assert e["again"] == ("ValueError", "fully_shard has already been applied to this module "
                          "(FSDPLayerNorm): each module can be sharded once")
    assert e["nested"] == (True, False)

