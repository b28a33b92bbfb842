"""What scripts written for torch's DDP do that phalanx's must do too (issue 15): pickling and
deep-copying the wrapped model, backward(create_graph=True), sparse embeddings. The oracle is
torch's own DistributedDataParallel, run in the same ranks on the same data."""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import phalanx
from phalanx.ddp.unusual import HIGHER_ORDER_WARNING
from tests.harness import error_of, run_ranks
from tests.oracle import oracle_bound, reorder_bound


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 5, generator=g) * (rank + 1), torch.randn(6, 3, generator=g)


def _train(model, steps, rank, first_step=0):
    """Plain SGD steps on this rank's batches (stateless: a copied model needs no optimizer state)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(first_step, first_step + steps):
        x, y = _batch(rank, step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _flat(model):
    return torch.cat([t.detach().flatten() for t in model.state_dict().values() if t.is_floating_point()])


def _restore(ddp, how):
    if how == "torch.save":
        buffer = io.BytesIO()
        torch.save(ddp, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)
    if how == "pickle":
        return pickle.loads(pickle.dumps(ddp))
    return copy.deepcopy(ddp)


def _pickled(rank, world_size):
    out = {}
    ours, theirs = phalanx.DistributedDataParallel(_net()), TorchDDP(_net())
    _train(ours, 2, rank), _train(theirs, 2, rank)
    for how in ("torch.save", "pickle", "deepcopy"):
        restored, oracle = _restore(ours, how), copy.deepcopy(theirs)
        fresh_params = all(p is not q for p, q in zip(restored.parameters(), ours.parameters()))
        _train(restored, 3, rank, first_step=2), _train(oracle, 3, rank, first_step=2)
        out[how] = {"fresh_params": fresh_params, "group": restored.process_group,
                    "diff": (_flat(restored) - _flat(oracle)).abs().max().item(),
                    "moved": (_flat(restored) - _flat(ours)).abs().max().item(),
                    "hooks": sum(len(p._post_accumulate_grad_hooks or {}) for p in restored.parameters())}
    _train(ours, 1, rank, first_step=9), _train(theirs, 1, rank, first_step=9)  # the originals, beside the copies
    out["original"] = max((p.grad - q.grad).abs().max().item() for p, q in zip(ours.parameters(), theirs.parameters()))
    sub = dist.new_group([0, 1])  # the same ranks, but not the default group
    on_sub = phalanx.DistributedDataParallel(_net(), process_group=sub)
    copied = copy.deepcopy(on_sub)
    out["sub_copy_shares_group"] = copied.process_group is sub
    x, _ = _batch(rank, 0)
    copied(x).sum().backward()
    out["sub_copy_grad"] = copied.module[3].bias.grad.tolist()
    out["sub_pickle"] = error_of(pickle.dumps, on_sub)
    out["sub_torch_save"] = error_of(torch.save, on_sub, io.BytesIO())
    out["bytes"] = pickle.dumps(ours)  # the parent, without a process group, tries to load it
    return out


@pytest.fixture(scope="module")
def pickled():
    """Every rank's results of one group of 2 ranks running _pickled (the tests below)."""
    return run_ranks(_pickled, 2)


@pytest.mark.parametrize("how", ["torch.save", "pickle", "deepcopy"])
def test_pickled_and_copied_ddp_keeps_training_equal_to_torch(pickled, how):
    for out in pickled:
        res = out[how]
        assert res["fresh_params"] and res["group"] is None, how
        assert res["diff"] < 1e-6, (how, res)  # gradients still averaged: equal to torch's DDP
        assert res["moved"] > 1e-3, how  # it did train after loading
        assert res["hooks"] == 6, how  # one hook per parameter, rebuilt on the loaded ones


def test_the_original_beside_its_copies_still_trains_equal_to_torch(pickled):
    for out in pickled:
        assert out["original"] < 1e-6


def test_a_copy_over_a_subgroup_shares_it_and_averages_over_it(pickled):
    results = pickled
    for out in results:
        assert out["sub_copy_shares_group"]
    assert results[0]["sub_copy_grad"] == results[1]["sub_copy_grad"]  # averaged over the subgroup


