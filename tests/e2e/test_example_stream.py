"""examples/train_gpt_stream.py under phalanx run: a Ctrl-C mid-epoch at 2 ranks x 2 workers,
resumed at 3 ranks x 3 workers; the interrupted epoch trains on every sample once in all."""

import json

import pytest

from tests.e2e.launch_helpers import ROOT, finish, phalanx_cmd, start

pytestmark = pytest.mark.slow  # two launches training a small transformer

EXAMPLE = str(ROOT / "examples" / "train_gpt_stream.py")
SAMPLES = 240  # divides by 2 ranks x 8 and by 3 ranks x 8: ends="drop" drops nothing


def test_ctrl_c_at_two_ranks_resumes_at_three(tmp_path):
    common = ["--data", str(tmp_path / "shards"), "--out", str(tmp_path / "ckpt"),
              "--samples", str(SAMPLES), "--save-every", "4"]
    first = finish(start(phalanx_cmd("--standalone", "--nproc-per-node", "2", EXAMPLE, *common,
                                     "--stop-at-step", "6", "--workers", "2")), timeout=240)
    assert first.code == 130, first.err[-3000:]  # Ctrl-C: saved, resumable
    second = finish(start(phalanx_cmd("--standalone", "--nproc-per-node", "3", EXAMPLE, *common,
                                      "--workers", "3")), timeout=240)
    assert second.code == 0, second.err[-3000:]
    assert "resumed at epoch 0, step 6, sample 96 of 240, now 3 ranks" in second.out + second.err
    history = json.loads((tmp_path / "ckpt" / "metrics.json").read_text())
    assert [(h["epoch"], h["samples"]) for h in history] == [(0, SAMPLES), (1, SAMPLES)]
    assert history[1]["loss"] < history[0]["loss"]
