"""The README's main job: examples/train_digits.py under phalanx run, rerun (resume), torchrun."""

from __future__ import annotations

import json
import re
import sys

import pytest

from tests.e2e.launch_helpers import ROOT, base_env, finish, phalanx_cmd, start

EXAMPLE = str(ROOT / "examples" / "train_digits.py")
_FINAL = re.compile(r"final test accuracy (\d+\.\d+)% on 359 samples \((\d) processes\)")

pytest.importorskip("sklearn", reason="the example needs the [examples] extra")


def _final_accuracy(output: str, world: int) -> float:
    match = _FINAL.search(output)
    assert match, f"no final accuracy line in:\n{output[-3000:]}"
    assert int(match.group(2)) == world
    return float(match.group(1))


def test_quick_start_trains_saves_plots_and_resumes(tmp_path):
    out = tmp_path / "digits"
    args = ["--standalone", "--nproc-per-node", "2", EXAMPLE, "--out", str(out)]
    first = finish(start(phalanx_cmd(*args, "--epochs", "3")), timeout=240)
    assert first.code == 0, first.err[-3000:]
    assert first.seconds < 60  # the README promises 10 epochs in under 60 s on 2 cores
    accuracy = _final_accuracy(first.err + first.out, world=2)
    assert accuracy >= 97.0
    assert "epoch 3: train loss" in first.err + first.out
    assert "samples_s=" in first.err and "loss=" in first.err  # rank 0's progress bar
    # one rank prefix per line: the launcher's, not a second one from phalanx's logging
    assert "[rank0]: phalanx.checkpoint: saved" in first.err and "[rank0]: [rank0]" not in first.err
    assert sorted(p.name for p in out.glob("ckpt-*.ckpt")) == [
        "ckpt-000000000046.ckpt", "ckpt-000000000069.ckpt"]  # 23 steps an epoch, keep=2
    png = (out / "curves.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and [h["epoch"] for h in metrics["history"]] == [1, 2, 3]
    assert abs(100 * metrics["test_accuracy"] - accuracy) < 0.01

    again = finish(start(phalanx_cmd(*args, "--epochs", "4")), timeout=240)
    assert again.code == 0, again.err[-3000:]
    output = again.err + again.out
    assert "resumed from ckpt-000000000069.ckpt: epoch 3, step 69" in output
    assert "epoch 4: train loss" in output and "epoch 3: train loss" not in output  # only epoch 4
    assert _final_accuracy(output, world=2) >= 97.0
    metrics = json.loads((out / "metrics.json").read_text())
    assert [h["epoch"] for h in metrics["history"]] == [1, 2, 3, 4]  # history carried over
    assert sorted(p.name for p in out.glob("ckpt-*.ckpt")) == [
        "ckpt-000000000069.ckpt", "ckpt-000000000092.ckpt"]


def test_example_runs_unchanged_under_torchrun(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = finish(start([*torchrun, EXAMPLE, "--epochs", "1", "--out", str(tmp_path)],
                        env=base_env()), timeout=240)
    assert done.code == 0, done.err[-3000:]
    assert _final_accuracy(done.err + done.out, world=2) > 80.0
    assert (tmp_path / "curves.png").exists() and (tmp_path / "ckpt-000000000023.ckpt").exists()