def test_a_ddp_over_a_subgroup_cannot_be_pickled(pickled):
    for out in pickled:
        assert out["sub_pickle"][0] == "UsageError" and out["sub_torch_save"][0] == "UsageError"
        assert out["sub_pickle"][1].startswith(
            "a DistributedDataParallel over a process group cannot be pickled: the process group "
            "exists in this process only. As in torch, pickling needs process_group=None")


def test_unpickled_without_a_process_group_it_says_so(pickled):
    results = pickled
    with pytest.raises(phalanx.NotInitializedError, match="needs a process group: call phalanx.init_process_group"):
        pickle.loads(results[0]["bytes"])


class Scalar(nn.Module):
    """torch's own create_graph test model (test_ddp_create_graph)."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.tensor(1.0))

    def forward(self, x):
        return self.p.pow(2) * x


def _second_order(model):
    """d/dp of the squared norm of the (averaged) gradients: through the graph .grad keeps."""
    penalty = sum(p.grad.pow(2).sum() for p in model.parameters())
    return torch.autograd.grad(penalty, list(model.parameters()), retain_graph=True)


def _create_graph(rank, world_size):
    out = {"scalar": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        models = [phalanx.DistributedDataParallel(Scalar()), TorchDDP(Scalar())]
        x = torch.tensor(float(rank + 1))
        for _ in range(3):  # gradients accumulate, as in torch's test
            for m in models:
                m(x).pow(2).backward(create_graph=True)
            ours, theirs = (m.module.p for m in models)
            out["scalar"].append((ours.grad.item(), theirs.grad.item(), ours.grad.requires_grad,
                                  _second_order(models[0])[0].item(), _second_order(models[1])[0].item()))
    out["warnings"] = [str(w.message) for w in caught if "DistributedDataParallel with backward" in str(w.message)]
    for view in (False, True):  # an MLP: torch's DDP fails here ("a leaf Variable ... in-place")
        mlp = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        ours, oracle = phalanx.DistributedDataParallel(copy.deepcopy(mlp), gradient_as_bucket_view=view), TorchDDP(mlp)
        x = torch.randn(5, 3) * (rank + 1)
        ours(x).pow(2).sum().backward(create_graph=True)
        oracle(x).pow(2).sum().backward()
        params = list(ours.module.parameters())
        first = max((p.grad - q.grad).abs().max().item() for p, q in zip(params, oracle.module.parameters()))
        local = torch.autograd.grad(ours.module(x).pow(2).sum(), params, create_graph=True)
        largest = torch.stack([g.detach().abs().max() for g in local]).max()
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)  # every rank's gradient is at most this
        # the averaged .grad's derivative with respect to this rank's gradient is 1/world size
        expected = torch.autograd.grad(sum((2 * p.grad.detach() / world_size * g).sum()
                                           for p, g in zip(params, local)), params)
        got = _second_order(ours.module)
        bound = reorder_bound(largest.item(), world_size)  # another order of the same sum
        out[f"mlp view={view}"] = (first, max((a - b).abs().max().item() for a, b in zip(got, expected)),
                                   all(p.grad.requires_grad for p in params), bound)
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def create_graph(request):
    """(world size, every rank's results) of one group of ranks running _create_graph."""
    return request.param, run_ranks(_create_graph, request.param)


def test_create_graph_averages_first_order_gradients_as_torch(create_graph):
    world, results = create_graph
    for out in results:
        for ours, theirs, requires_grad, ours2, theirs2 in out["scalar"]:
            assert ours == pytest.approx(theirs, rel=1e-6) and requires_grad
            assert ours2 == pytest.approx(theirs2, rel=1e-6)  # torch's higher-order terms too
        # torch's values: rank r has 4 (r+1)^2; .grad accumulates the averages
        mean = sum(4 * (r + 1) ** 2 for r in range(world)) / world
        assert [s[0] for s in out["scalar"]] == pytest.approx([mean, 2 * mean, 3 * mean])


def test_create_graph_warns_that_higher_order_gradients_are_not_averaged(create_graph):
    _, results = create_graph
    for out in results:
        assert out["warnings"] and set(out["warnings"]) == {HIGHER_ORDER_WARNING}
        assert "higher-order gradients are not averaged" in HIGHER_ORDER_WARNING


@pytest.mark.parametrize("view", [False, True], ids=["view=False", "view=True"])
def test_create_graph_on_an_mlp_where_torchs_ddp_fails(create_graph, view):
    _, results = create_graph
    for out in results:
        first, second, requires_grad, bound = out[f"mlp view={view}"]
        assert first <= bound and second < 1e-5 and requires_grad, (view, first, second, bound)


class Tables(nn.Module):
    """Two sparse tables (an Embedding and an EmbeddingBag) and a dense head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(12, 4, sparse=True)
        self.bag = nn.EmbeddingBag(7, 4, mode="sum", sparse=True)
        self.head = nn.Linear(4, 2)

    def forward(self, idx, use_bag=True):
        h = self.emb(idx).mean(1)
        return self.head(h + self.bag(idx % 7) if use_bag else h)


def _ids(rank, step):
    return torch.randint(0, 12, (3, 4), generator=torch.Generator().manual_seed(10 * step + rank))


def _rel(pairs):
    """The worst difference of a pair of tensors relative to the second's largest value."""
    return max(((a.to_dense() - b.to_dense()).abs().max() / b.to_dense().abs().max()).item() for a, b in pairs)


def _grads_vs_torch(ours, theirs, single):
    """Worst relative difference of the gradients from one process's, of torch's from it,
    and what ours look like: layout, coalesced."""
    looks = {}
    for (name, p), q in zip(ours.module.named_parameters(), theirs.module.parameters()):
        if p.grad.is_sparse:
            looks[name] = (p.grad.layout, p.grad.is_coalesced(), q.grad.layout)
            assert torch.equal(p.grad._indices(), q.grad.coalesce()._indices()), name
    singles = [q.grad for q in single.parameters()]
    return ((_rel(zip([p.grad for p in ours.parameters()], singles)),
             _rel(zip([q.grad for q in theirs.parameters()], singles))), looks)


def _one_process_loss(model, step, world_size):
    """What DDP averages, on one process: every rank's loss (and its micro-batch at step 1)
    summed, divided by the world size."""
    total = 0.0
    for rank in range(world_size):
        if step == 1:
            total = total + model(_ids(rank, 99)).sum()
        total = total + model(_ids(rank, step)).pow(2).sum()
    return total / world_size


def _sparse_training(rank, view):
    world_size = dist.get_world_size()
    ours = phalanx.DistributedDataParallel(Tables(), gradient_as_bucket_view=view)
    theirs = TorchDDP(Tables(), gradient_as_bucket_view=view)
    single = Tables()
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ours, theirs, single)]
    out = {"grads": [], "params": []}
    for step in range(3):
        for opt in opts:
            opt.zero_grad()
        for m in (ours, theirs):
            if step == 1:  # a micro-batch accumulated locally first
                with m.no_sync():
                    m(_ids(rank, 99)).sum().backward()
            m(_ids(rank, step)).pow(2).sum().backward()
        _one_process_loss(single, step, world_size).backward()
        out["grads"].append(_grads_vs_torch(ours, theirs, single))
        for opt in opts:
            opt.step()
        out["params"].append((_rel(zip(ours.parameters(), single.parameters())),
                              _rel(zip(theirs.parameters(), single.parameters()))))
    return out


