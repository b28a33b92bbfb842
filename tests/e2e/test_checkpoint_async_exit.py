"""The end of a job waits for a checkpoint still being written in the background: a script
that saves with ``blocking=False`` and ends at once (destroying its process group, or not,
or with none) leaves a committed checkpoint, and no process group outlives the script (Gloo's
threads then abort the process at exit: "terminate called without an active exception")."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import phalanx

pytestmark = pytest.mark.slow  # four launches of real processes

SCRIPT = Path(__file__).resolve().parent / "scripts" / "ckpt_async_exit.py"
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")


@pytest.mark.parametrize("mode", ["destroy", "exit", "torch-exit", "alone"])
def test_script_ending_at_once_leaves_a_committed_checkpoint(tmp_path, mode):
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    launch = [] if mode == "alone" else ["-m", "phalanx", "run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.run([sys.executable, *launch, str(SCRIPT), str(tmp_path), mode], env=env,
                          text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=180)
    assert proc.returncode == 0, proc.stdout
    assert os.listdir(tmp_path) == ["ckpt-000000000007.dcp"], (os.listdir(tmp_path), proc.stdout)
    model = torch.nn.Linear(256, 256)
    state = phalanx.Checkpointer(tmp_path, model).load()
    world = 1 if mode == "alone" else 2
    assert (state.step, state.world_size, state.extra) == (7, world, {"mode": mode})
    assert model.weight.eq(world + 0.5).all()
    assert proc.stdout.count("group alive at exit: False") == world, proc.stdout
    assert "ERROR" not in proc.stdout and "Traceback" not in proc.stdout, proc.stdout
