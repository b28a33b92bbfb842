"""phalanx run's glibc malloc thresholds: memory a step frees is kept for the next step, where
glibc's defaults (torchrun's workers, ``--no-malloc-tuning``) give it back to the kernel and
fault it in again, page by page."""

from __future__ import annotations

import sys

import pytest

from tests.e2e.launch_helpers import SCRIPTS, base_env, phalanx_cmd, run

pytestmark = pytest.mark.slow  # three launches

SCRIPT = str(SCRIPTS / "step_faults.py")


def _faults_per_step(cmd: list[str], **env: str | None) -> int:
    res = run(cmd, base_env(MALLOC_MMAP_THRESHOLD_=None, MALLOC_TRIM_THRESHOLD_=None, **env))
    assert res.code == 0, res.err
    return int(res.out.split("faults/step ")[1].split()[0])


def test_a_step_s_freed_memory_is_kept_under_phalanx_run_and_faulted_in_again_elsewhere():
    # the MLP's step: about 10 000 faults (40 MB zero-filled) under glibc's defaults; tuned,
    # 0 on a quiet machine, about 200 (stray pages, not the step's memory) under a test suite's load
    tuned = _faults_per_step(phalanx_cmd("--standalone", SCRIPT))
    for cmd in (phalanx_cmd("--standalone", "--no-malloc-tuning", SCRIPT),
                [sys.executable, "-m", "torch.distributed.run", "--standalone", SCRIPT]):
        faults = _faults_per_step(cmd)
        assert faults > 1000 and tuned * 20 < faults, (cmd, faults, tuned)