def _sparse_unused(rank, world_size):
    out = {}
    ddp = phalanx.DistributedDataParallel(Tables(), find_unused_parameters=True)
    local = copy.deepcopy(ddp.module)
    ids = _ids(rank, 0)
    ddp(ids, use_bag=rank == 0).sum().backward()  # the bag is used on rank 0 only
    local(ids, use_bag=rank == 0).sum().backward()
    expected = local.bag.weight.grad.to_dense() if rank == 0 else torch.zeros(7, 4)
    dist.all_reduce(expected)
    out["one_rank"] = (ddp.module.bag.weight.grad.layout,
                       (ddp.module.bag.weight.grad.to_dense() - expected / world_size).abs().max().item())
    nowhere = phalanx.DistributedDataParallel(Tables(), find_unused_parameters=True)
    nowhere(ids, use_bag=False).sum().backward()
    out["nowhere"] = nowhere.module.bag.weight.grad
    strict = phalanx.DistributedDataParallel(Tables())
    out["strict"] = error_of(lambda: strict(ids, use_bag=rank == 0).sum().backward())
    alone, oracle = phalanx.DistributedDataParallel(Tables().emb), TorchDDP(Tables().emb)
    for m in (alone, oracle):
        m(ids).pow(2).sum().backward()
    out["only_sparse"] = ((alone.module.weight.grad.to_dense() - oracle.module.weight.grad.to_dense()).abs().max().item(),
                          alone.module.weight.grad.layout, [len(b.slots) for b in alone.bucket_plan])
    return out


