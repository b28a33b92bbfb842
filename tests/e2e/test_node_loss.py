"""Launchers of several nodes on loopback that fail, or finish, or leave: each ends in time and
with the right status (issue 23's two failures found in the same paths); and the store's
host lost, on loopback (the network cases, cut links included, are in test_store_moves.py)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest

from tests.e2e.launch_helpers import (
    BEHAVE,
    alive,
    finish,
    node_env,
    phalanx_cmd,
    start,
    wait_for_files,
)
from tests.harness import free_port

pytestmark = pytest.mark.slow  # real launchers waiting out timeouts

# A launcher that ends is done within its deadline plus this: its own start (Python, the store
# helper importing torch) on a loaded 2-core machine, and its exit.
SLACK_S = 6.0
# A launcher that gives up waiting for a node is done within --rdzv-timeout plus this, loaded
# or not: the deadline counts from the launcher's start (its Python, the store helper and the
# client importing torch: seconds of it on a loaded machine), so only what follows is extra:
# one look at the board, and the exit (issue 34 item 6: it was 3.4 to 7 s over on a loaded
# machine; torchrun's is 2.2 s idle).
GIVE_UP_SLACK_S = 2.0


@pytest.fixture
def busy_cpus():
    """Two processes spinning for the test's length: the machine loaded, as a user's is."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    yield
    for spinner in spinners:
        spinner.kill()
        spinner.wait()


def test_a_node_missing_ends_the_launcher_within_the_rdzv_timeout(tmp_path, busy_cpus):
    """--nnodes 2 --rdzv-timeout 5, node 1 never started: node 0 says so and exits 1 within
    5 s plus the slack on a loaded machine (not 5 s plus --shutdown-timeout: no workers were
    running, nor 5 s after the launcher's own start: the 5 s count from that start)."""
    res = finish(start(phalanx_cmd("--nnodes", "2", "--node-rank", "0", "--master-addr",
                                   "127.0.0.1", "--master-port", str(free_port()),
                                   "--rdzv-timeout", "5", BEHAVE, "--record", str(tmp_path)),
                       node_env()), timeout=60)
    assert res.code == 1, res.err
    assert "Only 1 of the 2 node(s) needed (--nnodes 2) were ready after " in res.err, res.err
    # so loaded that the launcher's own start outlasts the 5 s: it says so, and goes at once
    late_start = re.search(r"this launcher was ready only ([0-9.]+) s after its start", res.err)
    began_waiting = float(late_start[1]) if late_start else 0.0
    assert res.seconds < max(5.0, began_waiting) + GIVE_UP_SLACK_S, res.err
    assert not (tmp_path / "attempts.log").exists()  # no worker ever started


@pytest.mark.parametrize("leaving", [1, 0], ids=["node1-leaves", "node0-leaves"])
def test_a_node_done_then_gone_is_not_lost(tmp_path, leaving):
    """The leaving node's worker exits 0 at once, then its launcher is SIGKILLed; the other
    node's worker, still running, is left alone and the other launcher exits 0 when it ends."""
    staying, port = 1 - leaving, str(free_port())
    sleep = {leaving: "0", staying: "8"}
    procs = {n: start(phalanx_cmd("--nnodes", "2", "--node-rank", str(n), "--master-addr",
                                  "127.0.0.1", "--master-port", port, "--rdzv-timeout", "30",
                                  BEHAVE, "--record", str(tmp_path), "--sleep", sleep[n],
                                  "--on-sigterm-exit", "3"), node_env())
             for n in (0, 1)}
    wait_for_files([tmp_path / "pid.0", tmp_path / "pid.1"])
    gone = int((tmp_path / f"pid.{leaving}").read_text())
    deadline = time.monotonic() + 30
    while alive(gone) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # its launcher has reported its workers done (every --monitor-interval)
    procs[leaving].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    res = finish(procs[staying], timeout=60)
    finish(procs[leaving])
    assert res.code == 0, res.err
    assert not (tmp_path / f"signal.{staying}").exists(), res.err  # never stopped
    assert f"worker {staying} done" in res.out, res.out
    assert "meet again" not in res.err and "lost" not in res.err, res.err
    assert time.monotonic() - killed < 8 + SLACK_S


def test_the_store_moves_when_node_0s_launcher_is_killed(tmp_path):
    """--nnodes 2:3 on loopback, 3 nodes: node 0's launcher (the store's host) is SIGKILLed;
    nodes 1 and 2 stop their workers, meet at node 1 (the lowest surviving node) and run a
    round at world size 2 that succeeds."""
    port = str(free_port())
    procs = [start(phalanx_cmd("--nnodes", "2:3", "--node-rank", str(n), "--master-addr",
                               "127.0.0.1", "--master-port", port, "--rdzv-timeout", "30",
                               "--shutdown-timeout", "3", BEHAVE, "--record", str(tmp_path),
                               "--first-sleep", "60", "--sleep", "1", "--on-sigterm-exit", "0"),
                   node_env()) for n in range(3)]
    wait_for_files([tmp_path / f"pid.{r}" for r in range(3)])
    procs[0].send_signal(signal.SIGKILL)
    results = [finish(p, timeout=90) for p in procs[1:]]
    finish(procs[0])
    for res in results:
        assert res.code == 0, res.err
    assert "the store moves" in results[0].err, results[0].err
    assert "node 1 (" in results[0].err and "hosts the store at 127.0.0.1:" in results[0].err
    assert "the store moved to node 1" in results[1].err, results[1].err
    for res in results:
        assert "round 1: 2 node(s)" in res.err and "world size 2" in res.err, res.err
    attempts = (tmp_path / "attempts.log").read_text().splitlines()
    assert sorted(a for a in attempts if a.startswith("attempt 1")) == [
        "attempt 1 rank 0", "attempt 1 rank 1"], attempts


def test_two_nodes_the_host_exits_the_other_goes_on_alone(tmp_path):
    """--nnodes 1:2: node 0's launcher is SIGKILLed. Its address then refuses connections (its
    machine is up, its launcher gone): it exited, and does not vote, so node 1 alone is the
    majority of the one node left that may still run; it hosts the store and goes on."""
    port = str(free_port())
    procs = [start(phalanx_cmd("--nnodes", "1:2", "--node-rank", str(n), "--master-addr",
                               "127.0.0.1", "--master-port", port, "--rdzv-timeout", "30",
                               "--rdzv-conf", "last_call_timeout=20", "--shutdown-timeout", "3",
                               BEHAVE, "--record", str(tmp_path), "--first-sleep", "60",
                               "--sleep", "1", "--on-sigterm-exit", "0"), node_env())
             for n in range(2)]
    wait_for_files([tmp_path / f"pid.{r}" for r in range(2)])
    procs[0].send_signal(signal.SIGKILL)
    res = finish(procs[1], timeout=90)
    finish(procs[0])
    assert res.code == 0, res.err
    assert "the store's host, node 0 (" in res.err and "exited; the store moves" in res.err
    assert "round 1: 1 node(s)" in res.err and "world size 1" in res.err, res.err
    assert "lost the majority" not in res.err
