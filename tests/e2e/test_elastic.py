"""Elastic membership with real launchers: a node lost and replaced, a job that outlives node
0's launcher, and a store that no one without the job secret can reach.

The training run is ``scripts/ckpt_train.py`` with a constant global batch of 8
(``phalanx.accumulation_steps``: 1 micro-batch of 4 per rank at world size 2, 2 at world size
1), so every epoch is 12 steps whatever the world size. Its per-rank logs say which round
(``TORCHELASTIC_RESTART_COUNT``) trained which sample at which step, and where each round
resumed; cut where the next round resumed, they must hold every sample once per epoch.
"""

from __future__ import annotations

import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.e2e.launch_helpers import (
    BEHAVE,
    WILDCARDS,
    alive,
    finish,
    in_namespace,
    listening_addresses,
    node_env,
    phalanx_cmd,
    start,
    tree_listeners,
    veth_namespaces,
    wait_for_files,
)
from tests.harness import free_port

pytestmark = pytest.mark.slow  # launchers lost, replaced and outlived, training for real

SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "ckpt_train.py")
SAMPLES, EPOCHS = 96, 2  # the script's defaults


def _log(directory: Path) -> list[list[str]]:
    return [line.split() for f in sorted(directory.glob("samples.rank*.log"))
            for line in f.read_text().splitlines()]


def _resumes(directory: Path) -> dict[int, int]:
    """Round -> the step it resumed after (from any of its ranks)."""
    return {int(r): int(step) for kind, r, step, *_ in _log(directory) if kind == "R"}


def _assert_every_sample_once(directory: Path, epochs: int = EPOCHS) -> None:
    resumes = _resumes(directory)

    def cut(round_: int) -> float:  # the step the next round went back to
        later = [r for r in resumes if r > round_]
        return resumes[min(later)] if later else float("inf")

    kept = [(int(e), int(i)) for kind, r, e, s, i in
            (f for f in _log(directory) if f[0] == "S") if int(s) <= cut(int(r))]
    for epoch in range(epochs):
        assert sorted(i for e, i in kept if e == epoch) == list(range(SAMPLES)), epoch


def _wait_for(predicate, what: str, timeout: float = 120, needs=()) -> None:
    """Wait until ``predicate()``; fail after ``timeout`` s, or as soon as one of the launchers
    it ``needs`` (``subprocess.Popen``) has exited: then it can never happen (on a loaded
    machine, the others may have finished the job before a node rejoined), and the failure
    shows what that launcher said instead of waiting out the timeout."""
    deadline = time.monotonic() + timeout
    while not predicate():
        ended = [proc for proc in needs if proc.poll() is not None]
        if ended and not predicate():
            said = "".join(f"\n--- launcher (pid {proc.pid}) exited {proc.returncode}:\n"
                           f"{finish(proc).err[-3000:]}" for proc in ended)
            raise AssertionError(f"never happened: {what}; a launcher it needs has exited{said}")
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.05)


