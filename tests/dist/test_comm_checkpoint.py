"""Checkpoints of the communication state (issue 12): a run resumed from a checkpoint taken
while PowerSGD's error feedback is non-zero, in the middle of a local SGD / DiLoCo period, or
while an overlapped meeting is under way, ends bit for bit where the uninterrupted run ends;
without the comm state it does not."""

from __future__ import annotations

import torch
from torch import nn

import phalanx
from phalanx import comm_hooks
from phalanx.checkpoint.state import load_comm_state
from tests.harness import error_of, run_ranks

SAVE_AT, STEPS = 5, 9
KINDS = ("powersgd", "local", "diloco", "diloco overlapped")


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3))


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(12, 10, generator=g), torch.randint(0, 3, (12,), generator=g)


def _build(kind):
    """(model, optimizer, comm state, object whose step() steps)"""
    model = phalanx.DistributedDataParallel(_net(), bucket_cap_mb=0.004)  # 4 KiB: 2 buckets
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if kind == "powersgd":
        state = comm_hooks.PowerSGDState(None, 2, start_powerSGD_iter=2)
        model.register_comm_hook(state, comm_hooks.powerSGD_hook)
        return model, opt, state, opt
    if kind == "local":
        scheme = phalanx.LocalSGD(model, opt, every=3)
    elif kind == "diloco":
        scheme = phalanx.DiLoCo(model, opt, every=3, compress="bf16")
    else:  # the meeting of step 4 is under way at the save (step 5) and lands at step 6
        scheme = phalanx.DiLoCo(model, opt, every=2, compress="fp16", overlap=2)
    return model, opt, scheme, scheme


def _train(rank, model, stepper, steps):
    for step in steps:
        x, y = _batch(rank, step)
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        stepper.step()


def _resume(rank, world_size, directory):
    out = {}
    for kind in KINDS:
        model, opt, state, stepper = _build(kind)
        ckpt = phalanx.Checkpointer(f"{directory}/{kind}", model, opt, comm_state=state)
        _train(rank, model, stepper, range(SAVE_AT))
        ckpt.save(0, SAVE_AT)
        _train(rank, model, stepper, range(SAVE_AT, STEPS))
        want = torch.cat([p.detach().flatten() for p in model.parameters()])
        results = []
        for with_state in (True, False):
            model, opt, state, stepper = _build(kind)
            ckpt = phalanx.Checkpointer(f"{directory}/{kind}", model, opt, comm_state=state if with_state else None)
            assert ckpt.load().step == SAVE_AT
            _train(rank, model, stepper, range(SAVE_AT, STEPS))
            results.append(torch.equal(torch.cat([p.detach().flatten() for p in model.parameters()]), want))
        out[kind] = results
        if kind == "powersgd":
            out["errors"] = sum(e.abs().sum().item() for e in state.errors.values())
    return out


def test_comm_state_resumes_exactly(tmp_path):
    for out in run_ranks(_resume, 2, str(tmp_path)):
        assert out["errors"] > 0  # the checkpoint held error feedback worth keeping
        for kind in KINDS:
            assert out[kind] == [True, False], kind


def test_comm_state_needs_the_same_world_size(tmp_path):
    state = comm_hooks.PowerSGDState()
    assert error_of(load_comm_state, state, [state.state_dict()] * 2, tmp_path / "c.ckpt", 0, 3) == (
        "CheckpointError",
        f"Checkpoint {tmp_path / 'c.ckpt'} holds the comm_state of 2 ranks, this run has 3: it is each rank's "
        "own (error feedback, local parameters), so it resumes at the same world size only; pass "
        "comm_state=None to start it afresh")
    assert error_of(load_comm_state, state, None, "c.ckpt", 0, 1) == (
        "CheckpointError", "Checkpoint c.ckpt holds no comm_state, but a comm_state was given")
    assert error_of(load_comm_state, state, [{"iter": 3}], "c.ckpt", 0, 1) == (
        "CheckpointError", "Checkpoint c.ckpt: its comm_state does not fit the comm_state given: a "
        "PowerSGDState state dict has iter, errors and qs; missing ['errors', 'qs']")
    assert error_of(phalanx.Checkpointer, tmp_path, nn.Linear(1, 1), comm_state=3) == (
        "TypeError", "comm_state must have state_dict() and load_state_dict() (a PowerSGDState, LocalSGD, "
        "DiLoCo...), got int")
