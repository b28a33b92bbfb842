"""``fully_shard(..., offload_policy=CPUOffloadPolicy(pin_memory=...))`` on a GPU: the shards,
their gradients and AdamW's state in host memory (pinned when asked), the unsharded
parameters on the GPU while a unit computes, and the training equal to torch's
``fully_shard`` under the same policy, bit for bit (NCCL at world size 1 on cuda:0, and at
world size 2 with two GPUs: one rank per GPU).

What the CPU cannot show (tests/dist/test_fully_shard_units.py runs the offload on a CPU mesh,
where every copy is a no-op): the copy of each unit's shards to the GPU before its all-gather
(asynchronous from pinned memory), and of each reduced gradient shard back to the host
(asynchronous into pinned memory, waited for at the end of the backward).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import phalanx
from phalanx.bench.engine import GPT
from phalanx.fsdp import fully_shard
from tests.gpu.common import NEEDS_CUDA, ON_CPU, save_results
from tests.gpu.world1 import DETERMINISTIC_ENV
from tests.harness import run_ranks

# ON_CPU: the checks' logic on the CPU over Gloo (tools/gpu_check.py --rehearse-on-cpu), where
# nothing is pinned or copied: proving nothing about CUDA
pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or ON_CPU), reason=NEEDS_CUDA)

# Seconds: a CUDA context, NCCL's start (~15 s) and 2 x 3 small training steps.
TIMEOUT_S = 90
STEPS = 3


def _shard(model, fs, policy):
    for block in model.blocks:
        fs(block, offload_policy=policy)
    fs(model, offload_policy=policy)
    return model


def _train(rank, world_size, pin):
    torch.use_deterministic_algorithms(True, warn_only=True)
    device = torch.device("cpu") if ON_CPU else torch.device("cuda", rank)
    torch.manual_seed(0)
    base = GPT(vocab=50, tokens=8, dim=32, depth=2, heads=4)  # built on the host, as torch allows
    policy = CPUOffloadPolicy(pin_memory=pin)
    ours = _shard(copy.deepcopy(base), fully_shard, policy)
    # (torch's pin_memory=True raises without an accelerator: the CPU rehearsal pins nothing)
    theirs = _shard(copy.deepcopy(base), torch_fully_shard, CPUOffloadPolicy(pin_memory=pin and not ON_CPU))
    opts = [torch.optim.AdamW(m.parameters(), lr=5e-3) for m in (ours, theirs)]
    seen_in_forward = []
    ours.blocks[0].register_forward_hook(  # (before the unit's post-forward frees them)
        lambda m, args, out: seen_in_forward.append(sorted({str(p.device) for p in m.parameters()})),
        prepend=True)
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randint(0, 50, (4, 8), generator=g).to(device)
        y = torch.randint(0, 50, (4 * 8,), generator=g).to(device)
        for model, opt in zip((ours, theirs), opts):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            if model is ours and step == STEPS - 1:
                grads = [p.grad.to_local() for p in model.parameters()]
            opt.zero_grad()
            losses.append(loss.item())
    shards = [p.to_local() for p in ours.parameters()]
    state = [t for st in opts[0].state.values() for t in st.values() if t.dim() > 0]
    where = {name: sorted({(str(t.device), t.is_pinned()) for t in ts})
             for name, ts in (("shards", shards), ("grads", grads))}
    where["state"] = sorted({str(t.device) for t in state})  # (pinned or not: AdamW's choice)
    equal = all(torch.equal(p.to_local(), q.to_local())
                for p, q in zip(ours.parameters(), theirs.parameters()))
    diff = max((p.to_local() - q.to_local()).abs().max().item()
               for p, q in zip(ours.parameters(), theirs.parameters()))
    return {"where": where, "forward": seen_in_forward[0], "equal": equal, "diff": diff,
            "losses": losses}


def _run(rank, world_size, pin):
    phalanx.init_process_group(backend="gloo" if ON_CPU else None)  # NCCL, pinned to cuda:rank
    try:
        return _train(rank, world_size, pin)
    finally:
        phalanx.destroy_process_group()


# world size 2 needs two GPUs (one rank per GPU); where there is one, the cases are not made at
# all rather than skipped: tools/gpu_check.py fails a part in which anything skips on a GPU
WORLD_SIZES = [1, 2] if ON_CPU or torch.cuda.device_count() >= 2 else [1]


@pytest.mark.parametrize("pin", [True, False], ids=["pinned", "unpinned"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_offload_equals_torchs_and_keeps_state_on_the_host(world_size, pin):
    results = run_ranks(_run, world_size, pin, init=False, env=DETERMINISTIC_ENV, timeout=TIMEOUT_S)
    save_results(f"fsdp_offload_world{world_size}_{'pinned' if pin else 'unpinned'}", results)
    pinned = pin and not ON_CPU
    for rank, out in enumerate(results):
        assert out["where"] == {"shards": [("cpu", pinned)], "grads": [("cpu", pinned)],
                                "state": ["cpu"]}, (rank, out["where"])
        assert out["forward"] == ["cpu" if ON_CPU else f"cuda:{rank}"], (rank, out["forward"])
        assert out["equal"], (rank, out["diff"], out["losses"])
