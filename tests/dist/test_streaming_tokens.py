"""token_loss_scale on real ranks: with ranks holding very different numbers of loss tokens and
two accumulation micro-batches each, DDP's gradient equals one process's on the global batch
(the global per-token mean); the per-rank mean that DDP users write by default does not."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

import phalanx
from tests.harness import run_ranks

WORLD, STEPS, SEQS, LENGTH, VOCAB = 3, 2, 4, 12, 50
# valid (loss) tokens per sequence of each rank: rank 0 holds 2 a sequence, rank 2 all 12
VALID = (2, 7, 12)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB))


def _chunks():
    """The global batch, as ``[rank][micro-batch] -> (inputs, targets)``; -100 is padding."""
    g = torch.Generator().manual_seed(1)
    out = []
    for rank in range(WORLD):
        micro = []
        for step in range(STEPS):
            x = torch.randint(VOCAB, (SEQS, LENGTH), generator=g)
            y = torch.randint(VOCAB, (SEQS, LENGTH), generator=g)
            y[:, max(1, VALID[rank] - step):] = -100
            micro.append((x, y))
        out.append(micro)
    return out


def _loss_sum(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def _rank(rank, _world_size):
    micro = _chunks()[rank]
    out = {}
    for way in ("scaled", "per-rank mean"):
        model = phalanx.DistributedDataParallel(_model())
        scale = phalanx.token_loss_scale(sum(int((y != -100).sum()) for _, y in micro))
        for i, (x, y) in enumerate(micro):
            with model.no_sync() if i < STEPS - 1 else contextlib.nullcontext():
                if way == "scaled":
                    loss = _loss_sum(model, x, y) * scale
                else:
                    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / STEPS
                loss.backward()
        out[way] = [g.tolist() for g in _grads(model.module)]  # tensors pickle as shared memory
    return out


def _distance(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.mark.slow
def test_token_weighted_gradient_equals_one_process_on_the_global_batch():
    results = [{way: [torch.tensor(g) for g in grads] for way, grads in r.items()}
               for r in run_ranks(_rank, WORLD)]
    chunks = [c for micro in _chunks() for c in micro]
    tokens = sum(int((y != -100).sum()) for _, y in chunks)
    oracle = _model()  # one process, the global batch, the global per-token mean
    x, y = torch.cat([c[0] for c in chunks]), torch.cat([c[1] for c in chunks])
    (_loss_sum(oracle, x, y) / tokens).backward()
    expected = _grads(oracle)
    # torch's own rounding distance: one process accumulating the same micro-batches
    accumulated = _model()
    for cx, cy in chunks:
        (_loss_sum(accumulated, cx, cy) / tokens).backward()
    rounding = _distance(_grads(accumulated), expected)
    scale = max(float(g.abs().max()) for g in expected)
    # DDP adds a sum over ranks and a division by the world size to the accumulation: allow
    # twice torch's own distance plus a few float32 roundings of the largest gradient
    bound = 2 * rounding + 4 * torch.finfo(torch.float32).eps * scale
    for rank, got in enumerate(results):
        assert _distance(got["scaled"], results[0]["scaled"]) == 0, rank
        distance = _distance(got["scaled"], expected)
        assert distance <= bound, (rank, distance, bound, rounding)
        assert distance <= 1e-6, distance  # the goal, here a consequence of the bound
    naive = _distance(results[0]["per-rank mean"], expected)
    assert naive > 1000 * bound, (naive, bound)  # the bug the scale fixes is real here
    print(f"distance {_distance(results[0]['scaled'], expected):.3g} torch's own {rounding:.3g} "
          f"bound {bound:.3g} naive {naive:.3g} max |grad| {scale:.3g}")
