"""Checkpointer in one process: contents, exact restore, errors, resume="auto"."""

import logging
import random

import numpy as np
import pytest
import torch

import phalanx
from phalanx.checkpoint import Checkpointer, read_checkpoint
from phalanx.checkpoint.file import checkpoint_name, list_checkpoints
from phalanx.checkpoint.state import check_loadable


@pytest.fixture
def phalanx_log():
    """The messages phalanx logs during the test."""
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("phalanx")
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


def _training_objects(width=8, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Dropout(0.5),
                                torch.nn.Linear(width, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    sampler = phalanx.DistributedSampler(range(40), num_replicas=1, rank=0, seed=3)
    return model, optimizer, scheduler, scaler, sampler


def _train(model, optimizer, scheduler, steps):
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(5, 4)).pow(2).sum().backward()
        optimizer.step()
        scheduler.step()


def _random_draws():
    return torch.rand(4).tolist(), random.random(), float(np.random.rand())


def test_save_load_restores_everything_exactly(tmp_path):
    model, opt, sched, scaler, sampler = _training_objects()
    _train(model, opt, sched, 3)
    sampler.set_epoch(2)
    it = iter(sampler)
    [next(it) for _ in range(11)]
    ckpt = Checkpointer(tmp_path, torch.nn.DataParallel(model), opt, scheduler=sched,
                        scaler=scaler, sampler=sampler)
    path = ckpt.save(2, 3, extra={"best": 0.5, "history": [1, 2], "t": torch.ones(2)})
    expected_draws = _random_draws()
    _train(model, opt, sched, 1)  # the "future" the restored run must reproduce
    expected_params = [p.detach().clone() for p in model.parameters()]

    saved = read_checkpoint(path)
    assert sorted(saved) == sorted(["version", "epoch", "step", "world_size", "model", "rng",
                                    "extra", "optimizer", "scheduler", "scaler", "sampler"])
    assert all(not k.startswith("module.") for k in saved["model"])  # DataParallel unwrapped
    assert saved["sampler"]["position"] == 11 and saved["world_size"] == 1
    assert sorted(saved["rng"][0]) == ["numpy", "python", "torch"]

    model2, opt2, sched2, scaler2, sampler2 = _training_objects(seed=1)
    state = Checkpointer(tmp_path, model2, opt2, scheduler=sched2, scaler=scaler2,
                         sampler=sampler2).load()
    assert (state.epoch, state.step, state.path, state.world_size) == (2, 3, path, 1)
    assert state.extra["best"] == 0.5 and state.extra["history"] == [1, 2]
    assert _random_draws() == expected_draws
    _train(model2, opt2, sched2, 1)
    assert all(torch.equal(a, b) for a, b in zip(model2.parameters(), expected_params))
    assert sched2.state_dict() == sched.state_dict()
    assert scaler2.get_scale() == 256.0
    sampler2.set_epoch(2)
    assert list(sampler2) == list(it)


def test_resume_auto_fresh_newest_and_damaged_newest(tmp_path, phalanx_log):
    model = torch.nn.Linear(3, 3)
    ckpt = Checkpointer(tmp_path / "run", model, keep=2)
    assert ckpt.load() is None
    assert phalanx_log == [f"no checkpoint in {tmp_path / 'run'}: starting fresh"]
    for step in (10, 20, 30):
        with torch.no_grad():
            model.weight.fill_(step)
        ckpt.save(0, step)
    assert [p.name for p in ckpt.checkpoints()] == [checkpoint_name(20), checkpoint_name(30)]
    assert ckpt.load().step == 30 and model.weight[0, 0].item() == 30
    newest = ckpt.checkpoints()[-1]
    raw = bytearray(newest.read_bytes())
    raw[-3] ^= 1
    newest.write_bytes(bytes(raw))
    state = ckpt.load()
    assert state.step == 20 and model.weight[0, 0].item() == 20
    assert f"skipping checkpoint: Checkpoint {newest} is corrupt" in phalanx_log[-1]
    aside = newest.with_name(newest.name + ".damaged")
    assert phalanx_log[-1].endswith(f"kept aside as {aside.name}") and aside.exists()
    assert [p.name for p in ckpt.checkpoints()] == [checkpoint_name(20)]
    with pytest.raises(phalanx.CheckpointError, match=f"Checkpoint {aside} is corrupt"):
        ckpt.load(aside)  # named explicitly: refused, no fallback
    ckpt.save(0, 21)  # training goes on from step 20: its saves are kept
    assert [p.name for p in ckpt.checkpoints()] == [checkpoint_name(20), checkpoint_name(21)]
    ckpt.checkpoints()[1].write_bytes(b"")
    ckpt.checkpoints()[0].write_bytes(b"")
    with pytest.raises(phalanx.CheckpointError, match="No usable checkpoint in .*is empty"):
        ckpt.load()


def test_mismatched_model_optimizer_and_missing_state_are_named(tmp_path):
    model, opt, sched, _, _ = _training_objects()
    _train(model, opt, sched, 1)
    path = Checkpointer(tmp_path, model, opt).save(0, 1)
    wider, wider_opt, _, _, _ = _training_objects(width=9)
    with pytest.raises(phalanx.CheckpointError) as info:
        Checkpointer(tmp_path, wider, wider_opt).load()
    assert str(info.value) == (f"Checkpoint {path} does not fit the model: '0.weight' has shape "
                               "(8, 4) in the checkpoint and (9, 4) in the model")
    bigger = _training_objects()[0]
    bigger.extra = torch.nn.Linear(1, 1, bias=False)
    missing = r"fit the model: 1 missing key\(s\) \['extra.weight'\]$"
    with pytest.raises(phalanx.CheckpointError, match=missing):
        Checkpointer(tmp_path, bigger).load()
    with pytest.raises(phalanx.CheckpointError, match="holds no scheduler state, but a scheduler"):
        Checkpointer(tmp_path, model, scheduler=sched).load()
    other, _, _, _, _ = _training_objects()
    one_group = torch.optim.SGD([other[0].weight], lr=0.1)
    with pytest.raises(phalanx.CheckpointError, match="its optimizer state does not fit"):
        Checkpointer(tmp_path, other, one_group).load()


def test_saving_below_a_later_checkpoint_is_refused(tmp_path):
    model = torch.nn.Linear(2, 2)
    Checkpointer(tmp_path, model).save(0, 50)  # an earlier run got further
    with pytest.raises(phalanx.CheckpointError) as info:
        Checkpointer(tmp_path, model).save(0, 3)
    assert str(info.value) == (
        f"Cannot save step 3 in {tmp_path}: it already holds {checkpoint_name(50)}, a later step "
        "(another run?). Use a new directory or remove the old checkpoints")
    assert [p.name for p in list_checkpoints(tmp_path)] == [checkpoint_name(50)]


def test_bad_arguments_and_unloadable_extras(tmp_path):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got dict"):
        Checkpointer(tmp_path, {})
    with pytest.raises(ValueError, match="Invalid keep 0, expected a positive integer or None"):
        Checkpointer(tmp_path, model, keep=0)
    ckpt = Checkpointer(tmp_path, model)
    with pytest.raises(ValueError, match="Invalid step -1, expected a non-negative integer"):
        ckpt.save(0, -1)
    with pytest.raises(TypeError, match="extra must be a dict or None, got list"):
        ckpt.save(0, 1, extra=[1])
    with pytest.raises(TypeError) as info:
        ckpt.save(0, 1, extra={"cfg": {"fn": len}})
    assert str(info.value).startswith(
        "Cannot checkpoint extra['cfg']['fn']: it is a builtins.builtin_function_or_method")
    assert ckpt.checkpoints() == []
    with pytest.raises(TypeError, match="resume must be 'auto' or a path, got int"):
        ckpt.load(3)


def test_check_loadable_accepts_what_weights_only_rebuilds():
    from collections import OrderedDict, namedtuple

    check_loadable({"a": [1, 2.0, None, True, "s", b"b", (1, 2), {3}], 1: torch.float16,
                    "d": OrderedDict(x=torch.device("cpu")), "size": torch.Size([2]),
                    "t": torch.nn.Parameter(torch.ones(1)), "c": 1 + 2j}, "state")
    Point = namedtuple("Point", "x y")
    with pytest.raises(TypeError, match=r"Cannot checkpoint state\['p'\]: it is a .*Point"):
        check_loadable({"p": Point(1, 2)}, "state")
    with pytest.raises(TypeError, match=r"state \(key frozenset"):
        check_loadable({frozenset(): 1}, "state")
