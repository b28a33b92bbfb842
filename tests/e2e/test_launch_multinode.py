"""Two launchers, ``--nnodes 2``, training with phalanx DDP across 4 ranks.

The final parameters must equal, bit for bit, those of a 4-process single-node run: same
global ranks, same batches, same all-reduces. Once on loopback, once with the two nodes in
separate network namespaces joined by a veth pair (a real second interface: Gloo and the
stores must use the master address, and node 0's stores must listen on it alone).
"""

from __future__ import annotations

import signal

import pytest
import torch

from tests.e2e.launch_helpers import (
    BEHAVE,
    SECRET,
    TRAIN,
    base_env,
    finish,
    listening_addresses,
    node_env,
    phalanx_cmd,
    run,
    start,
    veth_namespaces,
    wait_for_files,
)
from tests.harness import free_port

pytestmark = pytest.mark.slow  # two launchers per test, most of them training with torch


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "ref.pt"
    res = run(phalanx_cmd("--standalone", "--nproc-per-node", "4", TRAIN, "--out", str(out)))
    assert res.code == 0, res.err
    return torch.load(out)


@pytest.fixture(scope="module")
def gloo_reference(tmp_path_factory):
    """The single-node run on Gloo: the reference of a job whose nodes are different hosts
    (network namespaces), which runs on Gloo. One host's default, shared memory, sums in rank
    order, bit-identical to Gloo's only at world 2 (docs/shared_memory.md)."""
    out = tmp_path_factory.mktemp("ref_gloo") / "ref.pt"
    res = run(phalanx_cmd("--standalone", "--nproc-per-node", "4", TRAIN, "--out", str(out)),
              base_env(PHALANX_SHARED_MEMORY="0"))
    assert res.code == 0, res.err
    return torch.load(out)


def _two_nodes(addr, port, nprocs, outs, wrap=(None, None), envs=(None, None)):
    """Start node 1 then node 0 (order must not matter); return both results."""
    procs = []
    for node in (1, 0):
        cmd = phalanx_cmd("--nnodes", "2", "--node-rank", str(node), "--master-addr", addr,
                          "--master-port", str(port), "--nproc-per-node", str(nprocs[node]),
                          "--rdzv-timeout", "120", TRAIN, *outs[node])
        procs.append(start((wrap[node] or []) + cmd, envs[node] or node_env()))
    return [finish(p, timeout=240) for p in reversed(procs)]


def _assert_same(result: dict, reference: dict) -> None:
    assert result["world"] == reference["world"] == 4
    assert result["state"].keys() == reference["state"].keys()
    for name, value in reference["state"].items():
        assert torch.equal(result["state"][name], value), name


def test_two_nodes_on_loopback_equal_one_node(tmp_path, reference):
    out = tmp_path / "params.pt"
    node0, node1 = _two_nodes("127.0.0.1", free_port(), (2, 2),
                              (["--out", str(out)], ["--out", str(tmp_path / "unused.pt")]))
    assert node0.code == 0 and node1.code == 0, node0.err + node1.err
    assert "[rank0]: rank 0/4" in node0.out and "[rank1]: rank 1/4" in node0.out
    assert "[rank2]: rank 2/4" in node1.out and "[rank3]: rank 3/4" in node1.out
    _assert_same(torch.load(out), reference)


@pytest.mark.netns
def test_two_nodes_in_network_namespaces_equal_one_node(tmp_path, gloo_reference):
    out, listeners = tmp_path / "params.pt", tmp_path / "listeners"
    with veth_namespaces() as nodes:
        (ns0, dev0, addr0), (ns1, dev1, addr1) = nodes
        # Gloo picks its interface from the hostname, which resolves to loopback here; on a
        # real cluster one sets GLOO_SOCKET_IFNAME (or NCCL_SOCKET_IFNAME) the same way.
        envs = (node_env(GLOO_SOCKET_IFNAME=dev0), node_env(GLOO_SOCKET_IFNAME=dev1))
        # node 0 runs 1 worker, node 1 runs 3: the nodes agree on rank offsets 0 and 1
        node0, node1 = _two_nodes(
            addr0, 29500, (1, 3),
            (["--out", str(out), "--listeners", str(listeners)],
             ["--out", str(tmp_path / "x"), "--listeners", str(listeners)]),
            wrap=(["ip", "netns", "exec", ns0], ["ip", "netns", "exec", ns1]), envs=envs,
        )
    assert node0.code == 0 and node1.code == 0, node0.err + node1.err
    assert "[rank0]: rank 0/4" in node0.out
    assert all(f"[rank{r}]: rank {r}/4" in node1.out for r in (1, 2, 3))
    _assert_same(torch.load(out), gloo_reference)
    # `ss -ltn` in each namespace while the job ran: no wildcard listener; node 0's gate on
    # the master address, Gloo on each node's own address, the rest on loopback
    for rank, addr in ((0, addr0), (1, addr1)):
        found = listening_addresses((tmp_path / f"listeners.rank{rank}").read_text())
        assert found and {a for a, _ in found} <= {addr, "127.0.0.1"}, found
    assert (addr0, 29500) in listening_addresses((tmp_path / "listeners.rank0").read_text())