def _sparse(rank, world_size):
    return {"view": {view: _sparse_training(rank, view) for view in (False, True)},
            "unused": _sparse_unused(rank, world_size)}


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def sparse(request):
    """(world size, every rank's results) of one group of ranks running _sparse."""
    return request.param, run_ranks(_sparse, request.param)


@pytest.mark.parametrize("view", [False, True], ids=["view=False", "view=True"])
def test_sparse_embeddings_train_equal_to_torch(sparse, view):
    _, results = sparse
    for out in results:
        res = out["view"][view]
        # relative to one process (ULPs of 1.0): as close as torch's DDP, in this run
        for (worst, torchs), looks in res["grads"]:
            assert worst <= oracle_bound(torchs, 1.0), (view, worst, torchs)
            assert looks == {n: (torch.sparse_coo, True, torch.sparse_coo) for n in ("emb.weight", "bag.weight")}
        for worst, torchs in res["params"]:
            assert worst <= oracle_bound(torchs, 1.0), (view, res["params"])


def test_a_sparse_table_used_on_one_rank_or_none(sparse):
    _, results = sparse
    for out in results:
        unused = out["unused"]
        assert unused["one_rank"][0] == torch.sparse_coo and unused["one_rank"][1] < 1e-6
        assert unused["nowhere"] is None  # no gradient on any rank: .grad left alone


def test_a_sparse_table_unused_without_find_unused_parameters_is_named(sparse):
    world, results = sparse
    for out in results:
        unused = out["unused"]
        kind, message = unused["strict"]
        assert kind == "UnusedParametersError"
        assert "".join(f"rank {r}: 'bag.weight'" for r in range(1, world))[:20] in message


def test_a_model_of_sparse_parameters_only(sparse):
    _, results = sparse
    for out in results:
        unused = out["unused"]
        assert unused["only_sparse"][0] < 1e-6 and unused["only_sparse"][1] == torch.sparse_coo
        assert unused["only_sparse"][2] == [0]  # one bucket, for the control tail alone


def _recognised_by_torch(rank, world_size, directory):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ours, theirs = phalanx.DistributedDataParallel(copy.deepcopy(net)), TorchDDP(copy.deepcopy(net))
    out = {"isinstance": isinstance(ours, TorchDDP) and issubclass(type(ours), TorchDDP),
           "keys": (sorted(get_model_state_dict(ours)), sorted(get_model_state_dict(theirs)))}
    # a DCP checkpoint written from phalanx's DDP loads into torch's, and back
    dcp.save(get_model_state_dict(ours), checkpoint_id=directory)
    with torch.no_grad():
        for p in theirs.parameters():
            p.zero_()
    state = get_model_state_dict(theirs)
    dcp.load(state, checkpoint_id=directory)
    set_model_state_dict(theirs, state)
    out["loaded"] = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), theirs.parameters()))
    return out


def test_torchs_checkpoint_helpers_see_phalanx_ddp_as_a_ddp(tmp_path):
    for out in run_ranks(_recognised_by_torch, 2, str(tmp_path)):
        assert out["isinstance"]
        ours, theirs = out["keys"]
        assert ours == theirs == ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert out["loaded"] == 0.0
