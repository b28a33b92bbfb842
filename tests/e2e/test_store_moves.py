"""Any node may be lost, the store's host too: three launchers, ``--nnodes 2:3``, each in a
network namespace of its own on one bridge, training ``scripts/ckpt_train.py`` for real.

The store's host (node 0) is SIGKILLed, or cut off (``ip link set down``: no FIN, no RST); the
two others meet at node 1 and train on at world size 2 from the last checkpoint, every sample
of each epoch once (the per-sample logs, as in test_elastic.py). A node cut off alone stops by
itself, saying it lost the majority; node 0 started again finds the job at node 1 through
``--rdzv-endpoint``'s list and joins the next round.

A global batch of 12 (micro-batches of 2: 2 per step at world size 3, 3 at world size 2), so
every epoch is 8 steps whatever the world size.
"""

from __future__ import annotations

import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from phalanx.gate.listen import DEAD_PEER_S
from tests.e2e.launch_helpers import (
    bridged_namespaces,
    finish,
    in_namespace,
    node_env,
    phalanx_cmd,
    set_link,
    start,
)
from tests.e2e.test_elastic import (SCRIPT, _assert_every_sample_once, _kill, _log, _resumes,
                                    _wait_for)

pytestmark = [pytest.mark.slow, pytest.mark.netns]

PORT = "29500"
SHUTDOWN_S = 3.0  # --shutdown-timeout: workers stuck in a collective with a lost peer


def _first_step_after(directory: Path, round_: int) -> bool:
    return any(f[0] == "S" and int(f[1]) > round_ for f in _log(directory))


def _steps_of(directory: Path, round_: int) -> list[int]:
    return [int(f[3]) for f in _log(directory) if f[0] == "S" and int(f[1]) == round_]


class Job:
    """Three launchers of one job, each in its namespace."""

    def __init__(self, nodes, ckpt: Path, epochs: int = 2) -> None:
        self.nodes, self.ckpt, self.epochs = nodes, ckpt, epochs
        self.endpoints = ",".join(f"{addr}:{PORT}" for _, _, addr in nodes)
        self.procs = [self.start(n) for n in range(len(nodes))]
        self.started = list(self.procs)  # every launcher, killed at the end if still running

    def start(self, n: int):
        ns, dev, _ = self.nodes[n]
        cmd = phalanx_cmd("--nnodes", "2:3", "--node-rank", str(n), "--rdzv-endpoint",
                          self.endpoints, "--rdzv-timeout", "60", "--rdzv-conf",
                          "last_call_timeout=20", "--shutdown-timeout", str(SHUTDOWN_S),
                          SCRIPT, "--dir", str(self.ckpt), "--batch", "2", "--global-batch",
                          "12", "--step-delay", "0.4", "--epochs", str(self.epochs))
        proc = start(in_namespace(ns, cmd), node_env(GLOO_SOCKET_IFNAME=dev))
        if hasattr(self, "started"):
            self.started.append(proc)
        return proc

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc) -> None:
        _kill(self.started)

    def wait_past_checkpoint(self) -> None:
        """Round 0 at world size 3, a step after the checkpoint of step 5."""
        _wait_for(lambda: 7 in _steps_of(self.ckpt, 0), "step 7 at world size 3", 240,
                  needs=self.procs)

    def time_to_next_step(self, lost_at: float, survivors, round_: int = 0) -> float:
        _wait_for(lambda: _first_step_after(self.ckpt, round_), "a step of a later round", 240,
                  needs=survivors)
        return time.monotonic() - lost_at


@pytest.mark.parametrize("victim", [0, 2], ids=["store-host", "other-node"])
def test_a_launcher_killed_the_others_go_on(tmp_path, victim):
    """SIGKILL node 0's launcher (the store's host), or node 2's for comparison: the two
    others train on at world size 2 from the last checkpoint and exit 0."""
    with bridged_namespaces(3) as nodes, Job(nodes, tmp_path / "ckpt") as job:
        job.wait_past_checkpoint()
        job.procs[victim].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        gap = job.time_to_next_step(killed, [p for n, p in enumerate(job.procs) if n != victim])
        print(f"node {victim} SIGKILLed: {gap:.1f} s to the survivors' next training step")
        finish(job.procs[victim])
        results = [finish(p, timeout=240) for n, p in enumerate(job.procs) if n != victim]
    for res in results:
        assert res.code == 0, res.err
        assert "world size 2" in res.err, res.err
    if victim == 0:
        assert "node 0 (" in results[0].err and "exited; the store moves" in results[0].err
        assert f"hosts the store at {nodes[1][2]}:{PORT}" in results[0].err, results[0].err
        assert "the store moved to node 1 (" in results[1].err, results[1].err
    resumes = _resumes(tmp_path / "ckpt")
    assert sorted(resumes) == [0, 1] and resumes[1] == 5, resumes
    _assert_every_sample_once(tmp_path / "ckpt")
    assert gap < 30, gap


