"""ZeroRedundancyOptimizer resharding: a state dict saved at one world size resumes at another.

Gradients are averaged across ranks explicitly (see test_zero.py); the oracle is the unsharded
optimizer on one process with full-batch gradients.
"""

import pytest
import torch

from phalanx.zero import ZeroRedundancyOptimizer
from tests.dist.test_zero import OPTIMIZERS, TOL, _backward_averaged, _flat, _groups, _model, _plain_run
from tests.harness import run_ranks

RESHARD_AT = 4  # steps before the checkpoint; as many again after it


def _save_checkpoint(rank, world_size, path):
    """Adam with two groups and a scheduler; consolidate on the last rank, which saves."""
    cls, kwargs, schedule = OPTIMIZERS["adam"]
    model = _model()
    zero = ZeroRedundancyOptimizer(_groups(model), cls, **kwargs)
    sched = schedule(zero)
    for step in range(RESHARD_AT):
        _backward_averaged(model, step, rank, world_size)
        zero.step()
        sched.step()
        zero.zero_grad()
    last = world_size - 1
    zero.consolidate_state_dict(to=last)
    if rank == last:
        torch.save({"model": model.state_dict(), "optim": zero.state_dict(),
                    "sched": sched.state_dict()}, path)
        return None
    try:
        zero.state_dict()
    except RuntimeError as e:
        return str(e)


def _resume_checkpoint(rank, world_size, path):
    cls, kwargs, schedule = OPTIMIZERS["adam"]
    saved = torch.load(path, weights_only=True)  # the format needs no unpickling of code
    model = _model()
    zero = ZeroRedundancyOptimizer(_groups(model), cls, **kwargs)
    sched = schedule(zero)
    model.load_state_dict(saved["model"])
    sched.load_state_dict(saved["sched"])
    zero.load_state_dict(saved["optim"])
    loaded_lr = [g["lr"] for g in zero.param_groups]
    for step in range(RESHARD_AT, 2 * RESHARD_AT):
        _backward_averaged(model, step, rank, world_size)
        zero.step()
        sched.step()
        zero.zero_grad()
    return {"params": _flat(model).tolist(), "loaded_lr": loaded_lr,
            "stateful": sorted(i for i, p in enumerate(model.parameters()) if zero.state.get(p))}


@pytest.mark.parametrize("save_at, load_at", [(2, 3), (3, 2)])
def test_save_at_one_world_size_resume_at_another(tmp_path, save_at, load_at):
    path = str(tmp_path / "ckpt.pt")
    saved = run_ranks(_save_checkpoint, save_at, path)
    for message in saved[:-1]:
        assert "no consolidated state here" in message and "consolidate_state_dict(to=" in message
    resumed = run_ranks(_resume_checkpoint, load_at, path)
    expected = _flat(_plain_run("adam", 2 * RESHARD_AT)[0])
    n_params = len(list(_model().parameters()))
    assert sorted(i for out in resumed for i in out["stateful"]) == list(range(n_params))
    for out in resumed:
        assert (torch.tensor(out["params"]) - expected).abs().max().item() <= TOL
        assert out["params"] == resumed[0]["params"]
    # The file is an ordinary optimizer state dict: the plain optimizer resumes from it alike.
    ckpt = torch.load(path, weights_only=True)
    _, plain_first = _plain_run("adam", RESHARD_AT)
    reference = plain_first.state_dict()
    assert ckpt["optim"]["zero"]["world_size"] == save_at
    assert ckpt["optim"]["param_groups"] == reference["param_groups"]
    assert ckpt["optim"]["state"].keys() == reference["state"].keys()
    for i, state in reference["state"].items():
        for key, value in state.items():
            assert (ckpt["optim"]["state"][i][key] - value).abs().max().item() <= TOL, (i, key)
    plain_model, _ = _plain_run("adam", RESHARD_AT, ckpt, first_step=RESHARD_AT)
    assert (_flat(plain_model) - expected).abs().max().item() <= TOL
    assert resumed[0]["loaded_lr"] == [g["lr"] for g in ckpt["optim"]["param_groups"]]
