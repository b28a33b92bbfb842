"""ZeroRedundancyOptimizer resharding: a state dict saved at one world size resumes at another.

Gradients are averaged across ranks explicitly (see test_zero.py). The oracle is torch's plain
optimizer given the same averaged gradients in the same ranks, saved and resumed beside it: the
resumed run and the saved state equal it bit for bit, and the unsharded optimizer on one process
with full-batch gradients is as close to both as to it (``tests.oracle``).
"""

import pytest
import torch

from phalanx.zero import ZeroRedundancyOptimizer
from tests.dist.test_zero import OPTIMIZERS, _backward_averaged, _flat, _groups, _model, _plain_run
from tests.harness import run_ranks
from tests.oracle import oracle_bound

RESHARD_AT = 4  # steps before the checkpoint; as many again after it


def _save_checkpoint(rank, world_size, path):
    """Adam with two groups and a scheduler; consolidate on the last rank, which saves."""
    cls, kwargs, schedule = OPTIMIZERS["adam"]
    model, ref = _model(), _model()
    zero = ZeroRedundancyOptimizer(_groups(model), cls, **kwargs)
    plain = cls(_groups(ref), **kwargs)  # the oracle: torch's optimizer, the same gradients
    scheds = [schedule(zero), schedule(plain)]
    for step in range(RESHARD_AT):
        _steps(((model, zero), (ref, plain)), scheds, step, rank, world_size)
    last = world_size - 1
    zero.consolidate_state_dict(to=last)
    if rank == last:
        torch.save({"model": model.state_dict(), "optim": zero.state_dict(),
                    "sched": scheds[0].state_dict()}, path)
        torch.save({"model": ref.state_dict(), "optim": plain.state_dict(),
                    "sched": scheds[1].state_dict()}, path + ".plain")
        return None
    try:
        zero.state_dict()
    except RuntimeError as e:
        return str(e)


def _steps(pairs, scheds, step, rank, world_size):
    """One step of each (model, optimizer) on its own averaged gradients, then the schedulers."""
    for model, opt in pairs:
        _backward_averaged(model, step, rank, world_size)
        opt.step()
        opt.zero_grad()
    for sched in scheds:
        sched.step()


def _resume_checkpoint(rank, world_size, path):
    """ZeRO resumed from the checkpoint and, beside it, torch's optimizer from its own."""
    cls, kwargs, schedule = OPTIMIZERS["adam"]
    pairs, scheds = [], []
    for file, make in ((path, lambda m: ZeroRedundancyOptimizer(_groups(m), cls, **kwargs)),
                       (path + ".plain", lambda m: cls(_groups(m), **kwargs))):
        saved = torch.load(file, weights_only=True)  # the format needs no unpickling of code
        model = _model()
        opt = make(model)
        scheds.append(schedule(opt))
        model.load_state_dict(saved["model"])
        scheds[-1].load_state_dict(saved["sched"])
        opt.load_state_dict(saved["optim"])
        pairs.append((model, opt))
    (model, zero), (ref, _) = pairs
    loaded_lr = [g["lr"] for g in zero.param_groups]
    for step in range(RESHARD_AT, 2 * RESHARD_AT):
        _steps(pairs, scheds, step, rank, world_size)
    return {"params": _flat(model).tolist(), "ref_params": _flat(ref).tolist(), "loaded_lr": loaded_lr,
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
        assert out["params"] == out["ref_params"]  # torch's optimizer resumed alike, bit for bit
        assert out["params"] == resumed[0]["params"]
    # one process: as close as torch's optimizer on the same averaged gradients (tests.oracle)
    distance = (torch.tensor(resumed[0]["ref_params"]) - expected).abs().max().item()
    bound = oracle_bound(distance, expected.abs().max().item())
    assert (torch.tensor(resumed[0]["params"]) - expected).abs().max().item() <= bound, distance
    # The file is an ordinary optimizer state dict: the plain optimizer resumes from it alike.
    ckpt = torch.load(path, weights_only=True)
    _, plain_first = _plain_run("adam", RESHARD_AT)
    reference = plain_first.state_dict()
    assert ckpt["optim"]["zero"]["world_size"] == save_at
    assert ckpt["optim"]["param_groups"] == reference["param_groups"]
    assert ckpt["optim"]["state"].keys() == reference["state"].keys()
    # its values: torch's optimizer's state on the same gradients, bit for bit
    plain_ckpt = torch.load(path + ".plain", weights_only=True)
    for i, state in plain_ckpt["optim"]["state"].items():
        for key, value in state.items():
            assert torch.equal(ckpt["optim"]["state"][i][key], value), (i, key)
    plain_model, _ = _plain_run("adam", RESHARD_AT, ckpt, first_step=RESHARD_AT)
    assert torch.equal(_flat(plain_model), _flat(_plain_run("adam", RESHARD_AT, plain_ckpt,
                                                            first_step=RESHARD_AT)[0]))
    assert resumed[0]["loaded_lr"] == [g["lr"] for g in ckpt["optim"]["param_groups"]]
