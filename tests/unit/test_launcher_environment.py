"""What the launcher puts in a worker's environment, and how it counts the usable cores."""

import os

import pytest

from phalanx.env import DistEnv, detect
from phalanx.launcher.environment import (
    cgroup_cpu_limit,
    default_omp_threads,
    resolve_nproc,
    usable_cpus,
    worker_environ,
)

TUNED = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "1073741824"}


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
    assert environ["PHALANX_RANK_PREFIX"] == "1"
    # --role and --no-rank-prefix
    other = worker_environ(_launched(), group_world_size=2, max_restarts=3, run_id="job",
                           error_file="/e.json", base={"PHALANX_RANK_PREFIX": "1"}, cpus=8,
                           role="trainer", rank_prefix=False)
    assert other["ROLE_NAME"] == "trainer" and "PHALANX_RANK_PREFIX" not in other


def test_glibc_malloc_is_tuned_unless_the_user_tuned_it_or_said_no():
    def malloc(base, **kwargs):
        environ = worker_environ(_launched(), group_world_size=2, max_restarts=0, run_id="job",
                                 error_file="/e.json", base=base, cpus=8, **kwargs)
        return {k: v for k, v in environ.items() if "MALLOC" in k}

    assert malloc({}) == TUNED
    assert malloc({}, tune_malloc=False) == {}  # phalanx run --no-malloc-tuning
    # one threshold set by the user turns glibc's dynamic ones off: the user chose, left alone
    assert malloc({"MALLOC_TRIM_THRESHOLD_": "0"}) == {"MALLOC_TRIM_THRESHOLD_": "0"}
    assert malloc({"MALLOC_TOP_PAD_": "1"}) == {"MALLOC_TOP_PAD_": "1"}
    tunables = {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}
    assert malloc(tunables) == {} and malloc({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}) == TUNED


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


def test_nproc_cpu_counts_what_the_omp_default_counts():
    assert resolve_nproc("cpu") == usable_cpus() == default_omp_threads(1)
    assert resolve_nproc("3") == 3
