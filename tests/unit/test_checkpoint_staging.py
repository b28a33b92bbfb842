"""Background saves stage into the previous save's host-memory copy: the buffers are reused
(no new memory) and each checkpoint holds the state at its own save, bit for bit."""

import torch

from phalanx.checkpoint import Checkpointer
from phalanx.checkpoint.dcp_engine import stage


def test_stage_reuses_the_buffers_that_fit():
    first = {"a": torch.arange(6.0).reshape(2, 3), "b": {"c": torch.ones(4, dtype=torch.int64)}}
    staged = stage(first)
    again = stage({"a": first["a"] * 2, "b": {"c": torch.zeros(5, dtype=torch.int64)}}, staged)
    assert again["a"].data_ptr() == staged["a"].data_ptr() and again["a"].tolist() == [[0, 2, 4], [6, 8, 10]]
    assert again["b"]["c"].tolist() == [0] * 5  # another shape: a new buffer
    t = torch.arange(6.0).reshape(2, 3).t()  # other strides: a new buffer, the same values
    assert stage(t, staged["a"]).tolist() == t.tolist()


def test_consecutive_background_saves_each_hold_their_state(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    ckpt = Checkpointer(tmp_path, model, format="sharded", keep=None)
    expected = {}
    for step in (1, 2, 3):
        with torch.no_grad():
            model.weight.add_(1.0)
        expected[step] = model.weight.detach().clone()
        ckpt.save(0, step, blocking=False)
        with torch.no_grad():  # training goes on: the staged copy must not see it
            model.weight.mul_(-1.0)
    ckpt.close()
    for step, weight in expected.items():
        fresh = torch.nn.Linear(64, 32)
        Checkpointer(tmp_path, fresh, format="sharded").load(tmp_path / f"ckpt-{step:012d}.dcp")
        assert torch.equal(fresh.weight, weight), step
