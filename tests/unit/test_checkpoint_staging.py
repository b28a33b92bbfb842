"""Background saves: the parameters and optimizer state are copied to host memory on the
writer's thread while training goes on, every optimizer's step() waiting for that copy; the
buffers (which a forward pass may change) at once. Each checkpoint holds the state at its own
save, bit for bit; a change the step hook cannot hold back fails the save, loudly."""

import os
import threading

import pytest
import torch

from phalanx.checkpoint import Checkpointer, dcp_engine
from phalanx.checkpoint.dcp_engine import stage
from phalanx.errors import CheckpointError


def test_stage_reuses_the_buffers_that_fit():
    first = {"a": torch.arange(6.0).reshape(2, 3), "b": {"c": torch.ones(4, dtype=torch.int64)}}
    staged = stage(first)
    again = stage({"a": first["a"] * 2, "b": {"c": torch.zeros(5, dtype=torch.int64)}}, staged)
    assert again["a"].data_ptr() == staged["a"].data_ptr() and again["a"].tolist() == [[0, 2, 4], [6, 8, 10]]
    assert again["b"]["c"].tolist() == [0] * 5  # another shape: a new buffer
    t = torch.arange(6.0).reshape(2, 3).t()  # other strides: a new buffer, the same values
    assert stage(t, staged["a"]).tolist() == t.tolist()


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 32)
        self.register_buffer("seen", torch.zeros(32))

    def forward(self, x):
        out = self.lin(x)
        with torch.no_grad():
            self.seen.add_(out.mean(0))  # a buffer a forward pass changes
        return out


def _snapshot(model, opt):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {k: v.clone() for s in opt.state.values() for k, v in s.items()})


def _train_step(model, opt, seed):
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _loaded(directory, step):
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    Checkpointer(directory, model, opt, format="sharded").load(directory / f"ckpt-{step:012d}.dcp")
    return _snapshot(model, opt)


def _equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a[0].values(), b[0].values())) and \
        a[0].keys() == b[0].keys() and all(torch.equal(x, y) for x, y in zip(a[1].values(), b[1].values()))


@pytest.fixture
def held(monkeypatch):
    """The writer's copy of the parameters and optimizer state held back until released."""
    release = threading.Event()
    copy = dcp_engine.DeferredStaging._copy

    def held_copy(self):
        assert release.wait(30), "the test never released the staging"
        copy(self)
    monkeypatch.setattr(dcp_engine.DeferredStaging, "_copy", held_copy)
    return release


def test_consecutive_background_saves_each_hold_their_state(tmp_path):
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train_step(model, opt, 0)
    ckpt = Checkpointer(tmp_path, model, opt, format="sharded", keep=None)
    expected = {}
    for step in (1, 2, 3):
        expected[step] = _snapshot(model, opt)
        ckpt.save(0, step, blocking=False)
        _train_step(model, opt, step)  # training goes on: the copies must not see it
    ckpt.close()
    for step, state in expected.items():
        assert _equal(_loaded(tmp_path, step), state), step
    assert not _equal(_loaded(tmp_path, 3), _snapshot(model, opt))


def test_the_step_waits_for_the_staging(tmp_path, held):
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train_step(model, opt, 0)
    ckpt = Checkpointer(tmp_path, model, opt, format="sharded")
    before = _snapshot(model, opt)
    ckpt.save(0, 1, blocking=False)  # returns with the parameters' copy still to be made
    x = torch.randn(8, 64)
    model(x).square().mean().backward()  # the forward changes the buffer: copied already
    stepping = threading.Thread(target=opt.step)
    stepping.start()
    stepping.join(0.5)
    assert stepping.is_alive(), "optimizer.step() did not wait for the staging"
    held.set()
    stepping.join(30)
    assert not stepping.is_alive()
    ckpt.wait()
    assert _equal(_loaded(tmp_path, 1), before)
    assert not torch.equal(model.lin.weight, before[0]["lin.weight"])  # the step did happen
    # another optimizer's step waits too, and one with nothing in flight does not
    ckpt.save(0, 2, blocking=False)
    other = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1.0)
    stepping = threading.Thread(target=other.step)
    stepping.start()
    stepping.join(30)
    assert not stepping.is_alive()  # (held was set: the staging was done at once)
    ckpt.close()
    opt.step()  # the hook is gone with close()


def test_a_change_the_step_hook_cannot_hold_back_fails_the_save(tmp_path, held):
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _train_step(model, opt, 0)
    ckpt = Checkpointer(tmp_path, model, opt, format="sharded", keep=None)
    ckpt.save(0, 1)
    kept = {n: (tmp_path / "ckpt-000000000001.dcp" / n).read_bytes()
            for n in os.listdir(tmp_path / "ckpt-000000000001.dcp")}
    ckpt.save(0, 2, blocking=False)
    with torch.no_grad():
        model.lin.weight.add_(1.0)  # in place, not through an optimizer
    held.set()
    with pytest.raises(CheckpointError, match=r"lin\.weight changed between save\(blocking=False\) and its copy"):
        ckpt.wait()
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000000000001.dcp"]  # nothing partial, the previous kept
    assert {n: (tmp_path / "ckpt-000000000001.dcp" / n).read_bytes() for n in kept} == kept
    ckpt.save(0, 3, blocking=False)  # the next save plans anew and succeeds
    state = _snapshot(model, opt)
    ckpt.close()
    assert _equal(_loaded(tmp_path, 3), state)


def test_the_optimizer_state_is_torch_s_with_the_names_found_once(tmp_path):
    """ShardedIO._optimizer_state: get_optimizer_state_dict's result (same keys, groups and
    tensor objects), its parameter names reused while the parameters are the same objects."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from phalanx.checkpoint.dcp_checkpoint import _same_tree

    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.5}])
    io = Checkpointer(tmp_path, model, opt, format="sharded")._sharded

    def ours():
        return io._optimizer_state(model, opt, list(model.parameters()))

    assert _same_tree(ours(), get_optimizer_state_dict(model, opt))  # no state yet
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    names = io._optimizer_info[2]
    assert names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    opt.param_groups[1]["lr"] = 0.25  # a scheduler's change shows at once
    assert _same_tree(ours(), get_optimizer_state_dict(model, opt))
    assert io._optimizer_info[2] is names  # (found once)
    model[2].weight = torch.nn.Parameter(model[2].weight.detach().clone())  # another object
    opt.param_groups[1]["params"][0] = model[2].weight
    opt.state[model[2].weight] = opt.state.pop(next(p for p in list(opt.state) if p.shape == (2, 4)))
    assert _same_tree(ours(), get_optimizer_state_dict(model, opt))
    assert io._optimizer_info[2] is not names


class _Feedback:
    """A comm_state whose tensor a backward changes in place (as PowerSGD's error feedback)."""

    def __init__(self):
        self.error = torch.zeros(4)

    def state_dict(self):
        return {"error": self.error}

    def load_state_dict(self, state):
        self.error = state["error"].clone()


def test_the_comm_state_is_taken_at_the_call(tmp_path, held):
    model = _Net()
    feedback = _Feedback()
    ckpt = Checkpointer(tmp_path, model, format="sharded", comm_state=feedback)
    feedback.error.fill_(1.0)
    ckpt.save(0, 1, blocking=False)
    feedback.error.add_(5.0)  # the next backward, before the writer's thread gathers it
    held.set()
    ckpt.close()
    again = _Feedback()
    Checkpointer(tmp_path, _Net(), format="sharded", comm_state=again).load()
    assert again.error.tolist() == [1.0] * 4
