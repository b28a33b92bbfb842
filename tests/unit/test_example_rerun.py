"""examples/train_digits.py's rerun of a finished run: said before torch is imported, only when
metrics.json names the newest checkpoint and every rank is on this machine (issue 25 item 10)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.e2e.launch_helpers import ROOT


@pytest.fixture(scope="module")
def digits():
    spec = importlib.util.spec_from_file_location("train_digits", ROOT / "examples" / "train_digits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def finished(tmp_path, monkeypatch):
    """--out of a run that trained 3 epochs and ended with step 69's checkpoint; no launcher."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    for step in (46, 69):
        (tmp_path / f"ckpt-{step:012d}.ckpt").write_bytes(b"")
    (tmp_path / "metrics.json").write_text(json.dumps(
        {"checkpoint": "ckpt-000000000069.ckpt", "history": [{"epoch": e} for e in (1, 2, 3)]}))
    return tmp_path


def _args(digits, out, *more):
    return digits.parse_args(["--out", str(out), *more])


def test_a_finished_run_is_recognised_from_its_files(digits, finished):
    assert digits.finished_before(_args(digits, finished, "--epochs", "3")) == (
        "already trained 3 of 3 epochs; pass --epochs N to train on or --fresh to start over")
    assert digits.finished_before(_args(digits, finished, "--epochs", "2")).startswith(
        "already trained 3 (more than --epochs 2) epochs")


def test_anything_else_goes_the_way_of_the_checkpoint(digits, finished, monkeypatch):
    assert digits.finished_before(_args(digits, finished, "--epochs", "4")) is None  # train on
    assert digits.finished_before(_args(digits, finished, "--epochs", "3", "--fresh")) is None
    (finished / "ckpt-000000000080.ckpt").write_bytes(b"")  # a later run, stopped mid-epoch
    assert digits.finished_before(_args(digits, finished, "--epochs", "3")) is None
    (finished / "ckpt-000000000080.ckpt").unlink()
    monkeypatch.setenv("RANK", "0")  # 4 ranks on 2 machines: the others may not see --out
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert digits.finished_before(_args(digits, finished, "--epochs", "3")) is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # all 4 here
    assert digits.finished_before(_args(digits, finished, "--epochs", "3")) is not None
    (finished / "metrics.json").write_text(json.dumps({"history": [{"epoch": 3}]}))  # older run
    assert digits.finished_before(_args(digits, finished, "--epochs", "3")) is None
    (finished / "metrics.json").write_text("{")  # cut short
    assert digits.finished_before(_args(digits, finished, "--epochs", "3")) is None
