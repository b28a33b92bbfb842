"""DistEnv discovery from launcher, torchrun and Slurm variables (no processes needed)."""


import pytest

from phalanx.env import (
    DistEnv,
    detect,
    first_host,
    tasks_on_node,
    torchrun_options,
    torchrun_variable,
)
from phalanx.errors import EnvironmentConfigError


def test_nothing_set_is_single_process():
    assert detect({}) == DistEnv()
    assert detect({}).world_size == 1 and not detect({}).is_distributed


def test_launcher_variables():
    env = detect(
        {
            "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
            "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
            "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_USE_AGENT_STORE": "True",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 4)
    assert (env.node_rank, env.master_addr, env.master_port) == (1, "10.0.0.1", 29500)
    assert env.restart_count == 2 and env.use_agent_store and env.source == "launcher"


def test_launcher_variables_win_over_slurm():
    env = detect({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1",
                  "SLURM_PROCID": "0", "SLURM_NTASKS": "4"})
    assert env.source == "launcher" and env.world_size == 2


def test_slurm_variables():
    env = detect(
        {
            "SLURM_PROCID": "6", "SLURM_NTASKS": "7", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
            "SLURM_TASKS_PER_NODE": "4,3", "SLURM_JOB_NODELIST": "gpu[007-009,012],cpu1",
            "SLURM_JOB_ID": "123456",
        }
    )
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (6, 7, 2, 3)
    assert env.master_addr == "gpu007" and env.node_rank == 1 and env.source == "slurm"
    assert env.master_port == 15000 + 123456 % 20000


def test_slurm_master_overrides():
    env = detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1",
                  "MASTER_ADDR": "head", "MASTER_PORT": "4242"})
    assert (env.master_addr, env.master_port) == ("head", 4242)


@pytest.mark.parametrize(
    "nodelist, first",
    [("n1", "n1"), ("n1,n2", "n1"), ("node[01-04]", "node01"), ("a[3,5-6]-ib,b1", "a3-ib"),
     ("gpu[007-009,012],cpu1", "gpu007")],
)
def test_first_host(nodelist, first):
    assert first_host(nodelist) == first


def test_tasks_on_node():
    assert [tasks_on_node("4(x2),3", n) for n in range(3)] == [4, 4, 3]
    with pytest.raises(EnvironmentConfigError, match=r"SLURM_NODEID=3 .* describes 3 node"):
        tasks_on_node("4(x2),3", 3)
    with pytest.raises(EnvironmentConfigError, match="Cannot parse SLURM_TASKS_PER_NODE"):
        tasks_on_node("four", 0)


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"},
         r"Invalid rank 2, rank should be in the interval \[0, 1\]"),
        ({"RANK": "-1", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"},
         r"Invalid rank -1"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, r"Invalid world size 0, expected a positive integer"),
        ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"},
         r"RANK='x' is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, r"MASTER_ADDR and MASTER_PORT not set"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "70000"},
         r"Invalid master port 70000"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2",
          "MASTER_ADDR": "a", "MASTER_PORT": "1"}, r"Invalid local rank 2"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "[bad"},
         r"Cannot parse Slurm node list"),
    ],
)
def test_bad_environment_is_named(environ, message):
    with pytest.raises(EnvironmentConfigError, match=message):
        detect(environ)


def test_errors_are_value_errors():
    with pytest.raises(ValueError):
        detect({"RANK": "3", "WORLD_SIZE": "1"})


def test_torchrun_options_are_read_from_pet_variables_as_torchrun_names_them():
    # torch/distributed/argparse_util.py: "PET_" + the option's dest upper-cased
    assert torchrun_variable("nproc_per_node") == "PET_NPROC_PER_NODE"
    environ = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_RDZV_CONF": "", "NNODES": "9",
               "PET_OTHER": "x"}
    assert torchrun_options(["nnodes", "node_rank", "rdzv_conf", "master_addr"], environ) == {
        "nnodes": "2", "node_rank": "1", "rdzv_conf": ""}  # set, even empty; nothing else