def _behaving_nodes(tmp_path, *worker_args, opts=()):
    """Two one-worker nodes on loopback running the torch-free test worker; node 0 first."""
    port = str(free_port())
    return [start(phalanx_cmd("--nnodes", "2", "--node-rank", str(node), "--master-addr",
                              "127.0.0.1", "--master-port", port, *opts, BEHAVE,
                              "--record", str(tmp_path), *worker_args), node_env())
            for node in (0, 1)]


def test_a_failure_on_one_node_restarts_every_node(tmp_path):
    procs = _behaving_nodes(tmp_path, "--fail-rank", "1", "--only-first-attempt", "--sleep", "1",
                            opts=("--max-restarts", "1"))
    node0, node1 = [finish(p) for p in procs]
    assert node0.code == 0 and node1.code == 0, node0.err + node1.err
    assert sorted((tmp_path / "attempts.log").read_text().splitlines()) == [
        "attempt 0 rank 0", "attempt 0 rank 1", "attempt 1 rank 0", "attempt 1 rank 1"]
    for res in (node0, node1):  # both launchers name the same root cause
        assert ("attempt 1 of 2 failed: rank 1 (local rank 0) on node 1" in res.err
                and "(ValueError: boom from rank 1 on attempt 0)" in res.err)
        assert "succeeded on attempt 2" in res.err


def test_the_root_cause_on_one_node_is_reported_by_every_node(tmp_path):
    procs = _behaving_nodes(tmp_path, "--fail-rank", "1", "--fail-after", "0.5", "--sleep", "60")
    node0, node1 = [finish(p) for p in procs]
    assert node0.code == node1.code == 1, node0.err + node1.err
    for res in (node0, node1):
        assert "root cause: rank 1 (local rank 0) on node 1" in res.err
        assert "ValueError: boom from rank 1 on attempt 0" in res.err
    assert "workers on node 0: rank 0: signal SIGTERM" in node0.err  # stopped on node 0 too


def test_sigterm_to_one_launcher_stops_every_node(tmp_path):
    procs = _behaving_nodes(tmp_path, "--sleep", "60")
    wait_for_files([tmp_path / "pid.0", tmp_path / "pid.1"])
    procs[0].send_signal(signal.SIGTERM)
    node0, node1 = [finish(p, timeout=60) for p in procs]
    assert node0.code == node1.code == 128 + signal.SIGTERM, node0.err + node1.err
    for res in (node0, node1):
        assert "SIGTERM received by the launcher of node 0: stopped every worker" in res.err


def test_launchers_started_with_different_options_both_refuse(tmp_path):
    port = str(free_port())
    procs = [start(phalanx_cmd("--nnodes", "2", "--node-rank", str(node), "--master-addr",
                               "127.0.0.1", "--master-port", port, "--max-restarts", str(node),
                               BEHAVE, "--record", str(tmp_path)), node_env())
             for node in (0, 1)]
    for res in [finish(p, timeout=60) for p in procs]:
        assert res.code == 1, res.err
        assert "disagree on --max-restarts: node 0 has 0, node 1 has 1" in res.err
    assert not (tmp_path / "attempts.log").exists()  # no worker started anywhere


def test_a_node_rank_held_by_a_live_launcher_is_refused_a_replacement_is_let_in(tmp_path):
    """--nnodes 2 (fixed): a second launcher with node 1's rank is refused while node 1 runs,
    one with another secret too (exit 2); once node 1's launcher is killed, the same command
    again takes its place at the next round, with no restart used."""
    port, record = str(free_port()), tmp_path / "record"
    record.mkdir()
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    secret_file.chmod(0o600)

    def node(rank: int, env: dict | None = None):
        return start(phalanx_cmd("--nnodes", "2", "--node-rank", str(rank), "--master-addr",
                                 "127.0.0.1", "--master-port", port, "--rdzv-timeout", "60",
                                 "--job-secret-file", str(secret_file), BEHAVE, "--record",
                                 str(record), "--first-sleep", "60", "--on-sigterm-exit", "0"),
                     env or base_env())

    node0, node1 = node(0), node(1)
    wait_for_files([record / "pid.0", record / "pid.1"])
    twin = finish(node(1), timeout=60)
    assert twin.code == 1, twin.err
    assert f"Node rank 1 is already taken at 127.0.0.1:{port} by the launcher on" in twin.err
    stranger = finish(start(phalanx_cmd(
        "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", port,
        BEHAVE, "--record", str(record)), base_env(PHALANX_JOB_SECRET="not-this-jobs-secret-42")))
    assert stranger.code == 2, stranger.err
    assert (f"Node 1: node 0's launcher at 127.0.0.1:{port} refused this node's job secret"
            in stranger.err)
    node1.send_signal(signal.SIGKILL)
    finish(node1)
    replacement = finish(node(1), timeout=120)
    first = finish(node0, timeout=60)
    assert first.code == 0 and replacement.code == 0, first.err + replacement.err
    assert "left: the nodes meet again (no restart used)" in first.err
    assert "round 1: 2 node(s)" in first.err
    assert sorted((record / "attempts.log").read_text().splitlines()) == [
        "attempt 0 rank 0", "attempt 0 rank 1", "attempt 1 rank 0", "attempt 1 rank 1"]