def test_the_store_host_cut_off_stops_and_rejoins_when_started_again(tmp_path):
    """Cut node 0's link: nodes 1 and 2 meet at node 1 and train on; node 0 stops by itself
    within DEAD_PEER_S + --shutdown-timeout + 10 s, saying it lost the majority. Its link
    back and its launcher started again (same command), it finds the job at node 1 and
    joins the next round; every launcher still running exits 0."""
    ckpt = tmp_path / "ckpt"
    # 4 epochs (32 steps): the survivors must still be training when node 0, stopped and
    # started again (torch's import on a loaded machine), comes back
    with bridged_namespaces(3) as nodes, Job(nodes, ckpt, epochs=4) as job:
        job.wait_past_checkpoint()
        set_link(nodes[0][0], nodes[0][1], "down")
        cut = time.monotonic()
        with ThreadPoolExecutor(1) as pool:  # both timed from the cut, as they happen
            stopping = pool.submit(finish, job.procs[0], 120, cut)
            gap = job.time_to_next_step(cut, job.procs[1:])
            cut_off = stopping.result()
        stopped = cut_off.seconds
        print(f"node 0 cut off: it stopped after {stopped:.1f} s; {gap:.1f} s to the "
              "survivors' next training step")
        set_link(nodes[0][0], nodes[0][1], "up")
        job.procs[0] = job.start(0)
        _wait_for(lambda: _steps_of(ckpt, 2), "a step of round 2 (node 0 back)", 240,
                  needs=job.procs)
        results = [finish(p, timeout=240) for p in job.procs]
    assert cut_off.code == 1, cut_off.err
    host = socket.gethostname()
    assert "node 0 (" in cut_off.err and "lost the majority: 1 of the last round's 3" in cut_off.err
    assert f"node 1 ({host}), node 2 ({host}) cannot be reached" in cut_off.err, cut_off.err
    assert stopped < DEAD_PEER_S + SHUTDOWN_S + 10, stopped
    for res in results:
        assert res.code == 0, res.err
    assert f"hosts the store at {nodes[1][2]}:{PORT}" in results[1].err, results[1].err
    assert "round 2: 3 node(s)" in results[0].err, results[0].err  # node 0 started again
    assert "joined: the nodes meet again" in results[1].err, results[1].err
    resumes = _resumes(ckpt)
    assert sorted(resumes) == [0, 1, 2] and resumes[1] == 5, resumes
    _assert_every_sample_once(ckpt, epochs=4)
    assert gap < 60, gap


def test_a_job_cut_1_plus_2_only_the_side_of_2_trains_on(tmp_path):
    """Cut node 2 off: nodes 0 and 1 (the majority, with the store) train on at world size
    2; node 2 elects itself (it cannot reach node 1), finds no majority and stops, having
    trained nothing after the cut."""
    ckpt = tmp_path / "ckpt"
    with bridged_namespaces(3) as nodes, Job(nodes, ckpt) as job:
        job.wait_past_checkpoint()
        set_link(nodes[2][0], nodes[2][1], "down")
        cut = time.monotonic()
        with ThreadPoolExecutor(1) as pool:  # both timed from the cut, as they happen
            stopping = pool.submit(finish, job.procs[2], 240, cut)
            gap = job.time_to_next_step(cut, job.procs[:2])
            alone = stopping.result()
        stopped = alone.seconds
        results = [finish(p, timeout=240) for p in job.procs[:2]]
    print(f"node 2 cut off: {gap:.1f} s to the majority's next step; it stopped after "
          f"{stopped:.1f} s")
    for res in results:
        assert res.code == 0, res.err
        assert "round 1: 2 node(s)" in res.err, res.err
    assert alone.code == 1, alone.err
    # it notices, stops its workers, finds node 0 silent (one probe) and gives node 1 its time
    reach = DEAD_PEER_S + SHUTDOWN_S + 5
    assert stopped < DEAD_PEER_S + SHUTDOWN_S + 2 + reach + 10, stopped
    assert "node 2 (" in alone.err and "lost the majority: 1 of the last round's 3" in alone.err
    host = socket.gethostname()  # the namespaces share it
    assert f"node 0 ({host}), node 1 ({host}) cannot be reached" in alone.err, alone.err
    # rank 2 was node 2's worker in round 0; rounds after the cut have ranks 0 and 1 only
    assert {f[1] for f in (line.split() for line in
                           (ckpt / "samples.rank2.log").read_text().splitlines())} == {"0"}
    _assert_every_sample_once(ckpt)
