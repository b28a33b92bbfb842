"""A torch script runs unchanged once its imports name phalanx: PyTorch's DDP tutorial, started
with torch.multiprocessing.spawn and no launcher."""

from __future__ import annotations

import re
import sys

import pytest

from tests.e2e.launch_helpers import SCRIPTS, base_env, run
from tests.harness import free_port

pytestmark = pytest.mark.slow  # torch's DDP tutorial, run whole with mp.spawn


def test_the_ddp_tutorial_runs_with_mp_spawn_and_phalanx_imports(tmp_path):
    done = run([sys.executable, str(SCRIPTS / "spawn_tutorial.py"), str(free_port()), str(tmp_path)],
               env=base_env(), timeout=180)
    assert done.code == 0, done.err[-3000:]
    for demo, title in (("basic", "basic DDP"), ("checkpoint", "DDP checkpoint")):
        sums = dict(re.findall(rf"{demo} rank (\d) checksum (-?\d+\.\d{{10}})", done.out))
        assert sorted(sums) == ["0", "1"], done.out
        assert sums["0"] == sums["1"], sums  # one step of DDP: the replicas agree
        assert f"Finished running {title} example on rank 1." in done.out
    assert not (tmp_path / "model.checkpoint").exists()  # rank 0 removed it after the barrier
