"""DistEnv discovery from launcher, torchrun and Slurm variables (no processes needed)."""

import os

import pytest

from phalanx.env import (
    DistEnv,
    cgroup_cpu_limit,
    default_omp_threads,
    detect,
    first_host,
    tasks_on_node,
    usable_cpus,
    worker_environ,
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


def _launched(rank=1, world=4, local_rank=1, local_world=2, node=0):
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank,
                   local_world_size=local_world, node_rank=node, master_addr="10.0.0.1",
                   master_port=29500, restart_count=2, use_agent_store=True, source="launcher")


def test_worker_environ_is_read_back_by_detect():
    for args in [(), (3, 4, 1, 2, 1), (0, 1, 0, 1, 0)]:
        dist_env = _launched(*args)
        environ = worker_environ(dist_env, group_world_size=2, max_restarts=3, run_id="job",
                                 error_file="/e.json", base={}, cpus=8)
        assert detect(environ) == dist_env


def test_worker_environ_uses_torchruns_names_and_keeps_the_users_settings():
    environ = worker_environ(_launched(), group_world_size=2, max_restarts=3, run_id="job",
                             error_file="/e.json", base={"PATH": "/bin", "RANK": "9"}, cpus=8)
    assert environ["PATH"] == "/bin" and environ["RANK"] == "1"  # launcher's values win
    assert {k: environ[k] for k in ("GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK",
                                    "ROLE_WORLD_SIZE", "TORCHELASTIC_MAX_RESTARTS",
                                    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
                                    "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                                    "TORCHELASTIC_SIGNALS_TO_HANDLE", "PYTHONUNBUFFERED")} == {
        "GROUP_WORLD_SIZE": "2", "ROLE_NAME": "default", "ROLE_RANK": "1", "ROLE_WORLD_SIZE": "4",
        "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RUN_ID": "job",
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_ERROR_FILE": "/e.json",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT", "PYTHONUNBUFFERED": "1",
    }
    assert environ["OMP_NUM_THREADS"] == "4"  # 8 cores, 2 local workers
    mine = worker_environ(_launched(), group_world_size=2, max_restarts=3, run_id="job",
                          error_file="/e.json", base={"OMP_NUM_THREADS": "7",
                                                      "PYTHONUNBUFFERED": "0"}, cpus=8)
    assert (mine["OMP_NUM_THREADS"], mine["PYTHONUNBUFFERED"]) == ("7", "0")


def test_default_omp_threads_shares_the_cores_at_least_one_each():
    assert [default_omp_threads(n, cpus=8) for n in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]
    assert default_omp_threads(1) == usable_cpus()
    limit = cgroup_cpu_limit()
    affinity = len(os.sched_getaffinity(0))
    assert usable_cpus() == (affinity if limit is None else min(affinity, limit))


def _cgroup(tmp_path, path, cpu_max):
    """A fake cgroup v2 tree: this process in cgroup ``path``; ``cpu_max`` per cgroup path."""
    membership = tmp_path / "cgroup"
    membership.write_text(f"12:cpu,cpuacct:/v1/ignored\n0::{path}\n")
    for where, text in cpu_max.items():
        folder = tmp_path / "fs" / where.strip("/")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "cpu.max").write_text(text + "\n")
    return str(tmp_path / "fs"), str(membership)


@pytest.mark.parametrize("path, cpu_max, cpus", [
    ("/", {"/": "200000 100000"}, 2),  # in a container: its own cgroup is the root
    ("/", {"/": "150000 100000"}, 2),  # 1.5 cores: rounded up
    ("/", {"/": "50000 100000"}, 1),  # half a core: at least one
    ("/", {"/": "max 100000"}, None),  # no quota
    ("/", {}, None),  # no cpu.max (a host's root cgroup has none)
    ("/a/b", {"/a/b": "max 100000", "/a": "300000 100000"}, 3),  # the parent's quota binds
    ("/a/b", {"/a/b": "100000 100000", "/a": "300000 100000"}, 1),  # the smallest wins
    ("/a/b", {"/": "garbage", "/a": "x 100000", "/a/b": "1 0"}, None),  # unreadable: ignored
])
def test_cgroup_cpu_limit_reads_cpu_max_up_the_tree(tmp_path, path, cpu_max, cpus):
    root, membership = _cgroup(tmp_path, path, cpu_max)
    assert cgroup_cpu_limit(root, membership) == cpus


def test_cgroup_cpu_limit_without_cgroup_v2(tmp_path):
    assert cgroup_cpu_limit(str(tmp_path / "none"), str(tmp_path / "none")) is None
