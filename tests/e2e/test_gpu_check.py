"""The prepared GPU check without a GPU: tools/gpu_check.sh refuses (exit 2, saying why, with
its report written), and benchmarks/bench_gpu.py's --smoke mode runs on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OUT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env["PYTHON"] = sys.executable
    return env


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_check_refuses_to_run_without_cuda(tmp_path):
    done = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), str(tmp_path)], env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT: REFUSED: CUDA is not available (torch "), last
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["exit_status"] == 2 and report["parts"] == [] and report["preflight"]["gpus"] == 0
    assert (tmp_path / "gpu_check.txt").read_text().strip().splitlines()[-1] == last


def test_gpu_check_needs_an_output_directory():
    done = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh")], env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "no output directory" in done.stderr


def test_gpu_benchmark_smoke_on_the_cpu(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--smoke", "--setups",
                           "gloo2", "--out", str(tmp_path)], env=_env(), capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "gloo2-eager.json").read_text())
    assert (result["world_size"], result["backend"], result["device"]) == (2, "gloo", "cpu")
    assert len(result["times_s"]["phalanx"]) == len(result["times_s"]["torch"]) == 3
    assert result["paired_ratio"] > 0 and result["phalanx_buckets"] >= 1 and result["torch_reducer"]
    assert "| gloo2 | eager | gloo, 2 |" in done.stdout
