"""phalanx run and torchrun are interchangeable: same worker environment, same scripts."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from phalanx.launcher.environment import MALLOC_TUNING, usable_cpus
from tests.e2e.launch_helpers import BEHAVE, TRAIN, base_env, phalanx_cmd, run
from tests.harness import free_port

pytestmark = pytest.mark.slow  # torch scripts under both launchers

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _envs(record_dir) -> list[dict]:
    return [json.loads((record_dir / f"env.{r}.json").read_text()) for r in (0, 1)]


def _same_worker_environment(tmp_path, args: list[str], env: dict[str, str], port: str) -> None:
    """torchrun and phalanx run, each with ``args`` and ``env``, give their 2 workers the same
    environment."""
    ours, theirs = tmp_path / "phalanx", tmp_path / "torchrun"
    for launcher, record in ((TORCHRUN, theirs), (phalanx_cmd(), ours)):
        record.mkdir()
        res = run(launcher + args + [BEHAVE, "--record", str(record)], env)
        assert res.code == 0, res.err
    for rank, (mine, torchs) in enumerate(zip(_envs(ours), _envs(theirs))):
        differ = {k for k in mine.keys() | torchs.keys() if mine.get(k) != torchs.get(k)}
        # the only differences: where torch's per-worker error file lives (same layout),
        # PYTHONUNBUFFERED, which phalanx sets because it reads the workers' output from pipes,
        # PHALANX_RANK_PREFIX, which tells phalanx's logging the launcher prefixes lines, and
        # glibc's malloc thresholds (tests/e2e/test_launch_malloc.py)
        assert differ == {"TORCHELASTIC_ERROR_FILE", "PYTHONUNBUFFERED", "PHALANX_RANK_PREFIX",
                          *MALLOC_TUNING}, differ
        assert {k: mine[k] for k in MALLOC_TUNING} == MALLOC_TUNING
        suffix = os.path.join("attempt_0", str(rank), "error.json")
        assert mine["TORCHELASTIC_ERROR_FILE"].endswith(suffix)
        assert torchs["TORCHELASTIC_ERROR_FILE"].endswith(suffix)
        assert mine["PYTHONUNBUFFERED"] == "1"
        assert (mine["RANK"], mine["LOCAL_RANK"], mine["WORLD_SIZE"]) == (str(rank), str(rank), "2")
        assert (mine["MASTER_ADDR"], mine["MASTER_PORT"]) == ("127.0.0.1", port)
        assert mine["TORCHELASTIC_USE_AGENT_STORE"] == "True"


def test_worker_environment_equals_torchruns(tmp_path):
    port = str(free_port())
    args = ["--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", port, "--rdzv-id", "compat", "--max-restarts", "1"]
    # an explicit OMP_NUM_THREADS is passed through by both; PYTHONUNBUFFERED left unset
    env = base_env(OMP_NUM_THREADS="3", PYTHONUNBUFFERED=None)
    _same_worker_environment(tmp_path, args, env, port)


def test_options_from_torchruns_pet_variables_as_torchrun_reads_them(tmp_path):
    # Kubernetes' training operator sets these instead of passing options; a command-line
    # option wins over its variable (--max-restarts 1 over PET_MAX_RESTARTS=5)
    port = str(free_port())
    env = base_env(PET_NNODES="1", PET_NPROC_PER_NODE="2", PET_MASTER_ADDR="127.0.0.1",
                   PET_MASTER_PORT=port, PET_RDZV_ID="compat", PET_MAX_RESTARTS="5",
                   OMP_NUM_THREADS="3", PYTHONUNBUFFERED=None)
    _same_worker_environment(tmp_path, ["--max-restarts", "1"], env, port)
    mine = _envs(tmp_path / "phalanx")[0]
    assert (mine["TORCHELASTIC_RUN_ID"], mine["TORCHELASTIC_MAX_RESTARTS"]) == ("compat", "1")


def test_every_pet_variable_of_torchrun_is_read_or_refused():
    from torch.distributed.argparse_util import check_env, env
    from torch.distributed.run import get_args_parser

    from phalanx.cli import build_parser, torchrun_env

    theirs = {a.dest: isinstance(a, check_env) for a in get_args_parser()._actions
              if isinstance(a, (env, check_env))}
    ours = {**{d: False for d in torchrun_env.VALUES}, **{d: True for d in torchrun_env.FLAGS},
            **torchrun_env.REFUSED}
    assert ours == theirs  # same options, the same flags among them
    run_parser = build_parser()._subparsers._group_actions[0].choices["run"]
    types = {a.dest: a.type for a in run_parser._actions}
    for dest, kind in torchrun_env.VALUES.items():  # read as phalanx run reads the option
        assert types[dest] in (kind, None if kind is str else kind), dest
    assert set(torchrun_env.FLAGS) <= set(types)


def test_omp_num_threads_defaults_to_cores_per_worker(tmp_path):
    res = run(phalanx_cmd("--standalone", BEHAVE, "--record", str(tmp_path)),
              base_env(OMP_NUM_THREADS=None))
    assert res.code == 0, res.err
    env = json.loads((tmp_path / "env.0.json").read_text())
    assert env["OMP_NUM_THREADS"] == str(usable_cpus())  # one worker: all its cores


def _local_training(steps: int = 5, world: int = 2) -> dict:
    """train_tiny.py on one process, on the concatenation of every rank's batch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        xs, ys = [], []
        for rank in range(world):
            g = torch.Generator().manual_seed(1000 * step + rank)
            xs.append(torch.randn(4, 8, generator=g))
            ys.append(torch.randn(4, 1, generator=g))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return model.state_dict()


def _assert_close(saved: dict, expected: dict) -> None:
    assert saved["state"].keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(saved["state"][name], value, rtol=0, atol=1e-6)


def test_torch_ddp_script_runs_and_restarts_under_phalanx(tmp_path):
    # Plain torch.distributed + torch DDP, rank 1 dying after a step of the first attempt:
    # the restarted group must meet in a fresh store (torchrun's restart reuses its store and
    # the new Gloo group can dial the dead attempt's addresses).
    out, listeners = tmp_path / "params.pt", tmp_path / "listeners"
    res = run(phalanx_cmd("--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                          TRAIN, "--ddp", "torch", "--fail-once-rank", "1", "--out", str(out),
                          "--listeners", str(listeners)))
    assert res.code == 0, res.err
    assert "attempt 1 of 2 failed: rank 1" in res.err and "succeeded on attempt 2" in res.err
    saved = torch.load(out)
    assert saved["attempt"] == 1 and saved["world"] == 2
    _assert_close(saved, _local_training())
    # --standalone: the launcher's store helper (its door, the store) listens on loopback only
    found = json.loads((tmp_path / "listeners.launcher.rank0").read_text())
    assert found and set(found) == {"127.0.0.1"}, found


def test_phalanx_script_runs_under_torchrun(tmp_path):
    out = tmp_path / "params.pt"
    res = run(TORCHRUN + ["--standalone", "--nproc-per-node", "2", TRAIN, "--ddp", "phalanx",
                          "--out", str(out)])
    assert res.code == 0, res.err
    _assert_close(torch.load(out), _local_training())