def _kill(procs) -> None:
    """Kill the launchers a failed test left running (each kills its workers as it dies)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _steps_of_round(directory: Path, round_: int) -> list[int]:
    return [int(f[3]) for f in _log(directory) if f[0] == "S" and f[1] == str(round_)]


def _ss(ns: str) -> list[tuple[str, int]]:
    return listening_addresses(subprocess.run(in_namespace(ns, ["ss", "-ltnH"]), check=True,
                                              capture_output=True, text=True).stdout)


@pytest.mark.netns
def test_a_node_lost_then_back_in_network_namespaces(tmp_path):
    """--nnodes 1:2, 2 nodes x 1 rank: node 1's launcher is SIGKILLed mid-training, node 0
    goes on alone from the last checkpoint; node 1 started again (without --node-rank) is
    let in and the job ends at world size 2, every sample trained once."""
    ckpt = tmp_path / "ckpt"
    with veth_namespaces() as nodes:
        (ns0, dev0, addr0), (ns1, dev1, _) = nodes

        def node(ns: str, dev: str, *rank: str):
            cmd = phalanx_cmd("--nnodes", "1:2", *rank, "--master-addr", addr0, "--master-port",
                              "29500", "--rdzv-timeout", "60", "--rdzv-conf",
                              "last_call_timeout=10", SCRIPT, "--dir", str(ckpt),
                              "--global-batch", "8", "--step-delay", "0.25")
            return start(in_namespace(ns, cmd), node_env(GLOO_SOCKET_IFNAME=dev))

        node0, node1 = node(ns0, dev0, "--node-rank", "0"), node(ns1, dev1, "--node-rank", "1")
        started = [node0, node1]
        try:
            # a step after the checkpoint of step 5: steps 6.. are lost with node 1
            _wait_for(lambda: 7 in _steps_of_round(ckpt, 0), "step 7 at world size 2",
                      needs=[node0, node1])
            node1.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            finish(node1)
            _wait_for(lambda: _steps_of_round(ckpt, 1), "node 0 training alone", needs=[node0])
            alone = time.monotonic() - killed
            print(f"from node 1's SIGKILL to node 0's first step alone: {alone:.1f} s")
            node1 = node(ns1, dev1)  # the same command; elastic numbers it as it joins
            started.append(node1)
            _wait_for(lambda: _steps_of_round(ckpt, 2), "node 1 back in", needs=[node0, node1])
            listeners = {ns: _ss(ns) for ns in (ns0, ns1)}
            results = [finish(node0, timeout=180), finish(node1, timeout=180)]
        finally:
            _kill(started)
    for res in results:
        assert res.code == 0, res.err
    out0 = results[0].err
    assert "node 1 (" in out0 and "left: the nodes meet again (no restart used)" in out0, out0
    assert "joined: the nodes meet again (no restart used)" in out0, out0
    assert "round 1: 1 node(s)" in out0 and "world size 1" in out0, out0
    assert "round 2: 2 node(s)" in results[1].err, results[1].err
    resumes = _resumes(ckpt)
    assert sorted(resumes) == [0, 1, 2], resumes
    assert resumes[1] == 5, resumes  # the last checkpoint before node 1 was lost
    assert resumes[2] > resumes[1], resumes  # node 0 checkpointed when node 1 came back
    _assert_every_sample_once(ckpt)
    assert alone < 30, alone  # re-rendezvous and restart at world size 1
    for ns, found in listeners.items():  # `ss -ltn` in each namespace: no wildcard listener
        assert found and not [a for a, _ in found if a in WILDCARDS], (ns, found)


def test_node_1_succeeds_after_node_0s_launcher_has_gone(tmp_path):
    """Every worker succeeded; node 0's launcher exits at once; node 1, frozen until then,
    still learns the job's end from node 0's lingering store and exits 0."""
    port = str(free_port())
    procs = [start(phalanx_cmd("--nnodes", "2", "--node-rank", str(n), "--master-addr",
                               "127.0.0.1", "--master-port", port, BEHAVE, "--record",
                               str(tmp_path), "--sleep", "4" if n == 0 else "0"), node_env())
             for n in (0, 1)]
    wait_for_files([tmp_path / "pid.1"])
    worker1 = int((tmp_path / "pid.1").read_text())
    _wait_for(lambda: not alive(worker1), "node 1's worker done")
    time.sleep(1.0)  # node 1's launcher reports its workers done at once; then it is frozen
    procs[1].send_signal(signal.SIGSTOP)
    try:
        node0 = finish(procs[0], timeout=60)
    finally:
        procs[1].send_signal(signal.SIGCONT)
    node1 = finish(procs[1], timeout=60)
    assert node0.code == 0, node0.err
    assert node1.code == 0, node1.err
    assert "lost the rendezvous store" not in node1.err


def _write_a_key(addr: str, port: int) -> str | None:
    """What a plain TCPStore client at ``addr:port`` managed: ``None`` when it wrote nothing."""
    try:
        dist.TCPStore(addr, port, None, False, timedelta(seconds=1)).set("evil", "1")
    except RuntimeError:  # refused, closed, or never answered
        return None
    return f"wrote a key through {addr}:{port}"


def test_no_wildcard_listener_and_no_entry_without_the_secret(tmp_path):
    """One node and two nodes on loopback: every listening socket of the launchers and their
    helpers is on the master address or loopback, and a client without the secret (this test
    process: neither a launcher nor a worker of the job) gets through none of them."""
    port = str(free_port())
    jobs = [start(phalanx_cmd("--nnodes", "2", "--node-rank", str(n), "--master-addr",
                              "127.0.0.1", "--master-port", port, BEHAVE, "--record",
                              str(tmp_path), "--sleep", "30", "--on-sigterm-exit", "0"), node_env())
            for n in (0, 1)]
    (tmp_path / "one").mkdir()
    jobs.append(start(phalanx_cmd("--standalone", BEHAVE, "--record", str(tmp_path / "one"),
                                  "--sleep", "30", "--on-sigterm-exit", "0")))
    try:
        wait_for_files([tmp_path / "pid.0", tmp_path / "pid.1", tmp_path / "one" / "pid.0"])
        found = [entry for job in jobs for entry in tree_listeners(job.pid)]
        assert len(found) >= 6, found  # the gate, and doors and stores on loopback
        assert {addr for _, addr, _ in found} == {"127.0.0.1"}, found
        with ThreadPoolExecutor(len(found)) as pool:  # each attempt waits for its timeout
            wrote = list(pool.map(lambda entry: _write_a_key(*entry[1:]), found))
        assert wrote == [None] * len(found), (wrote, found)
    finally:
        for job in jobs:
            job.send_signal(signal.SIGTERM)
        results = [finish(job) for job in jobs]
    # node 0's gate and every door said whom they refused; the stores themselves are locked
    # (TCP-MD5): a connection attempt never reaches them
    assert "it did not prove this job's secret" in results[0].err, results[0].err
    for res in results:
        assert "not a process of this job" in res.err, res.err
